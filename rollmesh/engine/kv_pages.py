"""Paged KV cache: a pool of fixed-size blocks, and the attention view one forward pass uses.

Knows torch (and memory_release's host copies) only. The pool is one tensor [layers, 2 (K/V), blocks * block_size, kv_heads,
head_dim]; a sequence owns a list of blocks (its page table) and its token at position p lives in
slot ``blocks[p // block_size] * block_size + p % block_size``. Blocks are handed out from a free
list, so sequences of any length join and leave without moving anyone else's KV.

``PagedAttention`` is built once per forward pass from the page tables of its rows and is called
by every layer: it writes the new tokens' K/V into their slots, then gathers each row's whole
context by slot index and runs scaled-dot-product attention with a causal mask. Hand-rolled
rather than a paged-attention kernel: on CPU there is none in torch, and a gather of at most a
few MiB per layer costs less than the matmuls around it at the model sizes we run here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rollmesh.engine.errors import EngineError
from rollmesh.engine.memory_release import HOST, to_device


@dataclass(frozen=True, slots=True)
class KvLayout:
    """The per-token KV geometry of a model."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.float32


class OutOfBlocksError(EngineError, RuntimeError):
    """Raised by ``KvBlockPool.allocate`` when the free list is too short (callers evict and
    retry, or keep the request waiting)."""

    def __init__(self, wanted: int, free: int) -> None:
        super().__init__(f"{wanted} KV blocks wanted, {free} free")
        self.wanted = wanted
        self.free = free


