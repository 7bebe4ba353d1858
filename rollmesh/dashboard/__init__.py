"""rollmesh.dashboard: the live dashboard at ``/dashboard`` on the Serve app's HTTP port.

``DashboardState`` (plain logic) folds the mesh's events into bounded views; ``DashboardFeed``
keeps it live from NATS and a few polls inside the Serve replica; ``DashboardRoutes`` is what the
app's ``/dashboard`` routes answer (one static HTML page, its JSON state polled by the page, and a
waterfall of a rollout's trace from the run's ``traces.jsonl``). Nothing here needs a build step.
"""

from rollmesh.dashboard.errors import DashboardError, DashboardOffError, InvalidTraceIdError
from rollmesh.dashboard.feed import DashboardFeed, WorkerHandle
from rollmesh.dashboard.routes import DASHBOARD_PATH, DashboardRoutes, is_dashboard_request
from rollmesh.dashboard.state import DashboardState, trace_link
from rollmesh.dashboard.traces import TraceView, read_trace
from rollmesh.dashboard.views import DashboardSnapshot
from rollmesh.moved_names import forward_moved_names

# Issue 24: one type for where the mesh is (the dashboard's settings are handed beside it).
__getattr__ = forward_moved_names(__name__, {"DashboardSource": "rollmesh.mesh_address:MeshAddress"})

__all__ = [
    "DASHBOARD_PATH",
    "DashboardError",
    "DashboardFeed",
    "DashboardOffError",
    "DashboardRoutes",
    "DashboardSnapshot",
    "DashboardState",
    "InvalidTraceIdError",
    "TraceView",
    "WorkerHandle",
    "is_dashboard_request",
    "read_trace",
    "trace_link",
]
