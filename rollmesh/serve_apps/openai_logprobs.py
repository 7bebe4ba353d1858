"""OpenAI's ``logprobs`` on chat completions and legacy completions, from the logprobs the engine
sampled with.

Knows the HTTP shapes and the served model's tokenizer; not Ray, not FastAPI. The logprob of each
generated token (its end-of-turn token included) is the behaviour logprob the engine returned: that
of the distribution the token was drawn from (temperature-scaled, top-p renormalised; a greedy
row's is the model's own log-softmax; ``rollmesh.engine.sampling``). The engine returns no
alternatives, so a request for N > 0 of them (chat ``top_logprobs``, completions ``logprobs``) is
refused with a 400 rather than answered with fewer than asked; N = 0 is served.

The shapes follow vLLM's OpenAI server (vllm/entrypoints/openai/serving_chat.py
``_create_chat_logprobs`` and serving_completion.py ``_create_completion_logprobs``): a token is
its text with special tokens spelled out, ``bytes`` its text's UTF-8, a logprob that is not finite
is -9999.0 (OpenAI's "very unlikely": its types say a number, never null), ``text_offset`` accumulates the tokens' text lengths, and a completion's ``top_logprobs`` entry at
N = 0 holds the sampled token alone (vLLM always includes it).
"""

from __future__ import annotations

import math

from rollmesh.chat import ChatModel
from rollmesh.engine.protocols import GenerationResult
from rollmesh.serve_apps.errors import InvalidApiRequestError
from rollmesh.serve_apps.http_shapes import (
    ChatCompletionRequest,
    ChatLogprobs,
    CompletionLogprobs,
    TokenLogprob,
)

# OpenAI's limits: chat top_logprobs 0..20, legacy completions logprobs 0..5.
MAX_CHAT_TOP_LOGPROBS = 20
MAX_COMPLETION_LOGPROBS = 5
# OpenAI's logprob of a token that is (almost) impossible; a chat logprob must be a number.
IMPOSSIBLE_LOGPROB = -9999.0


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
    if count > 0:
        raise InvalidApiRequestError(
            f"{param} = {count} asks for the top alternatives of each token, which the engine does "
            f"not return yet; {param} = 0 gives each sampled token's logprob",
            code="unsupported_value", param=param)


def chat_logprobs(result: GenerationResult, chat: ChatModel) -> ChatLogprobs:
    """``choices[].logprobs`` of a chat completion: one entry per generated token."""
    content = []
    for token_id, logprob in zip(result.token_ids, result.logprobs, strict=True):
        token = token_text(token_id, chat)
        content.append(TokenLogprob(
            token=token, logprob=_finite(logprob),
            bytes=list(token.encode("utf-8", errors="replace")), top_logprobs=[]))
    return ChatLogprobs(content=content)


def completion_logprobs(result: GenerationResult, chat: ChatModel) -> CompletionLogprobs:
    """``choices[].logprobs`` of a legacy completion (``logprobs: 0``)."""
    tokens = [token_text(token_id, chat) for token_id in result.token_ids]
    logprobs = [_finite(value) for value in result.logprobs]
    offsets, at = [], 0
    for token in tokens:
        offsets.append(at)
        at += len(token)
    return CompletionLogprobs(
        tokens=tokens, token_logprobs=logprobs,
        top_logprobs=[{token: value} for token, value in zip(tokens, logprobs, strict=True)],
        text_offset=offsets)


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else IMPOSSIBLE_LOGPROB


def token_text(token_id: int, chat: ChatModel) -> str:
    """One token as OpenAI's logprobs show it: its text, special tokens spelled out (a token that
    holds part of a character shows the replacement character, as in vLLM)."""
    return chat.decode([token_id])
