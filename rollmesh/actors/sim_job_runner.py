"""Runs one simulation job's process inside the accelerators the GPU scheduler lent it.

Knows subprocess, signals and the job's directory; nothing of NATS or the policy (the scheduler
actor speaks the preemption protocol and decides; this runs what it decides). No ray import: the
scheduler actor makes it a Ray actor placed in the job's placement group, so Ray's resource
accounting (and, with resource "GPU", ``CUDA_VISIBLE_DEVICES``) is the job's. A job on devices
borrowed from the mesh's roles (``scheduler.lend_role_accelerators``) runs outside that accounting
(the role workers keep the resource, their memory released): its ``CUDA_VISIBLE_DEVICES`` names
the borrowed devices (and any Ray gave this runner for the free ones), ``ROLLMESH_JOB_BORROWED``
the workers it borrowed them from.

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
    def __init__(self, job_id: str, command: list[str], *, job_dir: str, borrowed: list[str] = (),
                 borrowed_cuda_devices: list[str] = (), ray_devices: bool = False) -> None:
        """``borrowed``: the role workers whose devices the job borrows; ``borrowed_cuda_devices``:
        the CUDA devices each of them saw ("" with a declared custom resource: none);
        ``ray_devices``: Ray gave this runner GPUs of its own too (its placement group's)."""
        self.job_id = job_id
        self.command = command
        self.job_dir = Path(job_dir)
        self.borrowed = list(borrowed)
        self.borrowed_cuda_devices = list(borrowed_cuda_devices)
        self.ray_devices = ray_devices
        self.process: subprocess.Popen | None = None

    def job_environment(self, attempt: int) -> dict[str, str]:
        env = {**os.environ, "ROLLMESH_JOB_ID": self.job_id, "ROLLMESH_JOB_ATTEMPT": str(attempt),
               "ROLLMESH_JOB_CHECKPOINT_DIR": str(self.job_dir / "checkpoint")}
        if self.borrowed:
            # Ray set this runner's CUDA_VISIBLE_DEVICES for its own (free) GPUs only, if any.
            own = [env.get("CUDA_VISIBLE_DEVICES", "")] if self.ray_devices else []
            env["CUDA_VISIBLE_DEVICES"] = ",".join(d for d in [*self.borrowed_cuda_devices, *own] if d)
            env["ROLLMESH_JOB_BORROWED"] = ",".join(self.borrowed)
        return env

    def start(self, attempt: int) -> int:
        """Start the job's process (attempt 1, 2... after preemptions); returns its pid."""
        (self.job_dir / "checkpoint").mkdir(parents=True, exist_ok=True)
        env = self.job_environment(attempt)
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
