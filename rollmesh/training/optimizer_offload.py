"""Chunked optimizer offload: AdamW whose fp32 state lives in host memory and visits the device
one chunk at a time, double-buffered, bit-identical to ``MixedPrecisionAdamW``.

The master weights and both Adam moments of all parameters are laid end to end in three flat
host tensors (pinned when the device is CUDA), cut into chunks of ``chunk_bytes`` each
(``optimizer_chunks``). The device holds only the bf16 parameters and gradients plus, during the
step, two chunk slots of state, one fp32 gradient chunk and one scratch chunk. While chunk i is
updated in one slot, the other slot writes chunk i-1 back to the host and then receives chunk i+1.
Copies run on side CUDA streams ordered by events (``StreamCopies``), or on CPU on a worker
thread (``ThreadCopies``) or inline (``InlineCopies``: the same pipeline, no overlap). On a
2-core CPU inline is the default: a copy thread hides the copies but takes a core from the
update, and the two come out even (figures in ``benchmarks/optimizer_offload.py``).
Knows torch and the device-memory account; nothing of models, Ray or NATS.
"""

from __future__ import annotations

import ctypes
import itertools
import time
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Literal, Protocol

import msgspec
import torch

from rollmesh.training.device_memory import DeviceMemoryAccount
from rollmesh.training.optimizer_adamw import (
    AdamWConfig,
    AdamWState,
    TrainingLoopMethods,
    adamw_update_,
    checked_parameters,
    flat_gradients,
)
from rollmesh.training.optimizer_chunks import Chunk, plan_chunks

Copies = Literal["stream", "thread", "inline"]
# Per fp32 state tensor. CPU: 1 MiB keeps a chunk's working set (5 tensors) in the L3 cache, the
# fastest of 256 KiB-64 MiB on the 2-core benchmark machine. CUDA: larger, so that the ~30 kernel
# launches of a chunk's update are small next to its copies (reasoned, not yet measured on a GPU).
DEFAULT_CHUNK_BYTES = {"cpu": 1 << 20, "cuda": 32 << 20}
_FP32_BYTES = 4


class OffloadStats(msgspec.Struct, frozen=True, kw_only=True):
    """Figures of the last step. ``wait_seconds``: time the update stood waiting for a chunk to
    arrive (0 when copies are fully hidden); ``copy_seconds``: time spent copying, host side
    (None on CUDA, where copies are queued, not timed)."""

    chunks: int
    chunk_numel: int
    host_bytes: int
    device_buffer_bytes: int
    copies: str
    wait_seconds: float
    copy_seconds: float | None


