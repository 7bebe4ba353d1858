"""Choosing a sandbox backend for this host: ``select_backend("auto" | "bwrap" | "runsc" |
"process")``.

Knows the concrete backends and structlog; nothing of leases. "auto" prefers bubblewrap when it is
installed and passes a self-test, and otherwise falls back, loudly, to the process backend, which
isolates nothing. Asking for a backend by name never falls back: it raises instead.
``select_configured_backend`` first makes every profile's image ready (``images.py``): at broker
start, before any lease, so a broken image stops the broker with an error naming its profile.
Images (an image root, a Python environment, an egress allowlist) need bubblewrap: any other
backend, "auto"'s fallback included, refuses them instead of silently ignoring them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Literal

import structlog

from rollmesh.sandbox.bwrap_backend import BwrapBackend
from rollmesh.sandbox.errors import BackendUnavailableError, ImageBuildError
from rollmesh.sandbox.guest_client import START_TIMEOUT_S
from rollmesh.sandbox.images import SandboxImage, prepare_images
from rollmesh.sandbox.process_backend import ProcessBackend
from rollmesh.sandbox.runsc_backend import RunscBackend
from rollmesh.sandbox.sandbox_protocol import SandboxBackend
from rollmesh.sandbox_config import SandboxConfig

BackendKind = Literal["auto", "bwrap", "runsc", "process"]

log = structlog.get_logger(__name__)


def select_configured_backend(config: SandboxConfig, *, run_dir: Path) -> SandboxBackend:
    """The backend ``config`` names, with every profile's image made ready first (cached in
    ``sandbox.image_cache_dir``, else ``<run_dir>/sandbox-images``)."""
    cache_dir = Path(config.image_cache_dir) if config.image_cache_dir else run_dir / "sandbox-images"
    images = prepare_images(config, cache_dir=cache_dir)
    for name, image in images.items():
        log.info("sandbox_image_ready", profile=name, image=image.describe())
    return select_backend(config.backend, readonly_paths=config.readonly_paths,
                          start_timeout_s=config.start_timeout_s, images=images)


def select_backend(kind: BackendKind, *, readonly_paths: Sequence[str] = (),
                   start_timeout_s: float = START_TIMEOUT_S,
                   images: Mapping[str, SandboxImage] | None = None) -> SandboxBackend:
    """``readonly_paths``: host paths an isolating backend shows read-only at the same place
    (datasets, a checkout the tools need); the tool scripts always are. ``start_timeout_s``: how
    long a new sandbox's guest may take to say it is ready (``sandbox.start_timeout_s``).
    ``images``: prepared profile images (``prepare_images``); only bubblewrap shows them."""
    if kind == "process":
        return _imageless(ProcessBackend(start_timeout_s=start_timeout_s), images)
    if kind == "bwrap":
        return _checked(BwrapBackend(readonly_paths=readonly_paths, start_timeout_s=start_timeout_s, images=images))
    if kind == "runsc":
        return _imageless(_checked(RunscBackend(readonly_paths=readonly_paths, start_timeout_s=start_timeout_s)),
                          images)
    if kind != "auto":
        raise BackendUnavailableError("unknown sandbox backend kind", backend=str(kind))
    try:
        return _checked(BwrapBackend(readonly_paths=readonly_paths, start_timeout_s=start_timeout_s, images=images))
    except BackendUnavailableError as exc:
        log.warning("bubblewrap unusable; falling back to the process backend, which isolates NOTHING",
                    reason=str(exc))
        return _imageless(ProcessBackend(start_timeout_s=start_timeout_s), images)


def _imageless(backend: SandboxBackend, images: Mapping[str, SandboxImage] | None) -> SandboxBackend:
    for name, image in (images or {}).items():
        raise ImageBuildError(f"the {backend.name} backend cannot show its image ({image.describe()})",
                              profile=name, reason="image roots, Python environments and network_allow "
                                                   "need the bwrap backend")
    return backend


def _checked(backend: BwrapBackend | RunscBackend) -> SandboxBackend:
    backend.self_test()
    return backend
