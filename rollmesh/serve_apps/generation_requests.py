"""Turns HTTP request bodies into engine inputs and GenerationResults into HTTP response bodies.

Knows the HTTP shapes, the served model's tokenizer (``rollmesh.chat.ChatModel``) and the wire's
SamplingParams; not Ray, not FastAPI, so every check here is a plain function call in a unit test.
A completion's prompt is encoded as it stands (no special tokens added, as a rendered template has
its own); the OpenAI routes' text is the generated ids decoded without special tokens (the
end-of-turn id is not text), /generate's keeps them, so it is exactly ``output_ids`` decoded.
Everything the engine would reject is rejected here first with the HTTP parameter's own name,
because an engine error raised inside a Ray actor reaches us wrapped and without the request's
field names.
"""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass

import msgspec

from rollmesh.chat import ChatModel
from rollmesh.engine.protocols import GenerationResult
from rollmesh.messages.base import SamplingParams
from rollmesh.serve_apps.errors import InvalidApiRequestError, ModelNotFoundError
from rollmesh.serve_apps.generate_extensions import MAX_ID_CHARS, encode_routed_experts
from rollmesh.serve_apps.http_shapes import (
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    CompletionUsage,
    GenerateFinishReason,
    GenerateMetaInfo,
    GenerateRequest,
    GenerateResponse,
    PromptTokensDetails,
    RoutedExpertsDtype,
)
from rollmesh.serve_apps.openai_logprobs import check_completion_logprobs, completion_logprobs

# SGLang's default when sampling_params.max_new_tokens is absent (still clipped to the context).
SGLANG_DEFAULT_MAX_NEW_TOKENS = 128


@dataclass(frozen=True, slots=True)
class ServedModel:
    """What the API knows of the model behind it: its name, the limits it validates against
    (``vocab_size``: the embedding's rows, config.json's), and ``chat``: its tokenizer, chat
    template and parsers, loaded once per replica. ``routes_experts``: True for an MoE model,
    False for a dense one, None when the deployer did not say (then the engine refuses
    ``return_routed_experts`` on a dense model)."""

    name: str
    max_seq_len: int
    vocab_size: int
    chat: ChatModel
    routes_experts: bool | None = None

    @property
    def max_prompt_tokens(self) -> int:
        # As the prefill engine: one position stays free for the first generated token.
        return self.max_seq_len - 1


# -- requests ---------------------------------------------------------------------------------


def check_model(requested: str | None, served: ServedModel) -> None:
    if requested is not None and requested != served.name:
        raise ModelNotFoundError(requested, served.name)


def completion_inputs(
    request: CompletionRequest, served: ServedModel
) -> tuple[list[int], SamplingParams]:
    """The prompt's token ids in the model's tokenizer and sampling params; raises
    InvalidApiRequestError."""
    check_model(request.model, served)
    if request.n != 1:
        raise InvalidApiRequestError(
            f"n must be 1 (got {request.n}): one choice per request is supported",
            code="unsupported_value", param="n",
        )
    check_completion_logprobs(request.logprobs)
    max_tokens = 16 if request.max_tokens is None else request.max_tokens
    check_max_tokens(max_tokens, served, param="max_tokens")
    input_ids = served.chat.encode(request.prompt)
    if not input_ids:
        raise InvalidApiRequestError("prompt is empty", code="invalid_value", param="prompt")
    check_prompt_length(len(input_ids), served, param="prompt")
    sampling = openai_sampling_params(
        temperature=request.temperature, top_p=request.top_p, max_new_tokens=max_tokens,
        stop=request.stop, names={"max_new_tokens": "max_tokens"},
    )
    return input_ids, sampling


