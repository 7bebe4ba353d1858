"""Prefill: one prompt's forward pass, producing its KV cache and last logits.

Knows torch and the model; not Ray, not the decode engine's slots. The result is a plain dataclass
of contiguous tensors, so it can travel through the Ray object store to a decode worker. The first
generated token is sampled from ``last_logits``, so that token carries this result's
``weight_version``; staged weights are applied at the start of a call, never during one.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from rollmesh.engine.errors import InvalidRequestError, PromptTooLongError
from rollmesh.engine.model import TinyDecoder
from rollmesh.engine.weight_staging import WeightStager


@dataclass(frozen=True, slots=True)
class PrefillResult:
    kv: torch.Tensor  # [L, 2, H, T, head_dim], contiguous float32
    last_logits: torch.Tensor  # [V]
    num_tokens: int
    weight_version: int


class PrefillEngine:
    """Runs prompts through ``model``; shares ``weights`` with a decode engine on the same model."""

    def __init__(
        self, model: TinyDecoder, *, weights: WeightStager | None = None, version: int = 0
    ) -> None:
        if weights is not None and weights.model is not model:
            raise ValueError("the WeightStager belongs to another model")
        self.model = model.eval()
        self.weights = weights or WeightStager(model, version=version)

    @property
    def current_version(self) -> int:
        return self.weights.current_version

    @property
    def max_prompt_tokens(self) -> int:
        # One position stays free: a prompt that fills the context could not generate anything.
        return self.model.shape.max_seq_len - 1

    def prefill(self, input_ids: list[int], *, request_id: str | None = None) -> PrefillResult:
        self.validate(input_ids, request_id=request_id)
        self.weights.apply_staged()
        last_logits, kv = self.model.prefill(list(input_ids))
        # clone: a view would pin (and pickle) the logits of every prompt position.
        return PrefillResult(
            kv=kv.float().contiguous(),
            last_logits=last_logits.float().clone(),
            num_tokens=len(input_ids),
            weight_version=self.weights.current_version,
        )

    def validate(self, input_ids: list[int], *, request_id: str | None = None) -> None:
        """Raise a typed error for an empty, too long or out-of-vocabulary prompt."""
        if len(input_ids) == 0:
            raise InvalidRequestError("empty prompt", field="input_ids", request_id=request_id)
        if len(input_ids) > self.max_prompt_tokens:
            raise PromptTooLongError(
                len(input_ids), self.max_prompt_tokens, request_id=request_id
            )
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
        if ids.dtype == torch.bool or ids.dtype.is_floating_point or ids.dtype.is_complex:
            raise InvalidRequestError(
                f"token ids must be integers, got {ids.dtype}", field="input_ids",
                request_id=request_id,
            )
        vocab = self.model.shape.vocab_size
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= vocab:
            bad = low if low < 0 else high
            raise InvalidRequestError(
                f"token id {bad} outside the vocabulary [0, {vocab})", field="input_ids",
                request_id=request_id,
            )

    def stage_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> bool:
        """Keep new weights for the next call boundary (any thread); see WeightStager.stage."""
        return self.weights.stage(state_dict, version)

    def apply_staged_weights(self) -> int | None:
        """Swap staged weights in now (between calls); the activated version, or None."""
        return self.weights.apply_staged()

    def pop_activation(self) -> int | None:
        return self.weights.pop_activation()
