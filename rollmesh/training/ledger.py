"""The trainer's ledger: which trajectories each durable step consumed, and the weights it made.

Knows json and the filesystem; nothing of torch, NATS or Ray. One JSON line per step, appended
and fsynced *after* the step's weights file is on disk and *before* the step's trajectories are
acknowledged or its weights announced. That order is what makes training exactly-once:

- a trainer killed before the line is written loses the step: its trajectories were never
  acknowledged, so they are redelivered and trained again, once, by the restarted trainer, which
  resumes from the previous line's weights;
- a trainer killed after the line but before the acks finds the keys in the ledger when the
  trajectories are redelivered, and acknowledges them without training them again.

A line torn by a crash mid-write is ignored (its step is lost, as above). Keys are trajectories'
idempotency keys; a step lists every member of its groups, trained, stale or failed alike.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class LedgerEntry:
    step: int
    weight_version: int
    weights_path: str  # "" before the first weights were written
    sha256: str = ""
    num_bytes: int = 0
    keys: list[str] = field(default_factory=list)
    recorded_at: float = 0.0
    # The group ids of ``keys``, trained or dropped: what a `rollmesh train` feeder's resume reads
    # as the prompts consumed (its group ids name stage, epoch and dataset row).
    groups: list[str] = field(default_factory=list)
    # A supervised stage's place, recorded with the step that trained up to it (atomic with its
    # weights): {"stage": name, "next_position": int, "tokens": int} ({} for rl steps).
    cursor: dict = field(default_factory=dict)


@dataclass(frozen=True)
class LedgerState:
    """What a restarted trainer resumes from: the last entry and every key consumed so far."""

    last: LedgerEntry
    consumed: frozenset[str]
    entries: int
    # Every group id a step consumed (LedgerEntry.groups).
    groups: frozenset[str] = frozenset()


class TrainingLedger:
    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    def stage_cursor(self, stage: str) -> dict:
        """The newest cursor recorded for supervised stage ``stage`` ({} when none)."""
        found: dict = {}
        try:
            lines = self.path.read_text().splitlines()
        except FileNotFoundError:
            return found
        for line in lines:
            try:
                cursor = json.loads(line).get("cursor") or {}
            except (ValueError, AttributeError):
                continue
            if cursor.get("stage") == stage:
                found = cursor
        return found

    def read(self) -> LedgerState | None:
        """None when no step was ever recorded."""
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return None
        last: LedgerEntry | None = None
        consumed: set[str] = set()
        groups: set[str] = set()
        entries = 0
        for line in text.splitlines():
            try:
                entry = LedgerEntry(**json.loads(line))
            except (ValueError, TypeError):
                continue  # torn by a crash mid-write: that step never happened
            last, entries = entry, entries + 1
            consumed.update(entry.keys)
            groups.update(entry.groups)
        return None if last is None else LedgerState(last, frozenset(consumed), entries, frozenset(groups))

    def append(self, entry: LedgerEntry) -> None:
        """Durable on return (written and fsynced)."""
        append_line(self.path, json.dumps(asdict(entry), separators=(",", ":")), fsync=True)


def append_line(path: Path, line: str, *, fsync: bool = False) -> None:
    """``line`` as the file's last line; after a line torn by a crash, on a fresh one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        if handle.tell() and not _ends_with_newline(path):
            handle.write("\n")
        handle.write(line + "\n")
        if fsync:
            handle.flush()
            os.fsync(handle.fileno())


def _ends_with_newline(path: Path) -> bool:
    with open(path, "rb") as handle:
        handle.seek(-1, os.SEEK_END)
        return handle.read(1) == b"\n"
