"""rollmesh.sandbox: isolated places where tool code runs, leased to rollouts by the broker.

Knows the sandbox messages and its config slice; never imports ray or nats (the broker's actor
shell does the wire work). The runtime seam is ``sandbox_protocol`` (a backend creates live
sandboxes); the broker (``broker``, ``workspace_ops``, ``warm_pool``, ``snapshots``) leases them,
and ``broker_logic`` serves it as the sandbox broker role's logic (``SandboxBrokerLogic``);
``broker_client`` is how rollouts and the CLI talk to it. Tool scripts that run inside sandboxes
live in ``tools/`` as data. What a profile's sandboxes are made of (root, Python environment,
egress allowlist) is ``images``, made ready before any lease.
"""

from rollmesh.sandbox.backends import BackendKind, select_backend, select_configured_backend
from rollmesh.sandbox.broker import SandboxBroker, SandboxBrokerStats
from rollmesh.sandbox.broker_client import SandboxBrokerClient
from rollmesh.sandbox.broker_logic import SandboxBrokerLogic
from rollmesh.sandbox.bwrap_backend import BwrapBackend
from rollmesh.sandbox.errors import (
    BackendFailedError,
    BackendUnavailableError,
    ImageBuildError,
    SandboxError,
    SandboxRequestError,
    ToolNotFoundError,
)
from rollmesh.sandbox.images import SandboxImage, prepare_images
from rollmesh.sandbox.process_backend import ProcessBackend
from rollmesh.sandbox.runsc_backend import RunscBackend
from rollmesh.sandbox.sandbox_protocol import (
    ExecOutcome,
    FileTransfer,
    Sandbox,
    SandboxBackend,
    SandboxInfo,
    SandboxLimits,
)
from rollmesh.sandbox.tool_paths import python_for_sandbox, tool_script_path

__all__ = [
    "BackendFailedError",
    "BackendKind",
    "BackendUnavailableError",
    "BwrapBackend",
    "ExecOutcome",
    "FileTransfer",
    "ImageBuildError",
    "ProcessBackend",
    "RunscBackend",
    "Sandbox",
    "SandboxBackend",
    "SandboxBroker",
    "SandboxBrokerClient",
    "SandboxBrokerLogic",
    "SandboxBrokerStats",
    "SandboxError",
    "SandboxImage",
    "SandboxInfo",
    "SandboxLimits",
    "SandboxRequestError",
    "ToolNotFoundError",
    "prepare_images",
    "python_for_sandbox",
    "select_backend",
    "select_configured_backend",
    "tool_script_path",
]
