"""The staging directory of one conversion, kept across crashes so a rerun resumes it.

Knows the filesystem and ``fcntl`` locks; nothing of tensors. The directory sits beside DST as
``.<dst>.convert-<plan digest>``: a rerun of the same conversion (same source, plan and options)
finds it, and a shard counts as finished only once its file was synced and renamed into place and
its ``.done`` record written after, so a shard cut off mid-write is simply written again. An
exclusive lock keeps two live converters out of one directory; a directory whose lock nobody
holds, left by another plan for the same DST, is stale and removed. ``publish`` renames the
directory onto DST in one step (``atomic_dir.publish_directory``).
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from rollmesh.checkpoint.atomic_dir import fsync_directory, publish_directory, write_file_atomically
from rollmesh.checkpoint.errors import CheckpointWriteError

_RECORDS = ".convert"  # inside the staging directory: the lock and the finished-shard records


@dataclass(frozen=True)
class ShardDone:
    file: str
    sha256: str
    nbytes: int


class ResumableStaging:
    def __init__(self, final: Path, digest: str) -> None:
        self.final = Path(final)
        self.path = self.final.with_name(f".{self.final.name}.convert-{digest}")
        self._records = self.path / _RECORDS
        self._lock: int | None = None

    def __enter__(self) -> ResumableStaging:
        try:
            self.final.parent.mkdir(parents=True, exist_ok=True)
            self._remove_stale_plans()
            self._records.mkdir(parents=True, exist_ok=True)
            self._lock = _try_lock(self._records / "lock")
        except OSError as exc:
            raise CheckpointWriteError(f"cannot stage: {exc}", path=str(self.final)) from exc
        if self._lock is None:
            raise CheckpointWriteError("another conversion is writing this export now", path=str(self.final))
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        # On an error the directory stays, with its finished shards, for the rerun to resume.
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None

    def finished(self, file: str) -> ShardDone | None:
        """The record of shard ``file`` if it was finished by an earlier run, else None."""
        try:
            record = json.loads((self._records / f"{file}.done").read_text())
            done = ShardDone(file, str(record["sha256"]), int(record["nbytes"]))
            if (self.path / file).stat().st_size == done.nbytes:
                return done
        except (OSError, ValueError, KeyError, TypeError):
            pass  # absent or damaged: write it again
        return None

    def mark_finished(self, file: str, sha256: str, nbytes: int) -> None:
        record = json.dumps({"sha256": sha256, "nbytes": nbytes}).encode()
        write_file_atomically(self._records / f"{file}.done", record)

    def write_file(self, name: str, data: bytes) -> None:
        write_file_atomically(self.path / name, data)

    def publish(self) -> None:
        """Drop the records and any cut-off partial file, then rename the directory onto DST."""
        shutil.rmtree(self._records, ignore_errors=True)
        for partial in self.path.glob("*.partial"):
            partial.unlink()
        fsync_directory(self.path)
        publish_directory(self.path, self.final)

    def _remove_stale_plans(self) -> None:
        for candidate in self.final.parent.glob(f".{self.final.name}.convert-*"):
            if candidate == self.path:
                continue
            lock = _try_lock(candidate / _RECORDS / "lock") if (candidate / _RECORDS).is_dir() else -1
            if lock is not None:  # nobody converts into it now
                shutil.rmtree(candidate, ignore_errors=True)
                if lock >= 0:
                    os.close(lock)


def _try_lock(path: Path) -> int | None:
    """An open descriptor holding an exclusive lock on ``path``, or None if someone else holds it."""
    descriptor = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(descriptor)
        return None
    return descriptor
