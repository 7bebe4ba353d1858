"""Staged weights for one model, swapped in at a call or step boundary, never mid-computation.

Knows torch only. ``stage`` may be called from any thread at any time: it checks the state dict
against the model and copies it (so a trainer in the same process can keep training the tensors it
handed over). ``apply_staged`` must be called by the thread that runs the model, between forward
passes. It swaps the staged tensors in as the parameters' storage (``param.data = staged``)
rather than copying into them: the parameter objects stay the same (tied weights stay tied, KV
caches are untouched) and the generation pause is a few pointer assignments, however large the
model; the copy was already paid by ``stage``, off the decode loop.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import nn

from rollmesh.engine.errors import StaleWeightsError, WeightsMismatchError

COPY_THREADS = 4


class WeightStager:
    """The newest staged state dict of ``model`` and the version active in it."""

    def __init__(self, model: nn.Module, *, version: int = 0) -> None:
        self.model = model
        self._expected = {
            name: (tensor.shape, tensor.dtype, tensor.device)
            for name, tensor in model.state_dict().items()
        }
        self._lock = threading.Lock()
        self._staged: tuple[int, dict[str, torch.Tensor]] | None = None
        self._activated: int | None = None
        self.current_version = version
        # How long the last activation held the model (the generation pause of an update).
        self.last_swap_seconds = 0.0

    @property
    def staged_version(self) -> int | None:
        staged = self._staged
        return None if staged is None else staged[0]

    def stage(self, state_dict: Mapping[str, torch.Tensor], version: int) -> bool:
        """Keep ``state_dict`` for the next boundary; False if ``version`` is already active or
        superseded by a newer staged one (a redelivered event is harmless). Raises
        ``StaleWeightsError`` for a version older than the active one and
        ``WeightsMismatchError`` for a state dict that does not fit the model."""
        if version < self.current_version:
            raise StaleWeightsError(version, self.current_version)
        copied = self._checked_copy(state_dict, version)
        with self._lock:
            staged = self.staged_version
            if version <= self.current_version or (staged is not None and version <= staged):
                return False
            self._staged = (version, copied)
        return True

    def apply_staged(self) -> int | None:
        """Load the staged weights into the model in place; the activated version, or None."""
        with self._lock:
            staged, self._staged = self._staged, None
        if staged is None:
            return None
        version, state_dict = staged
        started = time.perf_counter()
        with torch.no_grad():
            for name, tensor in state_dict.items():
                self._live_tensor(name).data = tensor
        self.last_swap_seconds = time.perf_counter() - started
        self.current_version = version
        self._activated = version
        return version

    def _live_tensor(self, name: str) -> torch.Tensor:
        module_name, _, attribute = name.rpartition(".")
        module = self.model.get_submodule(module_name) if module_name else self.model
        return getattr(module, attribute)

    def pop_activation(self) -> int | None:
        """The newest version activated since the last call, or None."""
        activated, self._activated = self._activated, None
        return activated

    def _checked_copy(
        self, state_dict: Mapping[str, torch.Tensor], version: int
    ) -> dict[str, torch.Tensor]:
        missing = self._expected.keys() - state_dict.keys()
        unexpected = state_dict.keys() - self._expected.keys()
        if missing or unexpected:
            raise WeightsMismatchError(
                f"missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}",
                version=version,
            )
        for name, (shape, _, _) in self._expected.items():
            tensor = state_dict[name]
            if tuple(tensor.shape) != tuple(shape):
                raise WeightsMismatchError(
                    f"{name} has shape {tuple(tensor.shape)}, the model {tuple(shape)}",
                    version=version,
                )

        def copy(item: tuple[str, tuple]) -> torch.Tensor:
            name, (_, dtype, device) = item
            return state_dict[name].detach().to(device=device, dtype=dtype, copy=True)

        # A few threads: torch copies without the GIL, and on a busy machine more threads get
        # more of it (the copy is the larger part of staging).
        items = list(self._expected.items())
        with ThreadPoolExecutor(COPY_THREADS, thread_name_prefix="weights-stage") as pool:
            return dict(zip(self._expected, pool.map(copy, items)))