class ChunkedOffloadAdamW(TrainingLoopMethods):
    """``MixedPrecisionAdamW`` with its fp32 state in host memory, streamed through the device in
    chunks of ``chunk_bytes`` (per state tensor: master, exp_avg and exp_avg_sq each move that
    much per chunk). ``copies``: "stream" on CUDA (default there), "thread" or "inline" on CPU."""

    def __init__(self, named_parameters: Iterable[tuple[str, torch.Tensor]], *, config: AdamWConfig,
                 device: torch.device | str, chunk_bytes: int | None = None,
                 copies: Copies | None = None, account: DeviceMemoryAccount | None = None) -> None:
        self.config = config
        self.device = torch.device(device)
        chunk_bytes = chunk_bytes or DEFAULT_CHUNK_BYTES.get(self.device.type, 1 << 20)
        if chunk_bytes < _FP32_BYTES or chunk_bytes % _FP32_BYTES:
            raise ValueError(f"chunk_bytes must be a positive multiple of 4, got {chunk_bytes}")
        self.copies: Copies = copies or ("stream" if self.device.type == "cuda" else "inline")
        if (self.copies == "stream") != (self.device.type == "cuda"):
            raise ValueError(f"copies={self.copies!r} does not fit device {self.device}")
        self.account = account or DeviceMemoryAccount(self.device)
        self.steps = 0
        self._step_grad_scale = 1.0
        self._named = checked_parameters(named_parameters, self.device)
        self._flat_params = [param.detach().view(-1) for _, param in self._named]
        numels = [param.numel() for _, param in self._named]
        self._offsets = [0, *itertools.accumulate(numels)][:-1]
        self._total = sum(numels)
        self._chunk_numel = chunk_bytes // _FP32_BYTES
        self._chunks = plan_chunks(numels, self._chunk_numel)
        # Pinned so that host<->device copies are true DMA that can overlap compute.
        pin = self.device.type == "cuda"
        self._host = AdamWState(*(torch.zeros(self._total, dtype=torch.float32, pin_memory=pin)
                                  for _ in range(3)))
        with torch.no_grad():
            for offset, flat in zip(self._offsets, self._flat_params):
                self._host.master[offset:offset + flat.numel()].copy_(flat)
        self._stats: OffloadStats | None = None

    def state_of(self, name: str) -> AdamWState:
        """Views of the host state of parameter ``name``."""
        index = next(i for i, (n, _) in enumerate(self._named) if n == name)
        start, stop = self._offsets[index], self._offsets[index] + self._flat_params[index].numel()
        return AdamWState(*(tensor[start:stop] for tensor in self._host))

    def statistics(self) -> OffloadStats | None:
        return self._stats

    def step(self) -> None:
        grads = flat_gradients(self._named, step=self.steps + 1, account=self.account)
        self.steps += 1
        self._step_grad_scale = self._take_grad_scale()
        slot_numel = min(self._chunk_numel, self._total)
        slots = [AdamWState(*(self.account.allocate(f"step:slot{s}.{part}", slot_numel, torch.float32)
                              for part in AdamWState._fields)) for s in (0, 1)]
        grad32 = self.account.allocate("step:grad32", slot_numel, torch.float32)
        scratch = self.account.allocate("step:scratch", slot_numel, torch.float32)
        try:
            with torch.no_grad(), self._new_copier(slots) as copier:
                self._run_pipeline(copier, grads, slots, grad32, scratch)
            self._stats = OffloadStats(
                chunks=len(self._chunks), chunk_numel=self._chunk_numel,
                host_bytes=3 * self._total * _FP32_BYTES, device_buffer_bytes=8 * slot_numel * _FP32_BYTES,
                copies=self.copies, wait_seconds=copier.wait_seconds, copy_seconds=copier.copy_seconds)
        finally:
            self.account.release_prefix("step:")

    def _run_pipeline(self, copier: _ChunkCopier, grads: list[torch.Tensor], slots: list[AdamWState],
                      grad32: torch.Tensor, scratch: torch.Tensor) -> None:
        chunks = self._chunks
        if not chunks:
            return
        copier.store_then_load(None, chunks[0], 0)
        for i, chunk in enumerate(chunks):
            slot = i % 2
            copier.wait_loaded(slot)
            previous = chunks[i - 1] if i > 0 else None
            following = chunks[i + 1] if i + 1 < len(chunks) else None
            # The other slot: write chunk i-1 back, then fill it with chunk i+1, while i computes.
            copier.store_then_load(previous, following, 1 - slot)
            self._update_chunk(chunk, slots[slot], grads, grad32, scratch)
            copier.mark_computed(slot)
        last = len(chunks) - 1
        copier.store_then_load(chunks[last], None, last % 2)

    def _update_chunk(self, chunk: Chunk, slot: AdamWState, grads: list[torch.Tensor],
                      grad32: torch.Tensor, scratch: torch.Tensor) -> None:
        numel = chunk.numel
        for seg in chunk.segments:
            grad32[seg.chunk_start:seg.chunk_start + seg.length].copy_(
                grads[seg.param_index][seg.param_start:seg.param_start + seg.length])
        if self._step_grad_scale != 1.0:
            grad32[:numel].mul_(self._step_grad_scale)  # elementwise: the same bits as the plain optimizer's
        adamw_update_(slot.master[:numel], slot.exp_avg[:numel], slot.exp_avg_sq[:numel], grad32[:numel],
                      scratch[:numel], step=self.steps, config=self.config)
        for seg in chunk.segments:
            self._flat_params[seg.param_index][seg.param_start:seg.param_start + seg.length].copy_(
                slot.master[seg.chunk_start:seg.chunk_start + seg.length])  # fp32 -> bf16

    def _new_copier(self, slots: list[AdamWState]) -> _ChunkCopier:
        if self.copies == "stream":
            return StreamCopies(self._host, slots, self.device)
        return ThreadCopies(self._host, slots) if self.copies == "thread" else InlineCopies(self._host, slots)


class _ChunkCopier(Protocol):
    """Moves chunks between the host state and the two device slots. ``store_then_load`` writes
    ``stored`` back from ``slot`` (once its update is done), then loads ``loaded`` into it; it may
    return before either has happened. Leaving the context waits for every copy."""

    wait_seconds: float
    copy_seconds: float | None

    def store_then_load(self, stored: Chunk | None, loaded: Chunk | None, slot: int) -> None: ...

    def wait_loaded(self, slot: int) -> None: ...

    def mark_computed(self, slot: int) -> None: ...

    def __enter__(self) -> _ChunkCopier: ...

    def __exit__(self, *exc_info: object) -> None: ...


