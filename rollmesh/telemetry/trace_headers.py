"""W3C trace context in message headers: inject on publish or request, extract on receive.

Knows the OpenTelemetry API only (no SDK, no nats-py): a header block, NATS or HTTP, is a plain
``dict[str, str]``; the bus, the inference router and the SGLang HTTP client all use these. The
W3C propagator is used explicitly, whatever OTEL_PROPAGATORS says, so every actor and every
non-Python client agree on ``traceparent`` / ``tracestate``.
"""

from __future__ import annotations

from collections.abc import Mapping

from opentelemetry import context as otel_context
from opentelemetry.propagators.textmap import Getter
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

_propagator = TraceContextTextMapPropagator()


class _HeaderGetter(Getter[Mapping[str, str]]):
    """Case-insensitive: some clients and proxies capitalise header names."""

    def get(self, carrier: Mapping[str, str], key: str) -> list[str] | None:
        value = carrier.get(key)
        if value is None:
            lowered = key.lower()
            value = next((v for k, v in carrier.items() if k.lower() == lowered), None)
        return [value] if isinstance(value, str) else None

    def keys(self, carrier: Mapping[str, str]) -> list[str]:
        return list(carrier.keys())


_getter = _HeaderGetter()


def inject_trace_headers(headers: dict[str, str] | None = None,
                         context: otel_context.Context | None = None) -> dict[str, str]:
    """Add ``traceparent`` (and ``tracestate``) for the current span to ``headers``; returns it.

    With no active span nothing is added, which is valid: the receiver starts a new trace.
    """
    carrier = {} if headers is None else headers
    _propagator.inject(carrier, context=context)
    return carrier


def extract_trace_context(headers: Mapping[str, str] | None) -> otel_context.Context:
    """The remote parent carried by ``headers`` (an empty context when there is none).

    Starts from an empty context, not the current one: a receive loop must never parent a
    message's span to whatever span happens to be active in the loop.
    """
    return _propagator.extract(headers or {}, context=otel_context.Context(), getter=_getter)
