"""Runs one simulation job's process inside the accelerators the GPU scheduler lent it.

Knows subprocess, signals and the job's directory; nothing of NATS or the policy (the scheduler
actor speaks the preemption protocol and decides; this runs what it decides). No ray import: the
scheduler actor makes it a Ray actor placed in the job's placement group, so Ray's resource
accounting (and, with resource "GPU", ``CUDA_VISIBLE_DEVICES``) is the job's.

The job is the user's command, run in its own session (signals reach the whole process tree):
- its environment names where it checkpoints (``ROLLMESH_JOB_CHECKPOINT_DIR``, the same
  directory at every restart, so it resumes) and its id (``ROLLMESH_JOB_ID``);
- a preemption request is SIGTERM: the job checkpoints and exits, which is its acknowledgement;
- a force-kill is SIGKILL to the session; and if this runner dies first (its actor killed), the
  kernel kills the job too (``PR_SET_PDEATHSIG``), so no job outlives the accelerators it held.
See examples/sim_counter_job.py for a job that follows the protocol.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import signal
import subprocess
from pathlib import Path

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # runs in the child between fork and exec
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


class SimJobRunner:
    def __init__(self, job_id: str, command: list[str], *, job_dir: str) -> None:
        self.job_id = job_id
        self.command = command
        self.job_dir = Path(job_dir)
        self.process: subprocess.Popen | None = None

    def start(self, attempt: int) -> int:
        """Start the job's process (attempt 1, 2... after preemptions); returns its pid."""
        checkpoints = self.job_dir / "checkpoint"
        checkpoints.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "ROLLMESH_JOB_ID": self.job_id, "ROLLMESH_JOB_CHECKPOINT_DIR": str(checkpoints),
               "ROLLMESH_JOB_ATTEMPT": str(attempt)}
        with open(self.job_dir / f"attempt_{attempt}.log", "ab") as log:
            self.process = subprocess.Popen(self.command, env=env, cwd=self.job_dir, stdout=log,
                                            stderr=subprocess.STDOUT, start_new_session=True,
                                            preexec_fn=_die_with_parent)
        return self.process.pid

    def request_preemption(self) -> None:
        """SIGTERM to the job's session: checkpoint and exit."""
        self._signal(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL to the job's session: the deadline passed."""
        self._signal(signal.SIGKILL)

    def _signal(self, signum: int) -> None:
        if self.process is not None and self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signum)
            except ProcessLookupError:
                pass  # exited in between

    async def wait(self, poll_s: float = 0.05) -> int:
        """The job's exit code, once it exits (0: finished, or checkpointed after a preemption)."""
        assert self.process is not None, "start() first"
        while (code := self.process.poll()) is None:
            await asyncio.sleep(poll_s)
        return code

    def exit_code(self) -> int | None:
        return None if self.process is None else self.process.poll()
