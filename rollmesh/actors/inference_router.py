"""The inference router: pairs a prefill worker with a decode worker for each generate call.

Knows Ray actor handles (duck-typed ``.remote``), not how they were spawned; no nats. Prefill runs
first and returns an ObjectRef to the PrefillResult; that ref is handed to the decode worker as
an argument, so Ray moves the KV through its object store straight to decode. A session sticks to
one decode worker (its later turns will reuse KV there once prefix caching lands); otherwise the
least-loaded decode worker, counted by this router's own in-flight calls, is chosen.
"""

from __future__ import annotations

import itertools
import zlib
from typing import Any

from opentelemetry import trace

from rollmesh.bus.trace_headers import inject_trace_headers
from rollmesh.engine.protocols import GenerationResult
from rollmesh.messages.base import SamplingParams

_tracer = trace.get_tracer("rollmesh.inference")


class InferenceRouter:
    """Implements ``rollmesh.engine.protocols.InferenceEngine`` over Ray actor handles."""

    def __init__(self, prefill_workers: list[Any], decode_workers: list[Any]) -> None:
        if not prefill_workers or not decode_workers:
            raise ValueError("the router needs at least one prefill and one decode worker")
        self.prefill_workers = list(prefill_workers)
        self.decode_workers = list(decode_workers)
        self._next_prefill = itertools.cycle(range(len(self.prefill_workers)))
        self._decode_in_flight = [0] * len(self.decode_workers)

    def _pick_decode(self, session_id: str | None) -> int:
        if session_id:
            return zlib.crc32(session_id.encode()) % len(self.decode_workers)
        return min(range(len(self.decode_workers)), key=self._decode_in_flight.__getitem__)

    async def generate(
        self,
        input_ids: list[int],
        sampling: SamplingParams,
        *,
        request_id: str,
        session_id: str | None = None,
    ) -> GenerationResult:
        with _tracer.start_as_current_span(
            "generate", attributes={"request_id": request_id, "prompt_tokens": len(input_ids)}
        ):
            headers = inject_trace_headers({})
            prefill = self.prefill_workers[next(self._next_prefill)]
            kv_ref = prefill.prefill.remote(input_ids, request_id, headers)
            index = self._pick_decode(session_id)
            self._decode_in_flight[index] += 1
            try:
                finished = await self.decode_workers[index].generate.remote(
                    kv_ref, sampling, request_id, headers
                )
            finally:
                self._decode_in_flight[index] -= 1
            return finished.as_generation_result()
