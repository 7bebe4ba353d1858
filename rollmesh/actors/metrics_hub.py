"""Deprecated: the metrics hub's shell is no actor; it moved to ``rollmesh.metrics_hub_shell``
(``MetricsHubService`` is now ``MetricsHubShell``, around ``telemetry.metrics_hub.MetricsHubLogic``).
Importing a name from here warns; this module is removed in the next release.
"""

from rollmesh.moved_names import forward_moved_names

__getattr__ = forward_moved_names(__name__, {
    "MetricsHubService": "rollmesh.metrics_hub_shell:MetricsHubShell",
    "HUB_NAME": "rollmesh.metrics_hub_shell",
    "ROLLOUT_WORKERS_DURABLE": "rollmesh.metrics_hub_shell",
})
