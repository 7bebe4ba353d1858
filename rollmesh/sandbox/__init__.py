"""rollmesh.sandbox: isolated places where tool code runs, leased to rollouts by the broker.

Knows the sandbox messages and its config slice; never imports ray or nats (the broker's actor
shell does the wire work). Tool scripts that run inside sandboxes live in ``tools/`` as data.
"""

from rollmesh.sandbox.backend_protocol import ExecResult, SandboxBackend
from rollmesh.sandbox.backends import BackendKind, select_backend
from rollmesh.sandbox.broker import SandboxBroker, SandboxBrokerStats
from rollmesh.sandbox.bwrap_backend import BwrapBackend
from rollmesh.sandbox.errors import (
    BackendFailedError,
    BackendUnavailableError,
    SandboxError,
    ToolNotFoundError,
)
from rollmesh.sandbox.process_backend import ProcessBackend
from rollmesh.sandbox.tool_paths import python_for_sandbox, tool_script_path

__all__ = [
    "BackendFailedError",
    "BackendKind",
    "BackendUnavailableError",
    "BwrapBackend",
    "ExecResult",
    "ProcessBackend",
    "SandboxBackend",
    "SandboxBroker",
    "SandboxBrokerStats",
    "SandboxError",
    "ToolNotFoundError",
    "python_for_sandbox",
    "select_backend",
    "tool_script_path",
]
