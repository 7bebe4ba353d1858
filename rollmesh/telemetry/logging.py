"""structlog setup: once per process, JSON lines when stderr is not a terminal.

Knows structlog, the OpenTelemetry API (to stamp ``trace_id``/``span_id`` from the current span) and
our redaction rules; knows nothing of NATS or Ray. Per-message fields (``subject``,
``rollout_id``...) are bound by the shell through ``structlog.contextvars``.
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import MutableMapping
from typing import Any, TextIO

import structlog
from opentelemetry import trace

from rollmesh.telemetry.redaction import REDACTED, is_secret_key, redact_value

_lock = threading.Lock()
_configured = False

EventDict = MutableMapping[str, Any]


def add_trace_ids(_logger: Any, _method: str, event_dict: EventDict) -> EventDict:
    """Stamp the current span's ids, so a log line can be found from its trace and back."""
    context = trace.get_current_span().get_span_context()
    if context.is_valid:
        event_dict.setdefault("trace_id", f"{context.trace_id:032x}")
        event_dict.setdefault("span_id", f"{context.span_id:016x}")
    return event_dict


def redact_secrets(_logger: Any, _method: str, event_dict: EventDict) -> EventDict:
    """Replace values of secret-looking keys and credentials embedded in URLs."""
    for key, value in list(event_dict.items()):
        event_dict[key] = REDACTED if is_secret_key(key) else redact_value(value)
    return event_dict


def _add_actor(actor_name: str) -> structlog.types.Processor:
    def add_actor(_logger: Any, _method: str, event_dict: EventDict) -> EventDict:
        event_dict.setdefault("actor", actor_name)
        return event_dict

    return add_actor


class _StderrLoggerFactory:
    """Looks ``sys.stderr`` up at each call, so redirections (Ray, pytest capture) are honoured."""

    def __call__(self, *args: Any) -> structlog.PrintLogger:
        return structlog.PrintLogger(sys.stderr)


def build_processors(actor_name: str, *, json: bool) -> list[structlog.types.Processor]:
    renderer: structlog.types.Processor = (
        structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer()
    )
    return [
        structlog.contextvars.merge_contextvars,
        _add_actor(actor_name),
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        add_trace_ids,
        structlog.processors.StackInfoRenderer(),
        structlog.processors.format_exc_info,
        # Last before rendering: exception text and bound context are redacted too.
        redact_secrets,
        renderer,
    ]


def setup_logging(actor_name: str, level: str = "info", *, stream: TextIO | None = None,
                  force: bool = False) -> None:
    """Configure structlog for this process; later calls are no-ops unless ``force``.

    ``stream`` pins the output (tests); by default it is whatever ``sys.stderr`` is at log time.
    """
    global _configured
    with _lock:
        if _configured and not force:
            return
        out = stream if stream is not None else sys.stderr
        structlog.configure(
            processors=build_processors(actor_name, json=not _isatty(out)),
            wrapper_class=structlog.make_filtering_bound_logger(
                logging.getLevelNamesMapping()[level.upper()]
            ),
            logger_factory=(structlog.PrintLoggerFactory(stream) if stream is not None
                            else _StderrLoggerFactory()),
            cache_logger_on_first_use=False,
        )
        _configured = True


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
