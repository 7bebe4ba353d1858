"""Memory an engine or a trainer can lend: a module's weights moved to host memory and back.

Knows torch and the engine's errors; not the scheduler that decides when (``scheduling.lending_service`` calls the
role through its ``RoleMemory`` port). Used by the decode and prefill engines (their weights; the
KV pool moves itself, ``kv_pages.KvBlockPool.offload_to_host``) and by the torch trainer (weights
and optimizer state between steps).

Moves swap storage (``tensor.data = copy``) so the parameter objects, their ties and whatever
holds them (the optimizer, the weight stager) stay the same. On CUDA the host copies are pinned
(the copy back runs at full PCIe speed) and the caching allocator's free blocks are returned to
the driver (``torch.cuda.empty_cache``), so another process really gets the memory. On CPU the
weights already live in host memory: the move is a no-op that still runs (and is timed), so the
protocol is the same on every device.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from rollmesh.engine.errors import EngineBusyError, StaleWeightsError, WeightsMismatchError

HOST = torch.device("cpu")


@dataclass(frozen=True)
class MemoryMoveStats:
    """One release or resume: how long it took and how many bytes changed place."""

    seconds: float
    bytes_moved: int


def module_tensors(module: nn.Module) -> Iterator[torch.Tensor]:
    """Every parameter and buffer of ``module`` once (tied weights are one tensor)."""
    seen: set[int] = set()
    for tensor in (*module.parameters(), *module.buffers()):
        if id(tensor) not in seen:
            seen.add(id(tensor))
            yield tensor


def move_tensors(tensors: Iterable[torch.Tensor], device: torch.device) -> int:
    """Swap each tensor's storage for a copy on ``device`` (pinned when that is the host and the
    tensor is on an accelerator); returns the bytes copied (0 for tensors already there)."""
    moved = 0
    for tensor in tensors:
        if tensor.device == device:
            continue
        moved += tensor.numel() * tensor.element_size()
        tensor.data = to_device(tensor.data, device)
    return moved


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device == HOST and tensor.device.type == "cuda":
        host = torch.empty(tensor.shape, dtype=tensor.dtype, device=HOST, pin_memory=True)
        return host.copy_(tensor, non_blocking=True)
    return tensor.to(device, non_blocking=True)


def settle(*devices: torch.device) -> None:
    """Wait for non-blocking copies involving ``devices``, then hand freed cached blocks back to
    the driver: released memory is usable by other processes only after that."""
    if any(device.type == "cuda" for device in devices):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


class ReleasableWeights:
    """One engine's model and KV pool, resident on their device or released to the host.

    ``stage`` is the engine's weight staging (any thread): while released, a new version waits on
    the host (copied: the caller may keep training its tensors) until the owner stages it after
    ``resume`` (``take_deferred``), so a weight update never puts tensors on an accelerator another process borrows.
    ``release`` and ``resume`` run on the thread that runs the model, between forward passes."""

    def __init__(self, model: nn.Module, stager, pool) -> None:
        self.model = model
        self.stager = stager
        self.pool = pool
        self._lock = threading.Lock()
        self._device: torch.device | None = None  # where the memory goes back to; None: resident
        self._deferred: tuple[dict[str, torch.Tensor], int] | None = None

    @property
    def released(self) -> bool:
        return self._device is not None

    def release(self, *, apply_staged: bool = False) -> MemoryMoveStats:
        """``apply_staged``: activate staged weights first (an engine whose caller sees activations
        at its next call); otherwise staged weights make it ``EngineBusyError`` (the decode loop
        reports an activation only from a step, so it lets one run first)."""
        started = time.perf_counter()
        with self._lock:
            if self._device is not None:
                return MemoryMoveStats(0.0, 0)
            if apply_staged:
                self.stager.apply_staged()
            if self.stager.staged_version is not None:
                raise EngineBusyError(0, f"weights version {self.stager.staged_version} staged, not yet active")
            device = self.pool.kv.device
            moved = self.pool.offload_to_host() + move_tensors(module_tensors(self.model), HOST)
            settle(device)
            self._device = device
        return MemoryMoveStats(time.perf_counter() - started, moved)

    def resume(self) -> MemoryMoveStats:
        started = time.perf_counter()
        with self._lock:
            device = self._device
            if device is None:
                return MemoryMoveStats(0.0, 0)
            moved = move_tensors(module_tensors(self.model), device) + self.pool.restore()
            settle(device)
            self._device = None
        return MemoryMoveStats(time.perf_counter() - started, moved)

    def take_deferred(self) -> tuple[dict[str, torch.Tensor], int] | None:
        """The newest weights staged while released, for the owner to stage after ``resume``
        through its own path (the decode loop's wakes the loop, so the version activates)."""
        with self._lock:
            deferred, self._deferred = self._deferred, None
        return deferred

    def stage(self, state_dict: Mapping[str, torch.Tensor], version: int) -> bool:
        """``WeightStager.stage``, or, while released, kept on the host until ``resume``."""
        with self._lock:
            if self._device is None:
                return self.stager.stage(state_dict, version)
            current = self.stager.current_version
            if version < current:
                raise StaleWeightsError(version, current)
            if version == current or (self._deferred is not None and version <= self._deferred[1]):
                return False
            # The stager's own checks, now rather than at resume: the caller learns of a bad update.
            shapes = {name: tuple(tensor.shape) for name, tensor in self.model.state_dict().items()}
            given = {name: tuple(tensor.shape) for name, tensor in state_dict.items()}
            if shapes != given:
                wrong = sorted(name for name in shapes.keys() | given.keys() if shapes.get(name) != given.get(name))
                raise WeightsMismatchError(f"names or shapes differ: {wrong[:5]}", version=version)
            self._deferred = ({name: tensor.detach().to(HOST, copy=True) for name, tensor in state_dict.items()},
                              version)
            return True


class StorageSwap:
    """Tensors whose device storage is emptied in place and refilled (the FSDP way): every view
    and every holder of them (an optimizer's flat views, its state dicts) stays valid, where
    swapping ``.data`` would leave them on the old storage. What the trainer uses between steps.

    Tensors already in host memory are skipped (``include_host`` moves them too, so CPU tests
    exercise the same path): on a CPU trainer, offload and reload run and move nothing."""

    def __init__(self, *, include_host: bool = False) -> None:
        self.include_host = include_host
        self._kept: list[tuple[torch.UntypedStorage, torch.Tensor]] = []
        self._offloaded = False  # also when nothing had to move (a CPU trainer)

    @property
    def offloaded(self) -> bool:
        return self._offloaded

    def offload(self, tensors: Iterable[torch.Tensor]) -> MemoryMoveStats:
        started = time.perf_counter()
        if self._offloaded:
            return MemoryMoveStats(0.0, 0)
        self._offloaded = True
        seen: set[int] = set()
        devices: set[torch.device] = set()
        for tensor in tensors:
            storage = tensor.untyped_storage()
            # Host tensors mapped from a file (safetensors) cannot be resized: they stay. Device
            # tensors always can.
            if (tensor.device == HOST and not self.include_host) or storage.nbytes() == 0 \
                    or storage.data_ptr() in seen or not storage.resizable():
                continue
            seen.add(storage.data_ptr())
            devices.add(tensor.device)
            host = torch.empty(storage.nbytes(), dtype=torch.uint8, device=HOST,
                               pin_memory=tensor.device.type == "cuda")
            host.untyped_storage().copy_(storage, non_blocking=True)
            self._kept.append((storage, host))
        settle(*devices)  # the copies are done before the storage goes
        for storage, _ in self._kept:
            storage.resize_(0)
        settle(*devices)
        return MemoryMoveStats(time.perf_counter() - started, sum(host.numel() for _, host in self._kept))

    def reload(self) -> MemoryMoveStats:
        started = time.perf_counter()
        kept, self._kept = self._kept, []
        self._offloaded = False
        for storage, host in kept:
            storage.resize_(host.numel())
            storage.copy_(host.untyped_storage(), non_blocking=True)
        settle(*{storage.device for storage, _ in kept})
        return MemoryMoveStats(time.perf_counter() - started, sum(host.numel() for _, host in kept))
