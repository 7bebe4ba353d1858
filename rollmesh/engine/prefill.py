"""Prefill worker side: one prompt's forward pass, producing its KV pages and last logits.

Knows torch, the paged KV pool and the model; not Ray, not the decode engine's batch. The pool
here holds one prompt at a time; its pages are copied out in block layout, so a decode worker
with the same block size stores them with one indexed copy. The result is a plain dataclass of
contiguous tensors and travels through the Ray object store. The first generated token is sampled
from ``last_logits``, so that token carries this result's ``weight_version``; staged weights are
applied at the start of a call, never during one.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from rollmesh.engine.errors import MemoryReleasedError
from rollmesh.engine.kv_pages import KvBlockPool, PagedAttention
from rollmesh.engine.memory_release import MemoryMoveStats, ReleasableWeights
from rollmesh.engine.paged_model import model_device
from rollmesh.engine.request_checks import validate_prompt
from rollmesh.engine.weight_staging import WeightStager


@dataclass(frozen=True, slots=True)
class PrefillResult:
    input_ids: list[int]
    pages: torch.Tensor  # [layers, 2, blocks, block_size, kv_heads, head_dim]
    last_logits: torch.Tensor  # [V], float32
    weight_version: int
    routes: torch.Tensor | None = None  # [prompt tokens, sparse layers, top_k] (MoE)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def block_size(self) -> int:
        return self.pages.shape[3]

    def __reduce__(self):
        # Pages travel as a numpy array: Ray's serializer hands numpy buffers out-of-band and
        # maps them zero-copy from the object store, where a torch tensor would be pickled into
        # bytes and copied twice more. The receiver copies them once, into its blocks.
        return (_rebuild_prefill, (self.input_ids, self.pages.numpy(), self.last_logits,
                                   self.weight_version, self.routes))


def _rebuild_prefill(input_ids, pages, last_logits, weight_version, routes) -> PrefillResult:
    # The buffer may be read-only shared memory: wrap it without writing (write_pages copies).
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "non-writable array" - never written
        pages = torch.from_numpy(pages)
    return PrefillResult(input_ids, pages, last_logits, weight_version, routes)


def run_prefill(
    model: nn.Module,
    pool: KvBlockPool,
    blocks: list[int],
    input_ids: list[int],
    start: int,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Forward positions [start, len(input_ids)) of a sequence owning ``blocks`` (positions
    before ``start`` already in the pool); returns (last logits [V] float32, routes or None)."""
    paged = PagedAttention(pool, [blocks], [start], len(input_ids) - start,
                           sliding_window=model.sliding_window)
    ids = torch.as_tensor([input_ids[start:]], dtype=torch.long, device=model_device(model))
    logits, routes = model.forward_paged(ids, paged, last_only=True)
    return logits[0, -1].float(), None if routes is None else routes[0]


class PrefillEngine:
    """Runs prompts through ``model``; shares ``weights`` with a decode engine on the same model."""

    def __init__(
        self,
        model: nn.Module,
        *,
        block_size: int = 16,
        weights: WeightStager | None = None,
        version: int = 0,
    ) -> None:
        if weights is not None and weights.model is not model:
            raise ValueError("the WeightStager belongs to another model")
        self.model = model.eval()
        self.weights = weights or WeightStager(model, version=version)
        blocks = -(-model.max_seq_len // block_size)
        self.pool = KvBlockPool(model.kv_layout(), num_blocks=blocks, block_size=block_size,
                                device=model_device(model))
        self.memory = ReleasableWeights(model, self.weights, self.pool)

    @property
    def current_version(self) -> int:
        return self.weights.current_version

    @property
    def max_prompt_tokens(self) -> int:
        # One position stays free: a prompt that fills the context could not generate anything.
        return self.model.max_seq_len - 1

    @torch.inference_mode()
    def prefill(self, input_ids: list[int], *, request_id: str | None = None) -> PrefillResult:
        input_ids = validate_prompt(input_ids, self.model, request_id=request_id)
        if self.memory.released:
            raise MemoryReleasedError(request_id=request_id)
        self.weights.apply_staged()
        blocks = self.pool.allocate(self.pool.blocks_for(len(input_ids)))
        try:
            last_logits, routes = run_prefill(self.model, self.pool, blocks, input_ids, 0)
            pages = self.pool.read_pages(blocks)
        finally:
            self.pool.free(blocks)
        return PrefillResult(
            input_ids=input_ids, pages=pages, last_logits=last_logits.clone(),
            weight_version=self.weights.current_version,
            routes=None if routes is None else routes.clone(),
        )

    def stage_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> bool:
        """Keep new weights for the next call boundary (any thread); see WeightStager.stage.
        While the memory is released they wait on the host until ``resume_memory``."""
        return self.memory.stage(state_dict, version)

    def release_memory(self) -> MemoryMoveStats:
        """Weights to host memory, the scratch KV pool freed (it holds no prompt between calls);
        ``prefill`` raises the retryable MemoryReleasedError until ``resume_memory``. Between
        calls only, like weight swaps (staged weights are activated first)."""
        return self.memory.release(apply_staged=True)

    def resume_memory(self) -> MemoryMoveStats:
        """Weights back on the device (and the newest version staged meanwhile staged now)."""
        stats = self.memory.resume()
        deferred = self.memory.take_deferred()
        if deferred is not None:
            self.weights.stage(*deferred)
        return stats

    def apply_staged_weights(self) -> int | None:
        """Swap staged weights in now (between calls); the activated version, or None."""
        return self.weights.apply_staged()

    def pop_activation(self) -> int | None:
        return self.weights.pop_activation()
