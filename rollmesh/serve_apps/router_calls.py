"""One HTTP request's call to the InferenceRouter, whole (``RouterCalls.generate``) or streamed
(``RouterCalls.stream``), and the HTTP error of what such a call raised (``api_error_from_ray``).

Knows Ray's exceptions, OpenTelemetry and the InferenceRouter; not FastAPI, not the HTTP shapes of
any route but the names its fields go by (``COMPLETION_PARAMS``, ``GENERATE_PARAMS``,
``chat_params``), so an engine error names the request's own field. Ray's wrapping of actor errors
is undone here and nowhere else. The ``gen_ai.*`` attributes of the call go on the request's
SERVER span (FastAPI's telemetry), which is the current span while a route runs.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping

import structlog
from opentelemetry import trace
from ray.exceptions import RayActorError, RayTaskError

from rollmesh.inference.router import InferenceRouter, generation_attributes
from rollmesh.engine.errors import EngineError
from rollmesh.engine.protocols import GenerateOptions, GenerationResult
from rollmesh.messages.base import SamplingParams
from rollmesh.serve_apps.errors import ApiError, EngineUnavailableError, api_error_from_engine
from rollmesh.serve_apps.generation_requests import ServedModel
from rollmesh.serve_apps.http_shapes import ChatCompletionRequest
from rollmesh.serve_apps.stream_events import Piece, started
from rollmesh.telemetry import conventions

_log = structlog.get_logger("rollmesh.serve")

# The engine's field names as each route calls them, for the ``param`` of a mapped engine error.
COMPLETION_PARAMS = {"input_ids": "prompt", "max_new_tokens": "max_tokens"}
GENERATE_PARAMS = {"input_ids": "input_ids", "request_id": "rid",
                   "max_new_tokens": "sampling_params.max_new_tokens", "grammar": "sampling_params"}


def chat_params(body: ChatCompletionRequest) -> dict[str, str]:
    tokens = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    # A grammar the engine cannot compile is the tool's or the format's schema.
    grammar = "response_format" if body.response_format is not None else "tool_choice"
    return {"input_ids": "messages", "max_new_tokens": tokens, "grammar": grammar}


def api_error_from_ray(
    exc: BaseException, param_names: Mapping[str, str] | None = None
) -> ApiError:
    """The HTTP error for what ``await actor.method.remote()`` raised."""
    if isinstance(exc, RayActorError):
        return EngineUnavailableError(
            f"an inference worker is unavailable: {exc}", code="worker_unavailable"
        )
    # A task error raised in an actor arrives as RayTaskError(cause); when the cause could not be
    # unpickled here, ``cause`` is Ray's UnserializableException and we can only say 500.
    cause = exc.cause if isinstance(exc, RayTaskError) else exc
    if isinstance(cause, EngineError):
        return api_error_from_engine(cause, param_names)
    return ApiError(f"inference failed: {type(cause).__name__}", code="engine_error")


class RouterCalls:
    """The replica's generate calls through its router, as the text routes make them."""

    def __init__(self, router: InferenceRouter, served: ServedModel) -> None:
        self.router = router
        self.served = served

    async def generate(
        self, input_ids: list[int], sampling: SamplingParams, request_id: str,
        options: GenerateOptions, param_names: Mapping[str, str],
        operation: str = "text_completion",
    ) -> GenerationResult:
        # The request's SERVER span (FastAPI's telemetry) is current here.
        span = trace.get_current_span()
        span.set_attributes({
            conventions.GEN_AI_OPERATION_NAME: operation,
            conventions.GEN_AI_REQUEST_MODEL: self.served.name,
            conventions.GEN_AI_REQUEST_MAX_TOKENS: sampling.max_new_tokens,
            conventions.GEN_AI_REQUEST_TEMPERATURE: sampling.temperature,
            conventions.GEN_AI_USAGE_INPUT_TOKENS: len(input_ids),
            "request_id": request_id,
        })
        try:
            result = await self.router.generate(
                input_ids, sampling, request_id=request_id, options=options)
        except (RayTaskError, RayActorError, EngineError) as exc:
            error = api_error_from_ray(exc, param_names)
            if error.status >= 500:
                _log.warning("generate_failed", request_id=request_id, error=str(exc))
            raise error from exc
        span.set_attributes(generation_attributes(result))
        return result

    async def stream(
        self, input_ids: list[int], sampling: SamplingParams, request_id: str,
        options: GenerateOptions, param_names: Mapping[str, str],
        operation: str = "text_completion",
    ) -> AsyncIterator[Piece]:
        """The router's pieces, once the first has come (an error before it is this request's
        HTTP error; one after it is an error event: ``stream_events``)."""
        trace.get_current_span().set_attributes({
            conventions.GEN_AI_OPERATION_NAME: operation,
            conventions.GEN_AI_REQUEST_MODEL: self.served.name,
            conventions.GEN_AI_REQUEST_MAX_TOKENS: sampling.max_new_tokens,
            conventions.GEN_AI_REQUEST_TEMPERATURE: sampling.temperature,
            conventions.GEN_AI_USAGE_INPUT_TOKENS: len(input_ids),
            "request_id": request_id, "stream": True,
        })
        pieces = self.router.generate_stream(input_ids, sampling, request_id=request_id,
                                             options=options)
        return await started(pieces, lambda exc: api_error_from_ray(exc, param_names))
