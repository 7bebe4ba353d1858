"""structlog setup: JSON lines with the current trace ids, secrets redacted."""

from __future__ import annotations

import io
import json

import pytest
import structlog
from opentelemetry.sdk.trace import TracerProvider

from rollmesh.telemetry.logging import setup_logging
from rollmesh.telemetry.redaction import REDACTED, redact_url

pytestmark = pytest.mark.unit


@pytest.fixture
def log_buffer():
    buffer = io.StringIO()
    setup_logging("logger-test", "debug", stream=buffer, force=True)
    yield buffer
    setup_logging("pytest", "info", force=True)  # back to stderr for the tests that follow


def _lines(buffer):
    return [json.loads(line) for line in buffer.getvalue().splitlines()]


def test_log_lines_are_json_with_the_current_trace_ids(log_buffer):
    tracer = TracerProvider().get_tracer("test")
    with tracer.start_as_current_span("work") as span:
        structlog.get_logger().info("inside", rollout_id="r1")
    structlog.get_logger().info("outside")
    inside, outside = _lines(log_buffer)
    context = span.get_span_context()
    assert inside["event"] == "inside" and inside["level"] == "info"
    assert inside["trace_id"] == f"{context.trace_id:032x}"
    assert inside["span_id"] == f"{context.span_id:016x}"
    assert inside["actor"] == "logger-test" and inside["rollout_id"] == "r1"
    assert "trace_id" not in outside


def test_secrets_are_redacted(log_buffer):
    structlog.get_logger().warning(
        "connecting", url="nats://alice:s3cret@nats:4222", api_key="k-123", auth_token="t-1",
        nested={"password": "p", "ok": "https://u:pw@host/x"}, note="plain",
    )
    with structlog.contextvars.bound_contextvars(db_password="hunter2"):
        structlog.get_logger().info("bound")
    line, bound = _lines(log_buffer)
    text = log_buffer.getvalue()
    for secret in ("s3cret", "k-123", "t-1", "hunter2", "pw@"):
        assert secret not in text
    assert line["url"] == f"nats://{REDACTED}@nats:4222"
    assert line["api_key"] == line["auth_token"] == REDACTED
    assert line["nested"] == {"password": REDACTED, "ok": f"https://{REDACTED}@host/x"}
    assert line["note"] == "plain"
    assert bound["db_password"] == REDACTED


def test_log_level_filters(log_buffer):
    setup_logging("quiet", "warning", stream=log_buffer, force=True)
    structlog.get_logger().info("dropped")
    structlog.get_logger().warning("kept")
    assert [line["event"] for line in _lines(log_buffer)] == ["kept"]


def test_redact_url_leaves_plain_urls_alone():
    assert redact_url("nats://127.0.0.1:4222") == "nats://127.0.0.1:4222"
    assert redact_url("nats://token@h:1,nats://u:p@h2:2") == \
        f"nats://{REDACTED}@h:1,nats://{REDACTED}@h2:2"
