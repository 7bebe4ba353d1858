"""The dashboard's HTTP answers, which the Serve app's routes return: the page, its state, a trace.

Knows Starlette responses, the state, the feed and the trace reader; not Ray Serve, not the API
key (the app's routes check it before calling in: the page's data and traces need the key, the
two static pages hold no data and do not). The pages are plain HTML files with inline JavaScript
shipped in the package (``static/``): nothing to build, nothing fetched from elsewhere.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

import msgspec
from starlette.responses import HTMLResponse, JSONResponse, Response

from rollmesh.dashboard.errors import DashboardError, DashboardOffError
from rollmesh.config import DashboardConfig
from rollmesh.dashboard.feed import DashboardFeed, WorkerHandle
from rollmesh.dashboard.state import DashboardState
from rollmesh.dashboard.traces import check_trace_id, read_trace
from rollmesh.mesh_address import MeshAddress
from rollmesh.telemetry.tracing import TRACES_FILE

DASHBOARD_PATH = "/dashboard"
# The page reads this often; its state answer must never be cached by a proxy either.
NO_STORE = {"Cache-Control": "no-store"}


def is_dashboard_request(scope: dict[str, Any]) -> bool:
    """For FastAPI's telemetry ``exclude``: the page polls its state every second, and those
    requests must not bury the run's traces."""
    return str(scope.get("path", "")).startswith(DASHBOARD_PATH)


def static_page(name: str) -> str:
    return resources.files("rollmesh.dashboard").joinpath("static", name).read_text(encoding="utf-8")


class DashboardRoutes:
    """One replica's dashboard: off (every route answers 404) without a mesh to follow."""

    def __init__(self, mesh: MeshAddress | None, feed: DashboardFeed | None,
                 state: DashboardState | None) -> None:
        self.mesh = mesh
        self.feed = feed
        self.state = state
        self._encoder = msgspec.json.Encoder()

    @classmethod
    def start(cls, mesh: MeshAddress | None, config: DashboardConfig = DashboardConfig(),
              workers: Sequence[WorkerHandle] = (),
              find_actor: Callable[[str, str], Any] | None = None) -> DashboardRoutes:
        """Start following ``mesh`` (from a running event loop) when there is one to follow and
        ``config.enabled``."""
        if mesh is None or not config.enabled:
            return cls(mesh, None, None)
        state = DashboardState(config, namespace=mesh.namespace)
        feed = DashboardFeed(mesh, state, config=config, workers=workers, find_actor=find_actor)
        feed.start()
        return cls(mesh, feed, state)

    def page(self) -> Response:
        return self._answer(lambda: HTMLResponse(static_page("dashboard.html"), headers=NO_STORE))

    def trace_page(self, trace_id: str) -> Response:
        def answer() -> Response:
            check_trace_id(trace_id)
            return HTMLResponse(static_page("trace.html"), headers=NO_STORE)

        return self._answer(answer)

    def state_answer(self) -> Response:
        def answer() -> Response:
            assert self.state is not None  # _answer said the dashboard is on
            return Response(self._encoder.encode(self.state.snapshot()),
                            media_type="application/json", headers=NO_STORE)

        return self._answer(answer)

    async def trace_answer(self, trace_id: str) -> Response:
        try:
            self._check_on()
            check_trace_id(trace_id)
            assert self.mesh is not None
            path = Path(self.mesh.run_dir) / TRACES_FILE
            # A file read, off the event loop the replica serves every request from.
            view = await asyncio.to_thread(read_trace, path, trace_id)
        except DashboardError as exc:
            return error_response(exc)
        return Response(self._encoder.encode(view), media_type="application/json", headers=NO_STORE)

    def _answer(self, make: Callable[[], Response]) -> Response:
        try:
            self._check_on()
            return make()
        except DashboardError as exc:
            return error_response(exc)

    def _check_on(self) -> None:
        if self.mesh is None:
            raise DashboardOffError("this Serve app was deployed without a mesh to follow "
                                    "(rollmesh up deploys it with one)")
        if self.state is None:
            raise DashboardOffError("dashboard.enabled is false")


def error_response(exc: DashboardError) -> JSONResponse:
    """The HTTP API's error shape (``{"error": {message, type, code, param}}``)."""
    return JSONResponse(status_code=exc.status, content={"error": {
        "message": exc.message, "type": "invalid_request_error" if exc.status < 500 else "server_error",
        "code": exc.code, "param": None}})
