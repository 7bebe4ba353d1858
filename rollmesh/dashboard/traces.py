"""One rollout's trace read back from the run's ``traces.jsonl``, for the dashboard's waterfall.

Knows the JSONL span records (``rollmesh.telemetry.jsonl_exporter``) and the file system; not
HTTP. A rollout is one trace, and each of its turns is a trace of its own whose root span links
back to the rollout's span, so the view holds the rollout's trace and every trace linking to it.
Spans reach the file when they end: a running rollout shows its finished turns, and its own span
once it is over. The file is scanned line by line with a substring test before any JSON is
parsed, so a large file costs a read, not a parse.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import msgspec

from rollmesh.dashboard.errors import InvalidTraceIdError

TRACE_ID = re.compile(r"^[0-9a-f]{32}$")
MAX_SPANS = 2000


class SpanView(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    service: str
    trace_id: str
    span_id: str
    parent_span_id: str | None
    start_ns: int
    end_ns: int
    status: str
    attributes: dict[str, Any]


class TraceView(msgspec.Struct, frozen=True, kw_only=True):
    trace_id: str
    # The turn traces that link to this one.
    linked_trace_ids: list[str]
    spans: list[SpanView]  # by start time
    truncated: bool = False
    # Why there is nothing to show, when that is known ("" otherwise).
    note: str = ""


def check_trace_id(text: str) -> str:
    if not TRACE_ID.match(text):
        raise InvalidTraceIdError(text)
    return text


def read_trace(path: Path, trace_id: str, *, max_spans: int = MAX_SPANS) -> TraceView:
    """The spans of ``trace_id`` and of the traces linking to it, from the JSONL file ``path``."""
    check_trace_id(trace_id)
    if not path.exists():
        return TraceView(trace_id=trace_id, linked_trace_ids=[], spans=[],
                         note=f"{path.name} does not exist: this run exports its traces elsewhere "
                              "(OTLP); set dashboard.trace_url to link to that trace UI")
    own = _records(path, {trace_id})
    linked = sorted({r["trace_id"] for r in own if r.get("trace_id") != trace_id})
    records = [r for r in own if r.get("trace_id") == trace_id]
    if linked:
        records += [r for r in _records(path, set(linked)) if r.get("trace_id") in linked]
    records.sort(key=lambda r: r.get("start_ns") or 0)
    spans = [_span(r) for r in records[:max_spans]]
    note = "" if spans else "no span of this trace has ended yet"
    return TraceView(trace_id=trace_id, linked_trace_ids=linked, spans=spans,
                     truncated=len(records) > max_spans, note=note)


def _records(path: Path, trace_ids: set[str]) -> list[dict[str, Any]]:
    """Span records whose line mentions one of ``trace_ids`` (as its trace or in a link)."""
    found = []
    with path.open(encoding="utf-8", errors="replace") as lines:
        for line in lines:
            if not any(trace_id in line for trace_id in trace_ids):
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut short by a crashed writer
            if isinstance(record, dict):
                found.append(record)
    return found


def _span(record: dict[str, Any]) -> SpanView:
    return SpanView(
        name=str(record.get("name", "")), service=str(record.get("service", "")),
        trace_id=str(record.get("trace_id", "")), span_id=str(record.get("span_id", "")),
        parent_span_id=record.get("parent_span_id"), start_ns=int(record.get("start_ns") or 0),
        end_ns=int(record.get("end_ns") or 0), status=str(record.get("status", "")),
        attributes=dict(record.get("attributes") or {}))
