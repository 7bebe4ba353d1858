"""Errors of the dashboard, each with the HTTP status its routes answer with::

    DashboardError(status, code)
    ├── InvalidTraceIdError(trace_id)   400  not 32 lowercase hex digits
    └── DashboardOffError(reason)       404  this Serve app was deployed without a dashboard
"""

from __future__ import annotations


class DashboardError(Exception):
    status = 500
    code = "dashboard_error"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidTraceIdError(DashboardError):
    status = 400
    code = "invalid_trace_id"

    def __init__(self, trace_id: str) -> None:
        # Only a prefix is echoed back: the value is the caller's, of any length.
        super().__init__(f"not a trace id (32 lowercase hex digits): {trace_id[:64]!r}")
        self.trace_id = trace_id


class DashboardOffError(DashboardError):
    status = 404
    code = "dashboard_off"

    def __init__(self, reason: str) -> None:
        super().__init__(f"the dashboard is off: {reason}")
        self.reason = reason
