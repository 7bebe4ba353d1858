"""The ``math`` reward: the final answer checked against the row's answer with math-verify, each
check in a worker process under a timeout.

Knows subprocesses and the reward types; nothing of Ray, NATS or the agent loop. A pathological
expression (a huge power, a nested radical sympy simplifies forever) must not hang the rollout
worker, and math-verify's own timeouts are ``signal.alarm`` based (main thread only; a rollout
worker runs rewards in threads): so checks run in worker processes, reused across calls, and one
that overruns its timeout is killed and replaced.

Each worker is a fresh interpreter (``python -m rollmesh.rewards.math_worker``), never a fork: Ray
actor processes are multi-threaded, and a forked copy of one may hold a lock another thread had.
multiprocessing's "spawn" start method was tried first and left: it re-runs the parent's main
script in the child (Ray's worker script, a user's unguarded script; it fails outright for a main
read from stdin). The pool is hand-rolled rather than ``concurrent.futures.ProcessPoolExecutor``:
that executor cannot kill one stuck task (a timed-out future keeps its process busy, and killing
the process breaks the whole pool).
"""

from __future__ import annotations

import atexit
import json
import os
import select
import subprocess
import sys
import threading
import time

import structlog

from rollmesh.rewards.errors import RewardError, RewardInputError, RewardUnavailableError
from rollmesh.rewards.math_worker import CHECK_ANSWER
from rollmesh.rewards.reward_input import RewardInput

_log = structlog.get_logger("rollmesh.rewards")
DEFAULT_TIMEOUT_S = 5.0
# Starting a worker imports sympy and math-verify and warms them: seconds on a loaded machine.
START_TIMEOUT_S = 120.0


class _WorkerDiedError(RewardError):  # private: caught here, never escapes
    pass


class _Worker:
    """One worker process and its line protocol (JSON lines over its stdin and stdout)."""

    def __init__(self, check_path: str) -> None:
        # The child finds what this process finds (an editable install, a test directory, a Ray
        # job's working_dir), and only that.
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(path for path in sys.path if path)}
        self.process = subprocess.Popen([sys.executable, "-m", "rollmesh.rewards.math_worker", check_path],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        self._pending = b""

    def send(self, gold: str, answer: str) -> None:
        assert self.process.stdin is not None
        try:
            self.process.stdin.write((json.dumps([gold, answer]) + "\n").encode())
            self.process.stdin.flush()
        except OSError as exc:  # a broken pipe: the process is gone
            raise _WorkerDiedError() from exc

    def read(self, timeout_s: float) -> list | None:
        """The next reply, or None when none came within ``timeout_s``."""
        assert self.process.stdout is not None
        fd = self.process.stdout.fileno()
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                raise _WorkerDiedError()
            self._pending += chunk
        line, _, self._pending = self._pending.partition(b"\n")
        return json.loads(line)

    def alive(self) -> bool:
        return self.process.poll() is None

    def kill(self) -> None:
        self.process.kill()
        self.process.wait(timeout=30)
        for pipe in (self.process.stdin, self.process.stdout):
            if pipe is not None:
                pipe.close()


class MathChecker:
    """Worker processes that run ``check`` (an import path, ``module:function(gold, answer) ->
    bool``): at most ``max_workers`` at once, started when needed, reused across checks.
    Thread-safe: rollouts check concurrently, each on a worker of its own."""

    def __init__(self, *, check: str = CHECK_ANSWER, max_workers: int = 4,
                 start_timeout_s: float = START_TIMEOUT_S) -> None:
        self.check_path = check
        self.max_workers = max_workers
        self.start_timeout_s = start_timeout_s
        self._idle: list[_Worker] = []
        self._workers = 0
        self._changed = threading.Condition()
        self.started = 0  # worker processes started so far (replacements included)

    def check(self, gold: str, answer: str, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> bool | None:
        """Whether ``answer`` matches ``gold``; None when the check ran past ``timeout_s`` (its
        process is killed, a new one serves the next check). Raises ``RewardUnavailableError``
        when a worker cannot start or dies during the check."""
        worker = self._acquire()
        try:
            worker.send(gold, answer)
            reply = worker.read(timeout_s)
        except _WorkerDiedError as exc:
            self._discard(worker)
            raise RewardUnavailableError("math", f"the math-verify worker process died during a check "
                                                 f"(exit code {worker.process.returncode})") from exc
        except BaseException:
            self._discard(worker)  # its protocol state is unknown
            raise
        if reply is None:
            self._discard(worker)
            return None
        self._release(worker)
        status, value = reply
        if status == "error":  # math-verify failed on this text: the output cannot be verified
            _log.warning("math_check_failed", error=value, answer=answer[:200])
            return False
        return bool(value)

    def close(self) -> None:
        """Stop the idle workers (busy ones are stopped when their check returns)."""
        with self._changed:
            idle, self._idle = self._idle, []
            self._workers -= len(idle)
        for worker in idle:
            worker.kill()

    def _acquire(self) -> _Worker:
        with self._changed:
            while True:
                while self._idle:
                    worker = self._idle.pop()
                    if worker.alive():
                        return worker
                    self._workers -= 1  # died while idle (killed from outside): replaced
                    worker.kill()
                if self._workers < self.max_workers:
                    self._workers += 1
                    break
                self._changed.wait()
        try:
            return self._start()
        except BaseException:
            with self._changed:
                self._workers -= 1
                self._changed.notify()
            raise

    def _start(self) -> _Worker:
        try:
            worker = _Worker(self.check_path)
        except OSError as exc:  # no processes left, no interpreter
            raise RewardUnavailableError("math", f"the math-verify worker process did not start: {exc!r}") from exc
        self.started += 1
        try:
            reply = worker.read(self.start_timeout_s)
        except (_WorkerDiedError, ValueError):
            reply = ["died"]
        if reply != ["ready", None]:
            worker.kill()
            state = "silent" if reply is None else reply[0]
            raise RewardUnavailableError("math", f"the math-verify worker process did not get ready "
                                                 f"({state}, exit code {worker.process.returncode})")
        return worker

    def _release(self, worker: _Worker) -> None:
        with self._changed:
            self._idle.append(worker)
            self._changed.notify()

    def _discard(self, worker: _Worker) -> None:
        worker.kill()
        with self._changed:
            self._workers -= 1
            self._changed.notify()


_checker: MathChecker | None = None
_checker_lock = threading.Lock()


def default_checker() -> MathChecker:
    """This process's checker, shared by every ``math`` reward in it (started on first use)."""
    global _checker
    with _checker_lock:
        if _checker is None:
            _checker = MathChecker()
            atexit.register(_checker.close)
        return _checker


def math_reward(sample: RewardInput, *, timeout_s: float = DEFAULT_TIMEOUT_S,
                checker: MathChecker | None = None) -> float:
    """1.0 when the final answer is mathematically the row's answer (math-verify), else 0.0. A
    check that runs past ``timeout_s`` scores 0.0 (the answer could not be verified) and is
    logged. A row without an answer raises ``RewardInputError``."""
    if sample.answer is None or not sample.answer.strip():
        raise RewardInputError("math", "the row has no answer to check against")
    if not sample.final_text.strip():
        return 0.0  # no final answer (the rollout ended on a tool call, or was cut)
    verdict = (checker or default_checker()).check(sample.answer, sample.final_text, timeout_s=timeout_s)
    if verdict is None:
        _log.warning("math_check_timed_out", timeout_s=timeout_s, answer=sample.final_text[:200])
        return 0.0
    return 1.0 if verdict else 0.0
