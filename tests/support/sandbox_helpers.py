"""Helpers for tests that run real bubblewrap sandboxes."""

from __future__ import annotations

import pytest

from rollmesh.sandbox.bwrap_backend import BwrapBackend
from rollmesh.sandbox.errors import BackendUnavailableError


def usable_bwrap(**options) -> BwrapBackend:
    """A bubblewrap backend that passed its self-test, or the test is skipped saying why."""
    backend = BwrapBackend(**options)
    try:
        backend.self_test()
    except BackendUnavailableError as exc:
        pytest.skip(f"bubblewrap cannot run sandboxes here: {exc}")
    return backend
