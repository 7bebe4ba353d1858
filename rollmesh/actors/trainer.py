"""The trainer actor: GRPO on admitted trajectories, weight versions out, checkpoints on demand.

Knows the training package and the shell; no ray import (the object store's weight holder,
``weight_object_store``, and the SGLang servers' lookup, ``sglang_weight_receivers``, are the
pieces that know Ray).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import structlog

from rollmesh.actors.role_base import RoleActor
from rollmesh.actors.role_memory import lent_memory
from rollmesh.actors.sglang_weight_receivers import find_weight_receivers
from rollmesh.actors.weight_object_store import ObjectStoreWeightHolder
from rollmesh.mesh_address import MeshAddress
from rollmesh.ports import ActorLogic, Publisher
from rollmesh.config import ModelConfig, TrainerConfig
from rollmesh.engine.weight_memory import resolve_weight_sync
from rollmesh.run_config import StageConfig
from rollmesh.rollout.tasks import DemonstrableTask, load_task
from rollmesh.scheduling.errors import RoleLendingUnavailableError
from rollmesh.training.trainer_logic import TrainerLogic

# The backend and the SGLang push (torch) are imported where they are built: the launcher imports
# this module for the actor class, and must not pay seconds of torch import for it.
if TYPE_CHECKING:
    from rollmesh.engine.sglang_weight_sync import SGLangWeightPush
    from rollmesh.training.torch_backend import TorchTrainerBackend, TrainerBackend

_log = structlog.get_logger("rollmesh.actors.trainer")


class TrainerActor(RoleActor):
    role = "trainer"
    logic_class = TrainerLogic
    holds_accelerators = True

    def __init__(self, name: str, mesh: MeshAddress, config: TrainerConfig, model_config: ModelConfig,
                 sglang_workers: Sequence[str] = ()) -> None:
        super().__init__(name, mesh, torch_threads=config.torch_threads)
        self.config = config
        # The SGLang decode workers' actor names (inference.backend = "sglang"): whose servers
        # trainer.weight_sync = "nccl"/"ipc" pushes versions into.
        self.sglang_workers = list(sglang_workers)
        self.push: SGLangWeightPush | None = None
        self.model_config = model_config
        self.trainer: TrainerLogic | None = None
        self.backend: TrainerBackend | None = None
        self.weight_holder: ObjectStoreWeightHolder | None = None

    async def build_logic(self, publisher: Publisher) -> ActorLogic:
        from rollmesh.training.torch_backend import build_trainer_backend

        # The megatron backend starts its rank processes here: seconds, off the event loop.
        log_dir = Path(self.mesh.run_dir) / "logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        self.backend = backend = await asyncio.to_thread(build_trainer_backend, self.model_config, self.config,
                                                         log_dir=log_dir)
        import torch  # the device decides "auto"

        # Workers on this node read a version from this actor's shared memory (weight_bucket_refs).
        sync = resolve_weight_sync(self.config.weight_sync, cuda=torch.cuda.is_available(),
                                   sglang=bool(self.sglang_workers))
        if sync == "memory":
            self.weight_holder = ObjectStoreWeightHolder(self.name)
        elif sync in ("nccl", "ipc"):
            self.push = await self._weight_push(sync)
        return self._build_trainer(backend, publisher)

    async def _weight_push(self, sync: str) -> SGLangWeightPush | None:
        """The push into the SGLang workers' servers; None (files only, logged) when there are none
        or they cannot be asked: the files are the fallback, as for a failed push."""
        if not self.sglang_workers:  # the local engine's workers read files
            _log.warning("weight_sync_needs_sglang", weight_sync=sync, publishing="files")
            return None
        try:
            receivers = await find_weight_receivers(self.sglang_workers)
        except Exception as exc:
            _log.warning("weight_sync_receivers_unavailable", weight_sync=sync, error=repr(exc), publishing="files")
            return None
        _log.info("weight_sync_push", method=sync, servers=receivers.urls)
        from rollmesh.engine.sglang_weight_sync import SGLangWeightPush

        return SGLangWeightPush(receivers.urls, method=sync, gpus_per_server=receivers.gpus_per_server,
                                master_address=receivers.master_address, bucket_bytes=self.config.weight_bucket_bytes,
                                pause_mode=receivers.pause_mode)

    def _build_trainer(self, backend: TrainerBackend, publisher: Publisher) -> TrainerLogic:
        stores = self.shell.stores
        self.trainer = TrainerLogic(self.config, self.model_config, backend, publisher,
                                    run_dir=Path(self.mesh.run_dir),
                                    busy=self.busy,
                                    # Only MoE rollouts carry a reference into it.
                                    routed_experts=stores.routed_experts(),
                                    # Only long rollouts carry a reference into it (the
                                    # rollout workers create it, with its TTL).
                                    trajectories=stores.trajectories(),
                                    memory=self.weight_holder, latest_weights=stores.latest_weights, push=self.push)
        return self.trainer

    async def stop(self) -> None:
        await super().stop()
        if self.push is not None:
            await self.push.aclose()
        if self.backend is not None:
            await asyncio.to_thread(self.backend.close)

    async def release_memory(self) -> dict[str, Any]:
        """Lend the accelerator between steps (``scheduler.lend_role_accelerators``): the torch
        backend's weights and optimizer state to host memory; steps refuse with
        TrainerOffloadedError until ``resume_memory``. The megatron backend cannot offload
        (RoleLendingUnavailableError; the scheduler refuses lending its trainer at start)."""
        return lent_memory(await asyncio.to_thread(self._lending_backend().offload))

    async def resume_memory(self) -> dict[str, Any]:
        return lent_memory(await asyncio.to_thread(self._lending_backend().reload))

    def _lending_backend(self) -> TorchTrainerBackend:
        from rollmesh.training.torch_backend import TorchTrainerBackend

        if not isinstance(self.backend, TorchTrainerBackend):
            raise RoleLendingUnavailableError([f"the trainer's {self.config.backend} backend cannot offload its "
                                               "memory (only trainer.backend = \"torch\" can)"])
        return self.backend

    async def warm_start(self, task_path: str, *, steps: int, batch_size: int, lr: float,
                         exact_fraction: float, seed: int) -> dict[str, float]:
        task = load_task(task_path)
        if not isinstance(task, DemonstrableTask):
            raise TypeError(f"{task_path} cannot demonstrate episodes; no warm start possible")
        assert self.trainer is not None, "start() first"
        return await self.trainer.warm_start(task, steps=steps, batch_size=batch_size, lr=lr,
                                             exact_fraction=exact_fraction, seed=seed)

    async def save_checkpoint(self) -> str:
        assert self.trainer is not None, "start() first"
        return (await self.trainer.save_checkpoint()).path

    async def weight_bucket_refs(self, version: int) -> list | None:
        """The object refs of ``version``'s manifest and buckets in this node's shared memory (None:
        not held), for an inference worker on this node (``ObjectStoreWeightFetcher``)."""
        return None if self.weight_holder is None else self.weight_holder.refs(version)

    async def version(self) -> int:
        return self.trainer.version if self.trainer else 0

    async def supervised_step(self, stage: dict[str, Any], name: str, *, position: int, tokens_before: int,
                              end_position: int | None = None) -> dict[str, Any]:
        """One step of supervised stage ``name`` (``stage``: its StageConfig as built-ins)."""
        assert self.trainer is not None, "start() first"
        return await self.trainer.supervised_step(msgspec.convert(stage, StageConfig), name, position=position,
                                                  tokens_before=tokens_before, end_position=end_position)

    async def stage_cursor(self, name: str) -> dict[str, Any]:
        """Supervised stage ``name``'s place as its last durable step recorded it ({}: none)."""
        assert self.trainer is not None, "start() first"
        return await asyncio.to_thread(self.trainer.ledger.stage_cursor, name)

    async def reset_optimizers(self) -> None:
        assert self.trainer is not None, "start() first"
        await self.trainer.reset_optimizers()

    async def settings(self) -> dict[str, Any]:
        """The trainer config it runs with (a training job checks its stage against it)."""
        return msgspec.to_builtins(self.config)

    async def step(self) -> int:
        """The last durable step (what a training job's stage counts its steps from)."""
        assert self.trainer is not None, "start() first"
        return self.trainer.step

    async def consumed_groups(self, group_ids: list[str]) -> list[str]:
        """Which of ``group_ids`` a durable step consumed, from the ledger: what a resumed
        training job's feeder no longer waits for."""
        assert self.trainer is not None, "start() first"
        state = await asyncio.to_thread(self.trainer.ledger.read)
        return [group_id for group_id in group_ids if state is not None and group_id in state.groups]
