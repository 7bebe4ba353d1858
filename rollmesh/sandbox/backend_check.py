"""A backend's start-up self-test: start a small sandbox, run ``true``, check the tool scripts
are readable inside, destroy it.

Knows the sandbox protocol and the tool paths; nothing of any one backend. Synchronous, because
``select_backend`` runs once at start-up, possibly inside an actor whose event loop is running.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Coroutine
from typing import Any

from rollmesh.sandbox.errors import BackendUnavailableError, SandboxError
from rollmesh.sandbox.sandbox_protocol import SandboxBackend, SandboxLimits
from rollmesh.sandbox.tool_paths import TOOLS_DIR

SELF_TEST_TIMEOUT_S = 30.0


def check_backend(backend: SandboxBackend) -> None:
    """BackendUnavailableError (with the reason) unless ``backend`` can run a sandbox here."""

    async def probe() -> None:
        limits = SandboxLimits(memory_mb=256, pids=64, workspace_mb=16, exec_timeout_s=SELF_TEST_TIMEOUT_S)
        # The start has its own bound (the backend's start timeout); this one covers the rest.
        start_s = getattr(backend, "start_timeout_s", 0.0)
        sandbox = await asyncio.wait_for(
            backend.create(f"selftest-{uuid.uuid4().hex[:8]}", limits), start_s + SELF_TEST_TIMEOUT_S)
        try:
            done = await sandbox.exec(["/bin/sh", "-c", f"true && test -r {TOOLS_DIR}/molar_mass.py"])
        finally:
            await sandbox.destroy()
        if (done.result, done.exit_code) != ("exit", 0):
            why = done.stderr.decode(errors="replace").strip() or done.detail or f"{done.result} {done.exit_code}"
            raise BackendUnavailableError(f"{backend.name} self-test failed", backend=backend.name,
                                          reason=f"the tool scripts are not readable inside ({why})")

    try:
        _run_sync(probe())
    except BackendUnavailableError:
        raise
    except (SandboxError, OSError, asyncio.TimeoutError) as exc:
        raise BackendUnavailableError(f"{backend.name} self-test failed", backend=backend.name,
                                      reason=str(exc) or type(exc).__name__) from exc


def _run_sync(coro: Coroutine[Any, Any, None]) -> None:
    """Run ``coro`` to completion from sync code, also when this thread has a running loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        asyncio.run(coro)
        return
    failure: list[BaseException] = []

    def target() -> None:
        try:
            asyncio.run(coro)
        except BaseException as exc:  # noqa: BLE001 - handed back to the caller's thread
            failure.append(exc)

    thread = threading.Thread(target=target, name="rollmesh-sandbox-selftest")
    thread.start()
    thread.join()
    if failure:
        raise failure[0]
