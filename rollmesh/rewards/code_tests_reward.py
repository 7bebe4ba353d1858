"""The ``code_tests`` reward: the row's unit tests run against the final answer's code, in a
fresh bubblewrap sandbox, and the reward is the fraction that passed (or 1.0 only if all did).

Knows the sandbox backends (``rollmesh.sandbox``), the runner it copies in
(``code_tests_runner``) and the reward types; nothing of Ray, NATS, the broker or the agent loop.

Why a fresh sandbox and not the rollout's own: the agent loop gives its lease back before it
scores, and a reward gets a ``RewardInput``, no sandbox handle. Handing rewards the rollout's lease
would change the agent loop (score while still leased, and call the broker from the reward's
thread); a sandbox of its own costs a bubblewrap start per score (a fraction of a second) and is
as isolated: the same backend, no network, a read-only minimal root, its own uid and cgroup
where the host allows, and none of the files a rollout's tools left behind (which could shadow
a module the tests import). The model's code never runs in the rollout worker's process. The
sandbox is the host's bubblewrap, not the broker's profile: it needs ``bwrap`` (and, as root,
``setpriv``) where the rollout worker runs.

The tests come from ``row[tests_field]``: a list of statements (each a test) or a string of test
code (each ``def test_*`` a test; without any, the whole string is one). The code is the final
answer, or the last fenced code block in it (```python ... ```). Code that fails, raises, hangs
past ``timeout_s`` per test, or exhausts its memory scores low: that is the model's doing. A
sandbox that cannot start or dies is a ``RewardUnavailableError``; a row without usable tests is
a ``RewardInputError``.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import secrets
import threading
from pathlib import Path
from typing import Any

from rollmesh.rewards.errors import RewardInputError, RewardUnavailableError
from rollmesh.rewards.reward_input import RewardInput
from rollmesh.sandbox.errors import SandboxError
from rollmesh.sandbox.sandbox_protocol import ExecOutcome, SandboxBackend, SandboxLimits
from rollmesh.sandbox.tool_paths import python_for_sandbox

RUNNER = Path(__file__).resolve().parent / "code_tests_runner.py"
ARG_TYPES: dict[str, tuple[type, ...]] = {
    "tests_field": (str,), "mode": (str,), "timeout_s": (int, float), "memory_mb": (int,),
}
MODES = ("fraction", "all")
# What a finished run's exec may end as and still be read: the code's own doing.
READABLE_RESULTS = frozenset({"exit", "timeout", "oom", "signal", "output_truncated"})
_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", re.DOTALL)


def check_args(args: dict[str, Any]) -> str:
    if args.get("mode", "fraction") not in MODES:
        return f"argument 'mode' must be one of {', '.join(MODES)}, not {args['mode']!r}"
    if args.get("timeout_s", 1) <= 0:
        return f"argument 'timeout_s' must be above 0, not {args['timeout_s']!r}"
    if args.get("memory_mb", 64) < 64:
        return f"argument 'memory_mb' must be at least 64, not {args['memory_mb']!r}"
    return ""


def code_of(final_text: str) -> str:
    """The last ```python (or ```py) block of the answer, else its last fenced block, else it whole."""
    blocks = _FENCE.findall(final_text)
    python = [code for language, code in blocks if language.lower() in ("python", "py", "python3")]
    if python or blocks:
        return (python or [code for _, code in blocks])[-1]
    return final_text


def tests_of(row: dict[str, Any], field: str) -> list[str] | str:
    """The row's tests, compiled once here so a syntax error is the row's (``RewardInputError``)."""
    tests = row.get(field)
    if isinstance(tests, list) and tests and all(isinstance(test, str) for test in tests):
        pieces = tests
    elif isinstance(tests, str) and tests.strip():
        pieces = [tests]
    else:
        raise RewardInputError("code_tests", f"the row's {field!r} must be test code or a non-empty list of "
                                             f"test statements, not {type(tests).__name__} {tests!r:.80}")
    for piece in pieces:
        try:
            compile(piece, "<tests>", "exec")  # compiled, never run, here
        except (SyntaxError, ValueError) as exc:
            raise RewardInputError("code_tests", f"the row's {field!r} does not compile: {exc}") from exc
    return tests


def read_results(outcome: ExecOutcome, nonce: str) -> tuple[int, int]:
    """(tests passed, tests in all) from the runner's lines."""
    total, passed = None, set()
    for line in outcome.stdout.decode(errors="replace").splitlines():
        mark, _, rest = line.partition(" ")
        if mark != nonce:
            continue
        word, _, number = rest.partition(" ")
        if word == "total" and total is None:
            total = int(number)
        elif word == "pass":
            passed.add(number)
    if total is None:  # our runner printed nothing: it did not run
        raise RewardUnavailableError("code_tests", f"the test runner did not start in the sandbox "
                                                   f"({outcome.result}: {outcome.stderr[-300:]!r})")
    return min(len(passed), total), total