def generate_inputs(
    request: GenerateRequest, served: ServedModel
) -> tuple[list[int], SamplingParams]:
    """The request's token ids, checked against the vocabulary, and its sampling params."""
    if request.stream:
        raise InvalidApiRequestError(
            "streaming is not supported yet", code="unsupported_value", param="stream"
        )
    input_ids = list(request.input_ids)
    if not input_ids:
        raise InvalidApiRequestError(
            "input_ids is empty", code="invalid_value", param="input_ids"
        )
    check_prompt_length(len(input_ids), served, param="input_ids")
    for position, token_id in enumerate(input_ids):
        if not 0 <= token_id < served.vocab_size:
            raise InvalidApiRequestError(
                f"input_ids[{position}] = {token_id} is outside the vocabulary "
                f"[0, {served.vocab_size})",
                code="invalid_token_id", param="input_ids",
            )
    params = request.sampling_params
    max_new_tokens = params.max_new_tokens
    if max_new_tokens is None:
        max_new_tokens = min(SGLANG_DEFAULT_MAX_NEW_TOKENS, served.max_seq_len)
    check_max_tokens(max_new_tokens, served, param="sampling_params.max_new_tokens")
    sampling = openai_sampling_params(
        temperature=params.temperature, top_p=params.top_p, max_new_tokens=max_new_tokens,
        stop=params.stop, names={}, prefix="sampling_params.",
    )
    return input_ids, sampling


def generate_request_id(request: GenerateRequest) -> str:
    """SGLang's ``rid`` when the client sent one, else a fresh id."""
    if request.rid is None:
        return uuid.uuid4().hex
    if not 1 <= len(request.rid) <= MAX_ID_CHARS:
        raise InvalidApiRequestError(
            f"rid must be 1 to {MAX_ID_CHARS} characters (got {len(request.rid)})",
            code="invalid_value", param="rid",
        )
    return request.rid


def check_max_tokens(value: int, served: ServedModel, *, param: str) -> None:
    if not 1 <= value <= served.max_seq_len:
        raise InvalidApiRequestError(
            f"{param} must be between 1 and the context length {served.max_seq_len} "
            f"(got {value})",
            code="invalid_value", param=param,
        )


def check_prompt_length(num_tokens: int, served: ServedModel, *, param: str) -> None:
    if num_tokens > served.max_prompt_tokens:
        raise InvalidApiRequestError(
            f"the prompt is {num_tokens} tokens; at most {served.max_prompt_tokens} fit in the "
            f"context of {served.max_seq_len} (one position is kept for generation)",
            code="prompt_too_long", param=param,
        )


def openai_sampling_params(
    *,
    temperature: float | None,
    top_p: float | None,
    max_new_tokens: int,
    stop: str | list[str] | None,
    names: dict[str, str],
    prefix: str = "",
) -> SamplingParams:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if any(not s for s in stops):
        raise InvalidApiRequestError(
            "stop strings must not be empty", code="invalid_value", param=f"{prefix}stop"
        )
    raw = {"max_new_tokens": max_new_tokens, "stop": stops}
    if temperature is not None:
        raw["temperature"] = temperature
    if top_p is not None:
        raw["top_p"] = top_p
    try:
        # The wire Struct's own constraints are the one source of the allowed ranges.
        return msgspec.convert(raw, SamplingParams)
    except msgspec.ValidationError as exc:
        reason, field = _split_validation_message(str(exc))
        param = f"{prefix}{names.get(field, field)}" if field else None
        message = f"invalid {param}: {reason}" if param else reason
        raise InvalidApiRequestError(message, code="invalid_value", param=param) from exc


def _split_validation_message(message: str) -> tuple[str, str | None]:
    """msgspec's "Expected `float` <= 10.0 - at `$.temperature`" -> (reason, top-level field)."""
    reason, at, path = message.rpartition(" - at `$.")
    if not at:
        return message, None
    return reason, path.split("`")[0].split("[")[0].split(".")[0]


# -- responses --------------------------------------------------------------------------------


