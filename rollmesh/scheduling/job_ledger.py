"""The live scheduler's job ledger: ``<run dir>/scheduler/jobs.jsonl``, submitted specs then final
outcomes, read back at start so a restarted scheduler queues every unfinished job again.

Knows the job submission message and files; no Ray, NATS or clock. Split out of
``lending_service`` (which uses it and re-exports it) to keep that module readable.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import msgspec

from rollmesh.messages.sim_jobs import SimJobSubmitted


class JobLedger:
    """Append-only: a ``submitted`` line per job, an ``ended`` line when it is done for good."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)

    def unfinished(self) -> list[SimJobSubmitted]:
        specs: dict[str, SimJobSubmitted] = {}
        if self.path.exists():
            for line in self.path.read_text().splitlines():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line torn by a crash: its job was never acked, so it comes again
                if record.get("event") == "submitted":
                    specs[record["job"]["job_id"]] = msgspec.convert(record["job"], SimJobSubmitted)
                elif record.get("event") == "ended":
                    specs.pop(record["job_id"], None)
        return list(specs.values())

    def append(self, record: dict[str, Any]) -> None:
        """Durable on return (written and fsynced): a submission is acked only after this."""
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())
