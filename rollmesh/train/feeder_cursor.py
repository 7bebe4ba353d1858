"""The feeder's durable place in a training job: which stage it is in, where that stage started,
the next position to read from its data, and which of its published groups were not yet seen
consumed.

Knows json and the filesystem. The cursor is written (atomically, fsynced) *after* each group's
requests are acknowledged by JetStream: a feeder killed in between publishes that group again on
resume, with the same rollout ids, and the copy is absorbed (JetStream's duplicate window, then
the trainer's idempotency keys). Written before, a kill would skip the prompt. The trainer's
ledger, not this file, says what was consumed: on resume the outstanding groups are this file's
minus the ledger's.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

CURSOR_FILE = "feeder.json"


@dataclass(frozen=True)
class FeederCursor:
    stage_index: int = 0
    stage: str = ""
    # The trainer's step when the stage began: its steps are counted from here.
    start_step: int = -1
    # The next position in the stage's reading order (over epochs) to publish.
    next_position: int = 0
    # Groups published and not yet seen consumed or dropped.
    outstanding: list[str] = field(default_factory=list)
    dropped: int = 0
    done_stages: list[str] = field(default_factory=list)

    def with_(self, **changes) -> "FeederCursor":
        return replace(self, **changes)


def cursor_path(run_dir: Path) -> Path:
    return Path(run_dir) / "train" / CURSOR_FILE


def read_cursor(run_dir: Path) -> FeederCursor | None:
    """None when the job never published (a fresh run)."""
    try:
        data = json.loads(cursor_path(run_dir).read_text())
    except FileNotFoundError:
        return None
    return FeederCursor(**data)


def write_cursor(run_dir: Path, cursor: FeederCursor) -> None:
    path = cursor_path(run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_suffix(".tmp")
    with staging.open("w") as handle:
        json.dump(asdict(cursor), handle)
        handle.flush()
        os.fsync(handle.fileno())
    staging.replace(path)
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
