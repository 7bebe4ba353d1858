"""Lending a role's own accelerator, live: the worker side and the scheduler side.

Worker side (no ray import): ``MemoryGate`` lets a decode worker refuse new requests with the
retryable ``MemoryReleasedError`` from the start of a release, wait for the accepted ones to
finish, and only then move its memory (``LocalEngine`` does the same around its own loop);
``lent_memory`` is what a worker's ``release_memory`` answers: the move's figures and the CUDA
devices this process sees, which a job borrowing the accelerator is given.
Scheduler side: ``ActorRoleMemory`` is the ``RoleMemory`` port of ``LendingService`` over the
role workers' Ray actors, found by name; a device is named by the worker holding it (one worker
per accelerator: ``role_lending_refusals`` names the layouts the scheduler actor refuses at start).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from rollmesh.config import InferenceConfig
from rollmesh.engine.errors import MemoryReleasedError

if TYPE_CHECKING:  # an annotation only: memory_release imports torch, which the GPU scheduler never needs
    from rollmesh.engine.memory_release import MemoryMoveStats


def lent_memory(stats: MemoryMoveStats) -> dict[str, Any]:
    """A worker's answer to ``release_memory`` / ``resume_memory``: ``cuda_visible_devices`` is
    what Ray gave this process ("" with a declared custom resource: no real device)."""
    return {"seconds": stats.seconds, "bytes_moved": stats.bytes_moved,
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES", "")}


class MemoryGate:
    """Requests in flight on one worker, and whether its memory is (being) lent."""

    def __init__(self) -> None:
        self.releasing = False  # from the start of a release until the resume
        self._in_flight = 0
        self._idle: asyncio.Event | None = None  # made on first use: it binds to its loop

    @contextmanager
    def accept(self, request_id: str) -> Iterator[None]:
        if self.releasing:
            raise MemoryReleasedError(request_id=request_id)
        self._in_flight += 1
        if self._idle is not None:
            self._idle.clear()
        try:
            yield
        finally:
            self._in_flight -= 1
            if self._in_flight == 0 and self._idle is not None:
                self._idle.set()

    async def wait_idle(self) -> None:
        if self._in_flight == 0:
            return
        if self._idle is None:
            self._idle = asyncio.Event()
        await self._idle.wait()


class ActorRoleMemory:
    """``RoleMemory`` over Ray actors: ``workers`` names each role's worker actors (looked up in
    ``namespace`` when first needed: the scheduler starts before them). ``visible_devices`` maps
    a lent device (its worker's name) to the CUDA devices that worker saw, for the job launcher."""

    def __init__(self, workers: dict[str, list[str]], *, namespace: str | None = None) -> None:
        self.workers = workers
        self.namespace = namespace
        self.released: set[str] = set()
        self.visible_devices: dict[str, str] = {}

    def _actor(self, name: str) -> Any:
        import ray

        return ray.get_actor(name, namespace=self.namespace)

    async def release(self, role: str, count: int) -> list[str]:
        # The last workers first: the router's least-loaded choice favours the first ones.
        idle = [name for name in reversed(self.workers.get(role, [])) if name not in self.released][:count]
        answers = await asyncio.gather(*(self._actor(name).release_memory.remote() for name in idle))
        for name, answer in zip(idle, answers):
            self.released.add(name)
            self.visible_devices[name] = answer["cuda_visible_devices"]
        return idle

    async def resume(self, role: str, devices: list[str]) -> None:
        await asyncio.gather(*(self._actor(name).resume_memory.remote() for name in devices))
        self.released.difference_update(devices)


LENDING_ROLES = ("prefill", "decode", "trainer")  # whose worker actors release and resume memory


def role_workers_of(inference: InferenceConfig | None) -> dict[str, list[str]]:
    """The role worker actors' names, as the launcher spawns them."""
    if inference is None:
        return {"trainer": ["trainer"]}
    return {"prefill": [f"prefill-{i}" for i in range(inference.prefill_worker_count)],
            "decode": [f"decode-{i}" for i in range(inference.decode_worker_count)], "trainer": ["trainer"]}


def role_lending_refusals(start_grants: dict[str, int], workers: dict[str, list[str]], *,
                          inference_backend: str, trainer_backend: str | None) -> list[str]:
    """Why this mesh cannot lend its roles' own accelerators ([]: it can). Only roles holding
    accelerators from the start are lent, each worker on an accelerator of its own."""
    refusals = []
    for role, count in sorted(start_grants.items()):
        if count <= 0:
            continue
        if role not in LENDING_ROLES:
            refusals.append(f"role {role!r} holds {count} accelerator(s) but its actor cannot release its memory "
                            f"(only {', '.join(LENDING_ROLES)} workers can)")
        elif role == "decode" and inference_backend == "sglang":
            refusals.append("the SGLang decode workers do not expose release_memory / resume_memory yet "
                            "(SGLangClient.release_memory_occupation exists; the worker actor does not call it)")
        elif role == "trainer" and trainer_backend != "torch":
            refusals.append(f"the trainer's {trainer_backend or 'unknown'} backend cannot offload its memory "
                            "(only trainer.backend = \"torch\" can)")
        elif role == "trainer":
            # TrainerActor.release_memory works; what would fail is a step falling due meanwhile.
            refusals.append("the trainer does not yet hold its steps while offloaded: a step due then fails with "
                            "TrainerOffloadedError and its trajectories are redelivered, then dead-lettered "
                            "(grant the trainer no accelerators of its own to lend the others')")
        elif len(workers.get(role, [])) != count:
            refusals.append(f"role {role!r} has {len(workers.get(role, []))} worker(s) on {count} accelerator(s); "
                            "lending needs one worker per accelerator")
    return refusals
