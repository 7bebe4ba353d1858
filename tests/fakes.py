"""Fakes for the true edges of the system, one class per edge; each says what it fakes.

Only edges are faked (a process we would spawn, the wall clock); plain logic is always real.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rollmesh.sandbox.backend_protocol import ExecResult


class FakeSandboxBackend:
    """Fakes a ``rollmesh.sandbox.SandboxBackend``: runs nothing.

    Each ``run`` records its call in ``calls`` and returns the next scripted outcome from
    ``outcomes`` (an ``ExecResult``, or an exception to raise); when none are left it returns an
    empty success.
    """

    name = "fake"
    isolated = True

    def __init__(self, outcomes: list[ExecResult | BaseException] | None = None) -> None:
        self.outcomes = list(outcomes or [])
        self.calls: list[dict[str, Any]] = []

    async def run(self, argv: list[str], *, workdir: Path, **limits: Any) -> ExecResult:
        self.calls.append({"argv": argv, "workdir": workdir, "workdir_existed": workdir.is_dir(), **limits})
        outcome = self.outcomes.pop(0) if self.outcomes else ExecResult(0, "", "", 0.0)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome


class ManualClock:
    """Fakes the wall clock (``time.time``): time moves only when a test calls ``advance``."""

    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds
