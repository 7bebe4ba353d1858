"""Checks every engine entry point makes on a request before touching the model: its prompt,
its options against the model, a prefill worker's pages against the KV pool, its minimum weight
version.

Knows torch (to read any integer sequence), the engine's errors and the shapes of the model and
the KV pool; each raises a typed error naming the field, and none changes any state. Not the
engine's requests in flight, grammars (only their compiler can judge one) or KV capacity: the
decode engine checks those itself (``DecodeEngine.validate_request``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from rollmesh.engine.errors import (
    InvalidRequestError,
    PromptTooLongError,
    VersionUnavailableError,
)
from rollmesh.engine.kv_pages import KvBlockPool
from rollmesh.engine.protocols import MAX_TOP_LOGPROBS, GenerateOptions

if TYPE_CHECKING:  # prefill.py imports this module
    from rollmesh.engine.prefill import PrefillResult


def validate_prompt(input_ids, model, *, request_id: str | None = None) -> list[int]:
    """The prompt as a list of ints; raises for an empty, too long or out-of-vocabulary one."""
    try:
        ids = torch.as_tensor(input_ids)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise InvalidRequestError(
            f"not a list of token ids: {exc}", field="input_ids", request_id=request_id
        ) from exc
    if ids.dim() != 1:
        raise InvalidRequestError(
            f"expected a flat list of token ids, got shape {tuple(ids.shape)}",
            field="input_ids", request_id=request_id,
        )
    if ids.numel() == 0:
        raise InvalidRequestError("empty prompt", field="input_ids", request_id=request_id)
    if ids.dtype == torch.bool or ids.dtype.is_floating_point or ids.dtype.is_complex:
        raise InvalidRequestError(
            f"token ids must be integers, got {ids.dtype}", field="input_ids",
            request_id=request_id,
        )
    max_tokens = model.max_seq_len - 1
    if ids.numel() > max_tokens:
        raise PromptTooLongError(ids.numel(), max_tokens, request_id=request_id)
    vocab = model.vocab_size
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= vocab:
        bad = low if low < 0 else high
        raise InvalidRequestError(
            f"token id {bad} outside the vocabulary [0, {vocab})", field="input_ids",
            request_id=request_id,
        )
    return [int(token) for token in ids.tolist()]


def check_options(options: GenerateOptions, prompt_len: int, model, *,
                  request_id: str | None = None) -> None:
    """Raise for a prompt past the context or options the model cannot serve (not for the
    grammar, which only its compiler can judge, nor for KV capacity)."""
    max_seq_len = model.max_seq_len
    if prompt_len > max_seq_len - 1:
        raise PromptTooLongError(prompt_len, max_seq_len - 1, request_id=request_id)
    if not 0 <= options.top_logprobs <= MAX_TOP_LOGPROBS:
        raise InvalidRequestError(
            f"{options.top_logprobs} is outside [0, {MAX_TOP_LOGPROBS}]", field="top_logprobs",
            request_id=request_id,
        )
    start = options.routed_experts_start_len
    if not 0 <= start <= prompt_len:
        raise InvalidRequestError(
            f"{start} is outside [0, {prompt_len}] (the prompt's length)",
            field="routed_experts_start_len", request_id=request_id,
        )
    if options.return_routed_experts and model.routing_shape is None:
        raise InvalidRequestError(
            "the model is dense: it routes no experts", field="return_routed_experts",
            request_id=request_id,
        )


def check_prefill(prefill: PrefillResult, model, pool: KvBlockPool, *,
                  request_id: str | None = None) -> None:
    """Raise for a prefill worker's result that does not fit this model and its KV pool."""
    if prefill.num_tokens < 1:
        raise InvalidRequestError("empty prompt", field="prefill", request_id=request_id)
    layout = model.kv_layout()
    expected = (layout.num_layers, 2, pool.blocks_for(prefill.num_tokens),
                pool.block_size, layout.num_kv_heads, layout.head_dim)
    if tuple(prefill.pages.shape) != expected:
        raise InvalidRequestError(
            f"KV pages of shape {tuple(prefill.pages.shape)}, expected {expected}",
            field="prefill.pages", request_id=request_id,
        )
    if tuple(prefill.last_logits.shape) != (model.vocab_size,):
        raise InvalidRequestError(
            f"last_logits shape {tuple(prefill.last_logits.shape)}, expected "
            f"({model.vocab_size},)",
            field="prefill.last_logits", request_id=request_id,
        )


def check_min_version(min_version: int | None, version: int, *, request_id: str) -> None:
    """Raise VersionUnavailableError while ``version`` is older than the request needs."""
    if min_version is not None and version < min_version:
        raise VersionUnavailableError(min_version, version, request_id=request_id)
