"""Atomic directory publishing: build a directory beside its final name, then rename it in.

Knows the filesystem only, not what the files are. A reader sees no directory or a complete one,
never half of one. Staging sits next to the final path because rename is atomic only within one
filesystem (across filesystems it is a copy).
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from uuid import uuid4

from rollmesh.checkpoint.errors import CheckpointWriteError

# Concurrent writers of the same name (a redelivered event handled by two replicas) can keep
# moving each other's result aside; a few rounds always settle it, and more means a bug.
_PUBLISH_ATTEMPTS = 8


@contextmanager
def staged_directory(final: Path) -> Iterator[Path]:
    """Yield an empty staging directory; on normal exit make it durable and publish it as ``final``.

    On an exception the staging directory is removed and ``final`` is left as it was.
    """
    # The writer's pid in the name: a rerun after a crash removes the staging its dead
    # predecessor left, and never a live concurrent writer's.
    staging = final.with_name(f".{final.name}.staging-{os.getpid()}-{uuid4().hex}")
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        remove_abandoned_staging(final)
        # os.mkdir, not tempfile.mkdtemp: the published directory gets the umask's mode, not 0700.
        staging.mkdir()
    except OSError as exc:
        raise CheckpointWriteError(f"cannot stage: {exc}", path=str(final)) from exc
    try:
        yield staging
        _fsync_tree(staging)
        publish_directory(staging, final)
    except OSError as exc:  # disk full, permissions: the caller gets one typed error for all
        shutil.rmtree(staging, ignore_errors=True)
        raise CheckpointWriteError(str(exc), path=str(final)) from exc
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def remove_abandoned_staging(final: Path) -> list[Path]:
    """Remove the staging directories of ``final`` whose writer process is gone (killed
    mid-write); returns them."""
    removed = []
    for candidate in final.parent.glob(f".{final.name}.staging-*"):
        pid = candidate.name.rsplit(".staging-", 1)[1].split("-", 1)[0]
        if pid.isdigit() and not _process_alive(int(pid)):
            shutil.rmtree(candidate, ignore_errors=True)
            removed.append(candidate)
    return removed


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def publish_directory(staging: Path, final: Path) -> None:
    """Rename ``staging`` to ``final``, replacing a directory already there."""
    for _ in range(_PUBLISH_ATTEMPTS):
        try:
            os.rename(staging, final)
            break
        except OSError as exc:
            if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise CheckpointWriteError(f"publish failed: {exc}", path=str(final)) from exc
        # Linux cannot rename over a non-empty directory, so the old one is moved aside first.
        # Between the two renames the name is briefly absent: readers see nothing, never half.
        retired = final.with_name(f".{final.name}.retired-{uuid4().hex}")
        try:
            os.rename(final, retired)
        except FileNotFoundError:
            continue  # another writer moved it aside first
        except OSError as exc:
            raise CheckpointWriteError(f"cannot replace: {exc}", path=str(final)) from exc
        shutil.rmtree(retired, ignore_errors=True)
    else:
        raise CheckpointWriteError("publish kept racing with other writers", path=str(final))
    fsync_directory(final.parent)


def write_file_atomically(path: Path, data: bytes) -> None:
    """Write one file via a temporary sibling and ``os.replace``."""
    temporary = path.with_name(f".{path.name}.tmp-{uuid4().hex}")
    try:
        with open(temporary, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except OSError as exc:
        temporary.unlink(missing_ok=True)
        raise CheckpointWriteError(str(exc), path=str(path)) from exc
    fsync_directory(path.parent)


def _fsync_tree(root: Path) -> None:
    # Work is acknowledged only once durable: without fsync a crash after the rename can leave a
    # complete-looking directory of empty files.
    for entry in root.rglob("*"):
        if entry.is_file():
            with open(entry, "rb") as handle:
                os.fsync(handle.fileno())
    fsync_directory(root)


def fsync_directory(directory: Path) -> None:
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
