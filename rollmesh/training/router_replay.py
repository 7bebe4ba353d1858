"""Rollout routing replay (R3) for MoE models: the training forward routes each token to the
experts the inference engine chose for it, while the gate weights come from the trainer's own
router, so the router still learns and a bf16/fp32 near-tie cannot send a token elsewhere.

Knows torch, numpy and ``CausalLM``'s layer loop; not the bus, the store or the loss.

Alignment. For a trajectory of N tokens the engine records a row for each position it ran, in
position order: the prompt positions in prefill, then each generated token as the next step
feeds it in. Row t is the choice made when the model processed token t (prefix reuse keeps the
rows of the reused positions). The last token is sampled but never fed back in, so there are
N - 1 rows. The training inputs are tokens[:-1] (``PolicyBatch``), whose logits score
tokens[1:], so every input position has its row. A right-padding position gets a fixed valid
choice (experts 0..k-1): in a causal model a position only affects itself and later positions,
and its logits are masked out, so that choice reaches neither the loss nor any gradient.

Storage and slicing. Rows are kept per sample in the smallest unsigned dtype that holds every
expert id (uint8 up to 256 experts, else uint16), 8x smaller than int64. A data-parallel rank
picks its samples by index first and widens only those to int64 tensors, so it never holds the
rows of the other ranks' samples. ``batch_rows`` is the one rule of when a batch replays, which
every trainer backend applies.

Recompute. ``forward_with_replay(recompute=True)`` checkpoints each layer. The replayed ids are
inputs of the checkpointed call, so the recompute in backward uses the same experts. Without
replay, the recompute would take its own top k again and could pick other experts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

import numpy as np
import torch
from torch.utils.checkpoint import checkpoint

from rollmesh.engine.models.llama import CausalLM, rope_cos_sin
from rollmesh.training.errors import ExpertIdError, RoutedRowsShapeError, RowsAlignmentError
from rollmesh.training.grpo import PolicySample

T = TypeVar("T")


def expert_id_dtype(num_experts: int) -> np.dtype:
    """The smallest unsigned dtype holding ids 0..num_experts-1 (the engine's own choice)."""
    return np.dtype(np.uint8 if num_experts <= 256 else np.uint16)


def compact_rows(
    rows: np.ndarray | torch.Tensor,
    *,
    num_experts: int,
    routing_shape: tuple[int, int],
    sample: int | None = None,
) -> np.ndarray:
    """Validated rows [positions, sparse layers, top_k] in ``expert_id_dtype(num_experts)``.

    Accepts any integer dtype (the engine's uint8/uint16, SGLang's int32); raises
    ``RoutedRowsShapeError`` or ``ExpertIdError``.
    """
    array = rows.cpu().numpy() if isinstance(rows, torch.Tensor) else np.asarray(rows)
    if (array.ndim != 3 or array.shape[1:] != tuple(routing_shape)
            or not np.issubdtype(array.dtype, np.integer)):
        raise RoutedRowsShapeError(shape=tuple(array.shape), dtype=str(array.dtype),
                                   expected=tuple(routing_shape), sample=sample)
    if array.size:
        low, high = int(array.min()), int(array.max())
        if low < 0 or high >= num_experts:
            raise ExpertIdError("out of range", expert_id=low if low < 0 else high,
                                num_experts=num_experts, sample=sample)
        # A repeated id would send the token through one expert twice: top-k never does that.
        ordered = np.sort(array, axis=-1)
        repeated = ordered[..., 1:] == ordered[..., :-1]
        if repeated.any():
            raise ExpertIdError("repeated within one row", expert_id=int(ordered[..., 1:][repeated][0]),
                                num_experts=num_experts, sample=sample)
    return np.ascontiguousarray(array, dtype=expert_id_dtype(num_experts))


def rows_for_inputs(rows: np.ndarray, num_tokens: int, *, sample: int | None = None) -> np.ndarray:
    """The rows of a trajectory of ``num_tokens`` tokens, checked to match its training inputs
    (tokens[:-1]): exactly ``num_tokens - 1`` rows, row t for input position t."""
    if len(rows) != num_tokens - 1:
        raise RowsAlignmentError(rows=len(rows), tokens=num_tokens, sample=sample)
    return rows


def batch_rows(
    samples: Sequence[PolicySample], *, num_experts: int, routing_shape: tuple[int, int]
) -> list[np.ndarray] | None:
    """Each sample's checked rows (``compact_rows``, ``rows_for_inputs``), or None when a trained
    sample has none: the whole batch then routes by the trainer's router (a half-replayed batch
    would mix the two). An infrastructure-failed sample trains nothing: it gets no rows (its
    positions are padded with valid ids) and its recorded ones are not read."""
    if any(s.routed_experts is None and not s.infra_failed for s in samples):
        return None
    rows = []
    for index, sample in enumerate(samples):
        if sample.infra_failed:
            rows.append(np.zeros((0, *routing_shape), dtype=expert_id_dtype(num_experts)))
            continue
        checked = compact_rows(sample.routed_experts, num_experts=num_experts, routing_shape=routing_shape,
                               sample=index)
        rows.append(rows_for_inputs(checked, len(sample.tokens), sample=index))
    return rows


def rank_sample_indices(num_samples: int, *, rank: int, world_size: int) -> range:
    """The samples data-parallel ``rank`` trains: contiguous blocks, the first ``num_samples %
    world_size`` ranks one sample more. Use the same split for the tokens as for the rows."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside a world of {world_size}")
    base, extra = divmod(num_samples, world_size)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (rank < extra))


def rank_share(samples: Sequence[T], *, rank: int, world_size: int) -> list[T]:
    """This rank's samples, reading ``samples`` only at its own indices (a lazy sequence of
    rows or of store references works: the other ranks' entries are never touched)."""
    return [samples[i] for i in rank_sample_indices(len(samples), rank=rank, world_size=world_size)]


def context_shard(seq_len: int, *, cp_rank: int, cp_size: int) -> slice:
    """Positions of a contiguous context-parallel split (no load-balancing zigzag)."""
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"context-parallel rank {cp_rank} outside a group of {cp_size}")
    per_rank = -(-seq_len // cp_size)
    return slice(min(cp_rank * per_rank, seq_len), min((cp_rank + 1) * per_rank, seq_len))


def replay_tensor(
    rows: Sequence[np.ndarray],
    seq_len: int,
    *,
    positions: slice | None = None,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """Rows of this rank's samples as the model's ``routed_experts`` [B, T, sparse layers,
    top_k] int64, right-padded to ``seq_len`` positions with experts 0..k-1 (see the module
    docstring). ``positions`` keeps only those positions (a context-parallel shard); only the
    kept rows are widened."""
    if not rows:
        raise ValueError("no samples to replay")
    layers, top_k = rows[0].shape[1:]
    window = positions or slice(0, seq_len)
    start, stop, _ = window.indices(seq_len)
    out = torch.arange(top_k, dtype=torch.long).expand(len(rows), stop - start, layers, top_k).clone()
    for index, sample_rows in enumerate(rows):
        if len(sample_rows) > seq_len:
            raise RowsAlignmentError(rows=len(sample_rows), tokens=seq_len + 1, sample=index)
        kept = sample_rows[start:min(stop, len(sample_rows))]
        out[index, : len(kept)] = torch.from_numpy(kept.astype(np.int64))
    return out.to(device)


def forward_with_replay(
    model: CausalLM,
    input_ids: torch.Tensor,
    routed_experts: torch.Tensor | None,
    *,
    recompute: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``model.forward_with_routes`` for training: logits [B, T, V] and the expert ids used.

    ``routed_experts`` [B, T, sparse layers, top_k] replays recorded ids (None: the model's own
    top k). ``recompute`` checkpoints every layer (activations recomputed in backward, with
    the same replayed ids). The loop mirrors ``CausalLM.forward_with_routes``; a test holds
    the two equal.
    """
    batch, seq = input_ids.shape
    x = model.model.embed_tokens(input_ids)
    positions = torch.arange(seq, device=input_ids.device)
    cos, sin = rope_cos_sin(positions, model.config.head_dim, model.config.rope_theta, x.dtype)
    routes = []
    for layer, replay in zip(model.model.layers, model.layer_replays(routed_experts)):
        if recompute and torch.is_grad_enabled():
            x, routed = checkpoint(layer, x, cos, sin, replay=replay, use_reentrant=False)
        else:
            x, routed = layer(x, cos, sin, replay=replay)
        if routed is not None:
            routes.append(routed.view(batch, seq, -1))
    logits = model.lm_head(model.model.norm(x))
    return logits, torch.stack(routes, dim=2) if routes else None