def completion_response(
    result: GenerationResult,
    *,
    request_id: str,
    created: int,
    served: ServedModel,
    sampling: SamplingParams,
    with_logprobs: bool,
    routed_experts_dtype: RoutedExpertsDtype = "compact",
) -> CompletionResponse:
    text = openai_text(result, served, sampling)
    logprobs = completion_logprobs(result, served.chat) if with_logprobs else None
    return CompletionResponse(
        id=request_id,
        created=created,
        model=served.name,
        choices=[
            CompletionChoice(
                index=0, text=text, finish_reason=openai_finish_reason(result),
                logprobs=logprobs, weight_versions=list(result.versions),
                rollmesh=encode_routed_experts(result, routed_experts_dtype),
            )
        ],
        usage=openai_usage(result),
    )


def openai_usage(result: GenerationResult) -> CompletionUsage:
    completion_tokens = len(result.token_ids)
    return CompletionUsage(
        prompt_tokens=result.prompt_len, completion_tokens=completion_tokens,
        total_tokens=result.prompt_len + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=result.cached_tokens),
    )


def openai_text(result: GenerationResult, served: ServedModel, sampling: SamplingParams) -> str:
    """The generated text as OpenAI returns it: decoded, cut before the stop string that ended it
    (OpenAI leaves the stop sequence out of the text; the tokens still hold it)."""
    text = served.chat.decode(result.token_ids, skip_special_tokens=True)
    return cut_at_stop(text, sampling) if result.finish_reason == "stop" else text


def cut_at_stop(text: str, sampling: SamplingParams) -> str:
    """``text`` up to the earliest of the request's stop strings in it (all of it if none is)."""
    return text[: _first_stop(text, sampling.stop)[0]]


def generate_response(
    result: GenerationResult,
    *,
    request_id: str,
    served: ServedModel,
    sampling: SamplingParams,
    return_logprob: bool,
    routed_experts_dtype: RoutedExpertsDtype = "compact",
) -> GenerateResponse:
    # Unlike SGLang, the text is not trimmed at a stop string: it is exactly output_ids decoded,
    # so a token-level caller can splice the two without re-tokenizing.
    text = served.chat.decode(result.token_ids)
    output_token_logprobs = None
    if return_logprob:
        output_token_logprobs = [
            (_finite(logprob), token_id, None)
            for logprob, token_id in zip(result.logprobs, result.token_ids, strict=True)
        ]
    routed = encode_routed_experts(result, routed_experts_dtype)
    return GenerateResponse(
        output_ids=list(result.token_ids),
        text=text,
        meta_info=GenerateMetaInfo(
            id=request_id,
            prompt_tokens=result.prompt_len,
            completion_tokens=len(result.token_ids),
            finish_reason=_generate_finish_reason(result, text, sampling),
            output_token_logprobs=output_token_logprobs,
            weight_version=result.versions[-1] if result.versions else None,
            weight_versions=list(result.versions),
            cached_tokens=result.cached_tokens,
            constrained=list(result.constrained) or None,
            **(routed.model_dump() if routed is not None else {}),
        ),
    )


def openai_finish_reason(result: GenerationResult) -> str:
    return {"eos": "stop", "stop": "stop", "length": "length"}.get(result.finish_reason, "abort")


def _generate_finish_reason(
    result: GenerationResult, text: str, sampling: SamplingParams
) -> GenerateFinishReason:
    reason = result.finish_reason
    if reason == "eos":  # the end-of-turn id that ended it, the last generated
        return GenerateFinishReason(type="stop", matched=result.token_ids[-1] if result.token_ids else None)
    if reason == "stop":
        return GenerateFinishReason(type="stop", matched=_first_stop(text, sampling.stop)[1])
    if reason == "length":
        return GenerateFinishReason(type="length", length=len(result.token_ids))
    return GenerateFinishReason(type="abort")


def _first_stop(text: str, stops: list[str]) -> tuple[int, str | None]:
    """Where the earliest stop string starts in ``text`` and which one it is."""
    found = [(text.find(s), s) for s in stops if s in text]
    return min(found) if found else (len(text), None)


def _finite(value: float) -> float | None:
    # JSON has no -inf/nan; a logprob that is not finite says "impossible under the sampler".
    return value if math.isfinite(value) else None
