"""Choosing a sandbox backend for this host: ``select_backend("auto" | "bwrap" | "process")``.

Knows the concrete backends and structlog; nothing of leases. "auto" prefers bubblewrap when it is
installed and passes a self-test, and otherwise falls back, loudly, to the process backend, which
isolates nothing. Asking for "bwrap" by name never falls back: it raises instead.
"""

from __future__ import annotations

from collections.abc import Sequence

from typing import Literal

import structlog

from rollmesh.sandbox.backend_protocol import SandboxBackend
from rollmesh.sandbox.bwrap_backend import BwrapBackend
from rollmesh.sandbox.errors import BackendUnavailableError
from rollmesh.sandbox.process_backend import ProcessBackend

BackendKind = Literal["auto", "bwrap", "process"]

log = structlog.get_logger(__name__)


def select_backend(kind: BackendKind, *, readonly_paths: Sequence[str] = ()) -> SandboxBackend:
    """``readonly_paths``: host paths an isolating backend shows read-only even where its own
    mounts (a private /tmp) would hide them."""
    if kind == "process":
        return ProcessBackend()
    if kind == "bwrap":
        return _checked_bwrap(readonly_paths)
    if kind != "auto":
        raise BackendUnavailableError("unknown sandbox backend kind", backend=str(kind))
    try:
        return _checked_bwrap(readonly_paths)
    except BackendUnavailableError as exc:
        log.warning("bubblewrap unusable; falling back to the process backend", reason=str(exc))
        return ProcessBackend()


def _checked_bwrap(readonly_paths: Sequence[str]) -> BwrapBackend:
    backend = BwrapBackend(readonly_paths=readonly_paths)
    backend.self_test()
    return backend
