"""Errors of the wire contract, one tree under ``MessageError``. Imports nothing of ours.

    MessageError
    ├── TokenTraceError(reason, position), ValueError        (token_trace) a TokenTrace breaks an invariant
    └── TraceNotInlineError(rollout_id, ref), LookupError    (rollout) the trace is in the object store

The builtin second bases stay because callers catch them.
"""

from __future__ import annotations


class MessageError(Exception):
    """Root of the wire contract's errors (a decode error is msgspec's own ``ValidationError``)."""
