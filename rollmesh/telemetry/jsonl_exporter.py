"""A span exporter writing one JSON object per finished span to a JSONL file.

Knows the OpenTelemetry SDK and the standard library. Hand-rolled because the SDK's
ConsoleSpanExporter writes multi-line, indented JSON and offers no append-safe file mode: here the
file is opened with O_APPEND and each span is one ``write()`` of one line, so several processes can
share one ``traces.jsonl`` without interleaving lines.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from rollmesh.telemetry.conventions import RESOURCE_ACTOR


def span_to_record(span: ReadableSpan) -> dict[str, Any]:
    """The JSON shape of one span (ids as lowercase hex, times in ns since the epoch)."""
    context = span.get_span_context()
    parent = span.parent
    resource = span.resource.attributes
    return {
        "name": span.name,
        "trace_id": f"{context.trace_id:032x}" if context else "",
        "span_id": f"{context.span_id:016x}" if context else "",
        "parent_span_id": f"{parent.span_id:016x}" if parent else None,
        "kind": span.kind.name,
        "start_ns": span.start_time,
        "end_ns": span.end_time,
        "status": span.status.status_code.name,
        "status_description": span.status.description,
        # "service" is the emitting actor ("decode-0"), as trace-file readers have always grouped
        # by it; "service_name" is the OTel service ("rollmesh.decode").
        "service": resource.get(RESOURCE_ACTOR) or resource.get("service.name", ""),
        "service_name": resource.get("service.name", ""),
        "attributes": dict(span.attributes or {}),
        "events": [
            {"name": e.name, "timestamp_ns": e.timestamp, "attributes": dict(e.attributes or {})}
            for e in span.events
        ],
        "links": [
            {"trace_id": f"{link.context.trace_id:032x}", "span_id": f"{link.context.span_id:016x}",
             "attributes": dict(link.attributes or {})}
            for link in span.links
        ],
    }


class JsonlSpanExporter(SpanExporter):
    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        with self._lock:
            if self._fd is None:
                return SpanExportResult.FAILURE
            try:
                for span in spans:
                    line = json.dumps(span_to_record(span), default=str, separators=(",", ":"))
                    os.write(self._fd, (line + "\n").encode())
            except OSError:
                return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return True  # every export is already a write(); nothing is buffered here

    def shutdown(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
