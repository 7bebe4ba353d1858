"""OpenAI's ``logprobs`` on chat completions and legacy completions, from the logprobs the engine
sampled with.

Knows the HTTP shapes and the served model's tokenizer; not Ray, not FastAPI. The logprob of each
generated token (its end-of-turn token included) is the behaviour logprob the engine returned: that
of the distribution the token was drawn from (temperature-scaled, top-p renormalised; a greedy
row's is the model's own log-softmax; ``rollmesh.engine.sampling``). A request for N > 0
alternatives (chat ``top_logprobs`` up to 20, completions ``logprobs`` up to 5) asks the engine for
them (``GenerateOptions.top_logprobs``): the N most likely tokens of that same distribution, most
likely first, so a token outside a top-p nucleus shows -9999.0. Each function takes the tokens of
a whole result or of one streamed piece (anything with ``token_ids``, ``logprobs`` and
``top_logprobs``), so streamed chunks carry the logprobs of their own tokens.

The shapes follow vLLM's OpenAI server (vllm/entrypoints/openai/serving_chat.py
``_create_chat_logprobs`` and serving_completion.py ``_create_completion_logprobs``): a token is
its text with special tokens spelled out, ``bytes`` its text's UTF-8, a logprob that is not finite
is -9999.0 (OpenAI's "very unlikely": its types say a number, never null), ``text_offset`` accumulates the tokens' text lengths, and a completion's ``top_logprobs`` entry at
N = 0 holds the sampled token alone (vLLM always includes it), at N > 0 the N alternatives and
the sampled token.
"""

from __future__ import annotations

import math

from typing import Protocol

from rollmesh.chat import ChatModel
from rollmesh.engine.protocols import TopLogprobs
from rollmesh.serve_apps.errors import InvalidApiRequestError
from rollmesh.serve_apps.http_shapes import (
    ChatCompletionRequest,
    ChatLogprobs,
    CompletionLogprobs,
    TokenLogprob,
    TopLogprob,
)

# OpenAI's limits: chat top_logprobs 0..20, legacy completions logprobs 0..5.
MAX_CHAT_TOP_LOGPROBS = 20
MAX_COMPLETION_LOGPROBS = 5
# OpenAI's logprob of a token that is (almost) impossible; a chat logprob must be a number.
IMPOSSIBLE_LOGPROB = -9999.0


class SampledTokens(Protocol):
    """A GenerationResult, or a streamed TokenDelta: tokens with their logprobs."""

    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[TopLogprobs] | None


def check_chat_logprobs(request: ChatCompletionRequest) -> None:
    """Raises InvalidApiRequestError for a ``top_logprobs`` OpenAI refuses or the engine cannot
    serve."""
    top = request.top_logprobs
    if top is None:
        return
    if not request.logprobs:
        raise InvalidApiRequestError("top_logprobs needs logprobs: true", code="invalid_value",
                                     param="top_logprobs")
    _check_alternatives(top, MAX_CHAT_TOP_LOGPROBS, param="top_logprobs")


def check_completion_logprobs(logprobs: int | None) -> None:
    if logprobs is not None:
        _check_alternatives(logprobs, MAX_COMPLETION_LOGPROBS, param="logprobs")


def _check_alternatives(count: int, limit: int, *, param: str) -> None:
    if not 0 <= count <= limit:
        raise InvalidApiRequestError(f"{param} must be between 0 and {limit} (got {count})",
                                     code="invalid_value", param=param)


def chat_logprobs(result: SampledTokens, chat: ChatModel) -> ChatLogprobs:
    """``choices[].logprobs`` of a chat completion: one entry per generated token, each with its
    alternatives when the request asked for some."""
    content = []
    for position, (token_id, logprob) in enumerate(zip(result.token_ids, result.logprobs, strict=True)):
        token = token_text(token_id, chat)
        alternatives = [TopLogprob(token=text, logprob=_finite(value), bytes=_bytes(text))
                        for text, value in _alternatives(result, position, chat)]
        content.append(TokenLogprob(token=token, logprob=_finite(logprob), bytes=_bytes(token),
                                    top_logprobs=alternatives))
    return ChatLogprobs(content=content)


def completion_logprobs(result: SampledTokens, chat: ChatModel, *,
                        text_offset: int = 0) -> CompletionLogprobs:
    """``choices[].logprobs`` of a legacy completion; ``text_offset``: where the first token's
    text starts (a streamed piece's, after the text already sent)."""
    tokens = [token_text(token_id, chat) for token_id in result.token_ids]
    logprobs = [_finite(value) for value in result.logprobs]
    offsets, at = [], text_offset
    for token in tokens:
        offsets.append(at)
        at += len(token)
    top = []
    for position, (token, value) in enumerate(zip(tokens, logprobs, strict=True)):
        entry = {text: _finite(alternative) for text, alternative in _alternatives(result, position, chat)}
        entry.setdefault(token, value)
        top.append(entry)
    return CompletionLogprobs(tokens=tokens, token_logprobs=logprobs, top_logprobs=top,
                              text_offset=offsets)


def _alternatives(result: SampledTokens, position: int, chat: ChatModel) -> list[tuple[str, float]]:
    if result.top_logprobs is None:
        return []
    return [(token_text(token_id, chat), value) for token_id, value in result.top_logprobs[position]]


def _bytes(token: str) -> list[int]:
    return list(token.encode("utf-8", errors="replace"))


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else IMPOSSIBLE_LOGPROB


def token_text(token_id: int, chat: ChatModel) -> str:
    """One token as OpenAI's logprobs show it: its text, special tokens spelled out (a token that
    holds part of a character shows the replacement character, as in vLLM)."""
    return chat.decode([token_id])
