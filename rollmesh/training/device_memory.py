"""Device-memory accounting for the optimizer step: current and peak bytes resident on the device.

Knows torch tensors and storages; nothing of models, optimizers or the mesh. On CUDA the real
figure comes from the caching allocator (``torch.cuda.max_memory_allocated``); on a CPU-only
machine "device" and host are the same RAM, so the device side is whatever the caller declares
resident on it: every such tensor is allocated through, or held by, a ``DeviceMemoryAccount``.

What the account counts is what its owners register. The optimizers in ``optimizer_adamw`` and
``optimizer_offload`` register the parameters, their gradients, optimizer state kept on the
device and every work buffer of the step; activations are not counted (backward has freed them
before the step, and they would be the same in every variant); a test checks that a step writes
no tensor outside the account and the host state. Hand-rolled because torch keeps allocator
statistics for CUDA only; the profiler sees CPU allocations but is a tracing tool, not a counter.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import msgspec
import torch

T = TypeVar("T")


class DeviceMemoryStats(msgspec.Struct, frozen=True, kw_only=True):
    """``peak_bytes`` since the last reset; ``source`` says where the figure comes from."""

    current_bytes: int
    peak_bytes: int
    source: str  # "accounting" or "cuda.max_memory_allocated"


class DeviceMemoryAccount:
    """Named holdings of device tensors. Bytes are those of the underlying storages, each storage
    counted once however many holdings view it (a slice of a held buffer costs nothing more)."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self._holdings: dict[str, tuple[int, int]] = {}  # name -> (storage pointer, storage bytes)
        self._storage_refs: dict[int, int] = {}
        self._current = 0
        self._peak = 0

    def hold(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Count ``tensor`` as resident until ``release(name)``; holding a name again replaces it."""
        if name in self._holdings:
            self.release(name)
        storage = tensor.untyped_storage()
        pointer, nbytes = storage.data_ptr(), storage.nbytes()
        self._holdings[name] = (pointer, nbytes)
        refs = self._storage_refs.get(pointer, 0)
        self._storage_refs[pointer] = refs + 1
        if refs == 0:
            self._current += nbytes
            self._peak = max(self._peak, self._current)
        return tensor

    def allocate(self, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A new uninitialised 1-D tensor on the device, held under ``name``."""
        return self.hold(name, torch.empty(numel, dtype=dtype, device=self.device))

    def release(self, name: str) -> None:
        pointer, nbytes = self._holdings.pop(name)
        refs = self._storage_refs[pointer] - 1
        if refs:
            self._storage_refs[pointer] = refs
        else:
            del self._storage_refs[pointer]
            self._current -= nbytes

    def release_prefix(self, prefix: str) -> None:
        for name in [n for n in self._holdings if n.startswith(prefix)]:
            self.release(name)

    def storage_pointers(self) -> set[int]:
        """Data pointers of every held storage (tests check that a step allocates nothing else)."""
        return set(self._storage_refs)

    @property
    def current_bytes(self) -> int:
        return self._current

    @property
    def peak_bytes(self) -> int:
        return self._peak

    def reset_peak(self) -> None:
        self._peak = self._current


def measure_peak(account: DeviceMemoryAccount, step: Callable[[], T]) -> tuple[T, DeviceMemoryStats]:
    """Run ``step`` and return its value with the peak device memory reached during it.

    CUDA: the allocator's own peak (everything allocated on the device, ours or not), which the
    accounting should match up to the allocator's rounding. Elsewhere: the account's peak."""
    account.reset_peak()
    if account.device.type == "cuda":
        torch.cuda.synchronize(account.device)
        torch.cuda.reset_peak_memory_stats(account.device)
        value = step()
        torch.cuda.synchronize(account.device)
        stats = DeviceMemoryStats(current_bytes=torch.cuda.memory_allocated(account.device),
                                  peak_bytes=torch.cuda.max_memory_allocated(account.device),
                                  source="cuda.max_memory_allocated")
        return value, stats
    value = step()
    return value, DeviceMemoryStats(current_bytes=account.current_bytes, peak_bytes=account.peak_bytes,
                                    source="accounting")