def _slices(host: AdamWState, slot: AdamWState, chunk: Chunk) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(host view, device view) of master, exp_avg and exp_avg_sq for ``chunk``."""
    return [(h[chunk.start:chunk.stop], d[:chunk.numel]) for h, d in zip(host, slot)]


class InlineCopies:
    """CPU, no overlap: each copy runs when asked, on the calling thread, with torch's copy."""

    def __init__(self, host: AdamWState, slots: list[AdamWState]) -> None:
        self._host, self._slots = host, slots
        self.wait_seconds = 0.0
        self.copy_seconds: float | None = 0.0

    def __enter__(self) -> InlineCopies:
        return self

    def __exit__(self, *exc_info: object) -> None:
        return None

    def store_then_load(self, stored: Chunk | None, loaded: Chunk | None, slot: int) -> None:
        start = time.perf_counter()
        if stored is not None:
            for host, device in _slices(self._host, self._slots[slot], stored):
                host.copy_(device)
        if loaded is not None:
            for host, device in _slices(self._host, self._slots[slot], loaded):
                device.copy_(host)
        self.copy_seconds += time.perf_counter() - start

    def wait_loaded(self, slot: int) -> None:
        return None

    def mark_computed(self, slot: int) -> None:
        return None


class ThreadCopies(InlineCopies):
    """CPU, overlapped: copies run on one worker thread owned by the step. They use memmove, not
    torch's copy, because memmove releases the GIL and stays on one core, whereas torch's copy
    from a second thread would start a second OpenMP team and oversubscribe the cores."""

    def __enter__(self) -> ThreadCopies:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="optimizer-offload-copy")
        self._pending: list[Future[float] | None] = [None, None]
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._pool.shutdown(wait=True)
        for slot in (0, 1):
            self.wait_loaded(slot)

    def store_then_load(self, stored: Chunk | None, loaded: Chunk | None, slot: int) -> None:
        # (source, destination) pairs: device to host for the store, then host to device.
        pairs = [] if stored is None else [(device, host) for host, device in
                                          _slices(self._host, self._slots[slot], stored)]
        pairs += [] if loaded is None else _slices(self._host, self._slots[slot], loaded)
        self._pending[slot] = self._pool.submit(_memmove_all, pairs)

    def wait_loaded(self, slot: int) -> None:
        pending, self._pending[slot] = self._pending[slot], None
        if pending is not None:
            start = time.perf_counter()
            self.copy_seconds += pending.result()  # re-raises a failed copy here
            self.wait_seconds += time.perf_counter() - start


def _memmove_all(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Copy each (source, destination) pair of contiguous fp32 tensors; the seconds it took."""
    start = time.perf_counter()
    for source, destination in pairs:
        ctypes.memmove(destination.data_ptr(), source.data_ptr(), source.numel() * _FP32_BYTES)
    return time.perf_counter() - start


class StreamCopies:
    """CUDA: copies queued on two side streams, device-to-host and host-to-device, so both
    directions of the link work at once; events order them against the compute stream and each
    other, and the host thread never waits until the step's end."""

    def __init__(self, host: AdamWState, slots: list[AdamWState], device: torch.device) -> None:
        self._host, self._slots = host, slots
        self._compute = torch.cuda.current_stream(device)
        self._to_host = torch.cuda.Stream(device=device)
        self._to_device = torch.cuda.Stream(device=device)
        self._computed = [torch.cuda.Event(), torch.cuda.Event()]  # the slot's update is done
        self._stored = [torch.cuda.Event(), torch.cuda.Event()]  # the slot's chunk is back home
        self._loaded = [torch.cuda.Event(), torch.cuda.Event()]  # the slot holds its next chunk
        self.wait_seconds = 0.0
        self.copy_seconds: float | None = None

    def __enter__(self) -> StreamCopies:
        # The slots come from the caching allocator on the compute stream: their memory may
        # still be read by compute work queued before the step, so the copies start after it.
        self._to_host.wait_stream(self._compute)
        self._to_device.wait_stream(self._compute)
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._compute.wait_stream(self._to_host)
        self._compute.wait_stream(self._to_device)
        # The host state is final when the step returns, and the slots may be freed.
        start = time.perf_counter()
        self._to_host.synchronize()
        self._to_device.synchronize()
        self.wait_seconds += time.perf_counter() - start

    def store_then_load(self, stored: Chunk | None, loaded: Chunk | None, slot: int) -> None:
        if stored is not None:
            with torch.cuda.stream(self._to_host):
                self._to_host.wait_event(self._computed[slot])
                for host, device in _slices(self._host, self._slots[slot], stored):
                    host.copy_(device, non_blocking=True)
                self._stored[slot].record(self._to_host)
        if loaded is not None:
            with torch.cuda.stream(self._to_device):
                # Waiting on an event never recorded (a slot's first load) is a no-op.
                self._to_device.wait_event(self._stored[slot])
                for host, device in _slices(self._host, self._slots[slot], loaded):
                    device.copy_(host, non_blocking=True)
                self._loaded[slot].record(self._to_device)

    def wait_loaded(self, slot: int) -> None:
        self._compute.wait_event(self._loaded[slot])

    def mark_computed(self, slot: int) -> None:
        self._computed[slot].record(self._compute)
