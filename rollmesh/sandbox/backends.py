"""Choosing a sandbox backend for this host: ``select_backend("auto" | "bwrap" | "runsc" |
"process")``.

Knows the concrete backends and structlog; nothing of leases. "auto" prefers bubblewrap when it is
installed and passes a self-test, and otherwise falls back, loudly, to the process backend, which
isolates nothing. Asking for a backend by name never falls back: it raises instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import structlog

from rollmesh.sandbox.agent_client import START_TIMEOUT_S
from rollmesh.sandbox.bwrap_backend import BwrapBackend
from rollmesh.sandbox.errors import BackendUnavailableError
from rollmesh.sandbox.process_backend import ProcessBackend
from rollmesh.sandbox.runsc_backend import RunscBackend
from rollmesh.sandbox.sandbox_protocol import SandboxBackend

BackendKind = Literal["auto", "bwrap", "runsc", "process"]

log = structlog.get_logger(__name__)


def select_backend(kind: BackendKind, *, readonly_paths: Sequence[str] = (),
                   start_timeout_s: float = START_TIMEOUT_S) -> SandboxBackend:
    """``readonly_paths``: host paths an isolating backend shows read-only at the same place
    (datasets, a checkout the tools need); the tool scripts always are. ``start_timeout_s``: how
    long a new sandbox's agent may take to say it is ready (``sandbox.start_timeout_s``)."""
    if kind == "process":
        return ProcessBackend(start_timeout_s=start_timeout_s)
    if kind == "bwrap":
        return _checked(BwrapBackend(readonly_paths=readonly_paths, start_timeout_s=start_timeout_s))
    if kind == "runsc":
        return _checked(RunscBackend(readonly_paths=readonly_paths, start_timeout_s=start_timeout_s))
    if kind != "auto":
        raise BackendUnavailableError("unknown sandbox backend kind", backend=str(kind))
    try:
        return _checked(BwrapBackend(readonly_paths=readonly_paths, start_timeout_s=start_timeout_s))
    except BackendUnavailableError as exc:
        log.warning("bubblewrap unusable; falling back to the process backend, which isolates NOTHING",
                    reason=str(exc))
        return ProcessBackend(start_timeout_s=start_timeout_s)


def _checked(backend: BwrapBackend | RunscBackend) -> SandboxBackend:
    backend.self_test()
    return backend
