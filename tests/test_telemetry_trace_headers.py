"""W3C trace context round-trips through a header dict (NATS or HTTP)."""

from __future__ import annotations

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider

from rollmesh.telemetry.trace_headers import extract_trace_context, inject_trace_headers

pytestmark = pytest.mark.unit

_tracer = TracerProvider().get_tracer("test")


def test_trace_context_round_trips_through_headers():
    with _tracer.start_as_current_span("producer") as span:
        headers = inject_trace_headers({"other": "kept"})
    assert headers["other"] == "kept"
    sent = span.get_span_context()
    assert headers["traceparent"].startswith(f"00-{sent.trace_id:032x}-{sent.span_id:016x}-")

    received = trace.get_current_span(extract_trace_context(headers)).get_span_context()
    assert received.is_remote
    assert (received.trace_id, received.span_id) == (sent.trace_id, sent.span_id)

    with _tracer.start_as_current_span("consumer", context=extract_trace_context(headers)) as child:
        assert child.parent is not None and child.parent.span_id == sent.span_id
        assert child.get_span_context().trace_id == sent.trace_id


def test_extract_is_case_insensitive_and_tolerates_missing_headers():
    with _tracer.start_as_current_span("producer") as span:
        headers = {k.title(): v for k, v in inject_trace_headers().items()}
    received = trace.get_current_span(extract_trace_context(headers)).get_span_context()
    assert received.trace_id == span.get_span_context().trace_id

    assert not trace.get_current_span(extract_trace_context(None)).get_span_context().is_valid
    assert not trace.get_current_span(extract_trace_context({"traceparent": "junk"})) \
        .get_span_context().is_valid


def test_no_active_span_injects_nothing():
    assert inject_trace_headers({}) == {}
