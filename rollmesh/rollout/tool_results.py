"""What a rollout makes of a sandbox call's outcome: the text the model is shown of a tool's
result, and the failure kind of a sandbox request that could not be served.

Knows the sandbox exec reply and the sandbox client's error; nothing of the agent loop.
"""

from __future__ import annotations

from rollmesh.messages import SandboxExecReply
from rollmesh.messages.rollout import FailureKind
from rollmesh.sandbox.errors import SandboxRequestError

# What the model is shown when a tool ended without an exit code of its own.
_ENDINGS = {"timeout": "timed out", "oom": "out of memory"}
# Follows what was kept of an output that passed its cap, so the model knows it saw a part.
TRUNCATION_MARKER = "[output truncated]"


def failure_kind(exc: SandboxRequestError) -> FailureKind:
    return "sandbox_timeout" if exc.kind == "lease_expired" else "sandbox_error"


def tool_text(reply: SandboxExecReply) -> str:
    """What the model sees of a tool's result."""
    stdout = reply.stdout.decode(errors="replace").strip()
    stderr = reply.stderr.decode(errors="replace").strip()
    if reply.result == "exit" and reply.exit_code == 0:
        return stdout
    if reply.result == "exit":
        return stderr or stdout or f"exit code {reply.exit_code}"
    if reply.result == "signal":
        return stderr or f"killed by signal {reply.signal}"
    if reply.result == "output_truncated":
        kept = stdout or stderr
        return f"{kept}\n{TRUNCATION_MARKER}" if kept else TRUNCATION_MARKER
    return _ENDINGS.get(reply.result, reply.result)