class KvBlockPool:
    """The KV storage of one engine and its free list."""

    def __init__(
        self, layout: KvLayout, *, num_blocks: int, block_size: int, device: torch.device | str = "cpu"
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.layout = layout
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.kv = torch.zeros(
            layout.num_layers, 2, num_blocks * block_size, layout.num_kv_heads, layout.head_dim,
            dtype=layout.dtype, device=device,
        )
        # Popped from the end: the lowest-numbered blocks are reused first (better locality).
        self._free = list(range(num_blocks - 1, -1, -1))
        # While the memory is lent (offload_to_host): the blocks in use and their pages on the host.
        self._host: tuple[list[int], torch.Tensor | None] | None = None
        self._device = self.kv.device

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise OutOfBlocksError(count, len(self._free))
        taken = self._free[len(self._free) - count:]
        del self._free[len(self._free) - count:]
        return taken[::-1]

    def free(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))

    def slots(self, blocks: list[int], start: int, stop: int) -> torch.Tensor:
        """Slot indices of positions [start, stop) of a sequence owning ``blocks``."""
        positions = torch.arange(start, stop)
        table = torch.as_tensor(blocks, dtype=torch.long)
        return table[positions // self.block_size] * self.block_size + positions % self.block_size

    def read_pages(self, blocks: list[int]) -> torch.Tensor:
        """A copy of whole blocks: [layers, 2, len(blocks), block_size, kv_heads, head_dim]."""
        paged = self.kv.view(*self.kv.shape[:2], self.num_blocks, self.block_size, *self.kv.shape[3:])
        return paged[:, :, torch.as_tensor(blocks, dtype=torch.long)].contiguous()

    def write_pages(self, blocks: list[int], pages: torch.Tensor) -> None:
        """Store pages made by another pool with the same layout and block size."""
        paged = self.kv.view(*self.kv.shape[:2], self.num_blocks, self.block_size, *self.kv.shape[3:])
        paged[:, :, torch.as_tensor(blocks, dtype=torch.long)] = pages.to(self.kv.dtype)

    # -- lending the memory (memory_release) ------------------------------------------------

    @property
    def offloaded(self) -> bool:
        return self._host is not None

    def offload_to_host(self) -> int:
        """Copy the blocks in use (parked sessions) to host memory and free the pool tensor;
        returns the bytes copied. Free blocks hold nothing worth keeping, so an idle pool moves
        only what its sessions parked. Nothing may read or write the pool until ``restore``."""
        if self._host is not None:
            return 0
        free = set(self._free)
        used = [block for block in range(self.num_blocks) if block not in free]
        pages = self.read_pages(used) if used else None
        self._device = self.kv.device
        self._host = (used, None if pages is None else to_device(pages, HOST))
        self.kv = torch.empty(0, dtype=self.layout.dtype, device=self._device)
        return 0 if pages is None else pages.numel() * pages.element_size()

    def restore(self) -> int:
        """Allocate the pool again on its device and put the kept blocks back; bytes copied."""
        if self._host is None:
            return 0
        used, pages = self._host
        layout = self.layout
        self.kv = torch.zeros(layout.num_layers, 2, self.num_blocks * self.block_size, layout.num_kv_heads,
                              layout.head_dim, dtype=layout.dtype, device=self._device)
        if pages is not None:
            self.write_pages(used, pages.to(self._device, non_blocking=True))
        self._host = None
        return 0 if pages is None else pages.numel() * pages.element_size()


class PagedAttention:
    """The attention of one forward pass over rows that each add ``T`` tokens to their context.

    Row b's new tokens sit at positions ``starts[b] .. starts[b] + T - 1``; everything before
    ``starts[b]`` is already in the pool. Decode steps have T = 1 and many rows; a prefill has
    one row and T = the prompt (or the part of it the session cache did not already hold).
    """

    def __init__(
        self,
        pool: KvBlockPool,
        page_tables: list[list[int]],
        starts: list[int],
        num_new: int,
        *,
        sliding_window: int | None = None,
    ) -> None:
        self.pool = pool
        self.num_new = num_new
        device = pool.kv.device
        starts_t = torch.as_tensor(starts, dtype=torch.long)
        self.positions = starts_t[:, None] + torch.arange(num_new)[None, :]  # [B, T]
        context = max(starts) + num_new
        block_size = pool.block_size
        width = -(-context // block_size)
        table = torch.zeros(len(page_tables), width, dtype=torch.long)
        for row, blocks in enumerate(page_tables):
            used = min(len(blocks), width)
            table[row, :used] = torch.as_tensor(blocks[:used], dtype=torch.long)
        key_positions = torch.arange(context)
        # [B, context]: the slot of every key position (rows shorter than ``context`` point at
        # their own or block 0's slots there; the mask hides those).
        self.read_slots = (table[:, key_positions // block_size] * block_size
                           + key_positions % block_size).to(device)
        self.write_slots = self.read_slots.gather(1, self.positions.to(device)).reshape(-1)
        # The first forward of a fresh prompt sees only its own tokens: plain causal attention
        # on q, k, v, no gather (the common prefill case).
        self.self_contained = max(starts) == 0 and len(page_tables) == 1 and (
            sliding_window is None or num_new <= sliding_window
        )
        distance = self.positions[:, :, None] - key_positions[None, None, :]  # [B, T, context]
        visible = distance >= 0
        if sliding_window is not None:
            visible &= distance < sliding_window
        # One row adding one token sees its whole context: no mask needed (the common
        # single-request decode step, where every microsecond counts).
        self.mask = None if (len(page_tables) == 1 and num_new == 1 and bool(visible.all())) \
            else visible[:, None].to(device)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [B, H, T, D], k and v [B, KVH, T, D] (rotated) -> attention output [B, H, T, D]."""
        batch, kv_heads, steps, head_dim = k.shape
        cache = self.pool.kv[layer]
        cache[0, self.write_slots] = k.transpose(1, 2).reshape(-1, kv_heads, head_dim).to(cache.dtype)
        cache[1, self.write_slots] = v.transpose(1, 2).reshape(-1, kv_heads, head_dim).to(cache.dtype)
        gqa = q.shape[1] != kv_heads
        if self.self_contained:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        keys = cache[0][self.read_slots].transpose(1, 2).to(q.dtype)  # [B, KVH, context, D]
        values = cache[1][self.read_slots].transpose(1, 2).to(q.dtype)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=self.mask, enable_gqa=gqa)