class CodeSandboxes:
    """Fresh sandboxes for test runs, from one bubblewrap backend made on first use (a backend
    that cannot be made is tried again at the next score)."""

    def __init__(self, backend: SandboxBackend | None = None) -> None:
        self._backend = backend
        self._lock = threading.Lock()

    def backend(self) -> SandboxBackend:
        with self._lock:
            if self._backend is None:
                from rollmesh.sandbox.bwrap_backend import BwrapBackend  # noqa: PLC0415  (host tools on first use)
                self._backend = BwrapBackend()
            return self._backend

    def run(self, code: str, tests: list[str] | str, *, timeout_s: float, memory_mb: int) -> tuple[int, int]:
        """(passed, total). Blocks; call it from a thread without a running event loop (a
        reward's thread)."""
        try:
            return asyncio.run(self._run(code, tests, timeout_s=timeout_s, memory_mb=memory_mb))
        except SandboxError as exc:
            raise RewardUnavailableError("code_tests", f"the sandbox failed: {exc}") from exc

    async def _run(self, code: str, tests: list[str] | str, *, timeout_s: float, memory_mb: int) -> tuple[int, int]:
        count = len(tests) if isinstance(tests, list) else max(1, len(re.findall(r"^def test", tests, re.M)))
        # Each test, the solution's load and the tests' own code get timeout_s; the margin is the
        # runner's start. Past it (code that blocks SIGALRM) the run is killed and what had
        # passed by then counts.
        overall = timeout_s * (count + 2) + 5.0
        limits = SandboxLimits(memory_mb=memory_mb, pids=64, workspace_mb=64, exec_timeout_s=overall,
                               cpu_s=math.ceil(overall), file_size_mb=16, max_output_bytes=256 * 1024)
        sandbox = await self.backend().create(f"code-tests-{secrets.token_hex(4)}", limits)
        try:
            await sandbox.put_file("solution.py", code.encode())
            await sandbox.put_file("runner.py", RUNNER.read_bytes())
            nonce = secrets.token_hex(16)
            job = json.dumps({"nonce": nonce, "tests": tests, "timeout_s": timeout_s}).encode()
            outcome = await sandbox.exec([python_for_sandbox(), "-I", "-S", "runner.py"], stdin=job,
                                         timeout_s=overall)
        finally:
            await sandbox.destroy()
        if outcome.result not in READABLE_RESULTS:  # sandbox_died, infra_error: not the code's doing
            raise RewardUnavailableError("code_tests", f"the sandbox could not run the tests: {outcome.result} "
                                                       f"{outcome.detail}")
        return read_results(outcome, nonce)


_sandboxes = CodeSandboxes()


def code_tests_reward(sample: RewardInput, *, tests_field: str = "tests", mode: str = "fraction",
                      timeout_s: float = 5.0, memory_mb: int = 512,
                      sandboxes: CodeSandboxes | None = None) -> float:
    """The fraction of the row's tests the final answer's code passes (``mode = "fraction"``), or
    1.0 when it passes them all and 0.0 otherwise (``mode = "all"``)."""
    tests = tests_of(sample.row, tests_field)
    code = code_of(sample.final_text)
    if not code.strip():
        return 0.0  # no answer (the rollout ended on a tool call, or was cut): nothing to run
    passed, total = (sandboxes or _sandboxes).run(code, tests, timeout_s=float(timeout_s), memory_mb=memory_mb)
    if mode == "all":
        return 1.0 if passed == total else 0.0
    return passed / total
