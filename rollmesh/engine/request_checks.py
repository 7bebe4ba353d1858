"""Checks every engine entry point makes on a request before touching the model.

Knows torch (to read any integer sequence) and the engine's errors; each raises a typed error
naming the field, and none changes any state.
"""

from __future__ import annotations

import torch

from rollmesh.engine.errors import InvalidRequestError, PromptTooLongError


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
