"""Starts the mesh in order and stops it in reverse.

Knows the role actor classes and the order they come up in; the bus, Ray and Serve mechanics are
``MeshRuntime``'s. The story: make the run directory, start or join the bus, start the metrics hub, start or join Ray,
spawn the GPU scheduler (which grants accelerators first), sandbox brokers, prefill and decode
workers (with ``inference.backend = "sglang"``: SGLang workers as the decode workers), trainer, resharder and rollout workers, deploy the Serve app (with the live
dashboard), write ``mesh.json``. ``stop`` undoes it backwards.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import msgspec
import ray
import structlog

from rollmesh.actors.gpu_scheduler import GpuSchedulerActor
from rollmesh.actors.inference_workers import DecodeWorkerActor, PrefillWorkerActor
from rollmesh.actors.resharder import ResharderActor
from rollmesh.actors.rollout_worker import RolloutWorkerActor
from rollmesh.actors.sglang_worker import SGLangWorkerActor
from rollmesh.actors.trainer import TrainerActor
from rollmesh.config import RollmeshConfig, TrainerConfig, save_run_config
from rollmesh.mesh_address import MeshAddress, new_run_dir, write_mesh_address
from rollmesh.mesh_runtime import ACTOR_STOP_TIMEOUT_S, MeshRuntime
from rollmesh.model_source import resolve_model
from rollmesh.sandbox_brokers import spawn_sandbox_brokers
from rollmesh.scheduling.grants import GpuScheduler
from rollmesh.telemetry.tracing import effective_telemetry

_log = structlog.get_logger("rollmesh.launcher")

# The actor that holds each role's accelerator grant (the first worker of a role, for now).
GRANT_HOLDERS = {"prefill": "prefill-0", "decode": "decode-0", "trainer": "trainer"}


class Mesh:
    def __init__(self, config: RollmeshConfig, *, run_dir: Path | None = None) -> None:
        # The exporters the OTEL_* variables put in effect become the run's config (and so its
        # config.json): a resume without them keeps exporting where this run did.
        config = msgspec.structs.replace(config, telemetry=effective_telemetry(config.telemetry))
        self.run_dir = Path(run_dir) if run_dir else new_run_dir(config.run_root)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        # Every actor gets an absolute model.path; an empty one becomes the demo model, built here.
        self.config = config = resolve_model(config, self.run_dir)
        self.ray_namespace = f"rollmesh-{config.namespace}"
        self.runtime = MeshRuntime(config, run_dir=self.run_dir, ray_namespace=self.ray_namespace)
        self.prefill_workers: list[Any] = []
        self.decode_workers: list[Any] = []
        self.trainer: Any = None
        # Where the mesh is and how to get in (every role's credentials), once it is up.
        self.address: MeshAddress | None = None

    @property
    def actors(self) -> dict[str, Any]:
        return self.runtime.actors

    async def start(self) -> MeshAddress:
        try:
            return await self._start()
        except BaseException:
            # Half a mesh must not outlive a failed start: stop what did come up, in reverse.
            await self.stop()
            raise

    async def _start(self) -> MeshAddress:
        config, runtime, spawn = self.config, self.runtime, self.runtime.spawn
        save_run_config(self.run_dir, config)  # what `rollmesh up --resume` starts again
        # Checked before anything starts: an API reachable beyond loopback needs a key.
        api_key = self._api_key() if config.serve.enabled else ""
        # Handed to every actor with only its roles' credentials; what is known only once the mesh
        # is up (its Serve URL, Ray address, ...) is added before mesh.json is written.
        mesh = runtime.start_bus()
        await runtime.prepare_streams(mesh)  # security.enabled: as "mesh", before any role
        # Before the actors, so the hub hears every snapshot they send (docs/metrics.md).
        metrics_url = await runtime.start_metrics(mesh)
        # Declared accelerators as a custom resource, so grants schedule with zero real GPUs
        # (joining a cluster, its nodes must declare them instead).
        runtime.start_ray(resources=GpuScheduler(config.scheduler, clock=time.time,
                                                 new_id=lambda: "").ray_resources())
        # The model and inference settings are what a decode worker lent idle accelerators serves
        # (so the scheduler also holds the inference role's credentials, to hand them on).
        scheduler = await spawn("gpu-scheduler", GpuSchedulerActor, mesh.only("scheduler", "inference"),
                                config.scheduler, config.model, config.inference, config.trainer,
                                options=self._placed("scheduler"))
        # Grants first: each role's actor is then placed with the Ray resources it was granted.
        await scheduler.grant.remote(GRANT_HOLDERS)
        # sandbox.brokers: one broker, one on every sandbox node, or a number of them.
        await spawn_sandbox_brokers(spawn, mesh, config.sandbox, config.ray.role_resources.get("sandbox", {}),
                                    self._placed("sandbox"))
        inference = config.inference
        # Every other actor is created before the first of them starts, so that their processes
        # start, import torch and build their models side by side (a process's start is most of
        # an actor's spawn time: ~45 s of a mesh's start, one after another, on a 2-core
        # machine); they are still started one by one, in this order.
        create = runtime.create
        for index in range(inference.prefill_worker_count):
            self.prefill_workers.append(create(
                f"prefill-{index}", PrefillWorkerActor, mesh.only("inference"), config.model, inference,
                options=self._placed("prefill", await scheduler.actor_options.remote("prefill"))))
        # inference.backend = "sglang": each decode worker launches (or attaches to) SGLang servers.
        decode_class = SGLangWorkerActor if inference.backend == "sglang" else DecodeWorkerActor
        for index in range(inference.decode_worker_count):
            self.decode_workers.append(create(
                f"decode-{index}", decode_class, mesh.only("inference"), config.model, inference, index,
                options=self._placed("decode", await scheduler.actor_options.remote("decode"))))
        self.trainer = create("trainer", TrainerActor, mesh.only("trainer"), config.trainer, config.model,
                              self._sglang_workers(),
                              options=self._placed("trainer", await scheduler.actor_options.remote("trainer")))
        resharder = create("resharder", ResharderActor, mesh.only("resharder"), config.resharder,
                           options=self._placed("resharder"))
        rollout_workers = [create(f"rollout-worker-{index}", RolloutWorkerActor, mesh.only("rollout_worker"),
                                  config.rollout, config.model, self.prefill_workers, self.decode_workers,
                                  config.sandbox, options=self._placed("rollout"))
                           for index in range(config.rollout.num_workers)]
        for actor in [*self.prefill_workers, *self.decode_workers, self.trainer, resharder, *rollout_workers]:
            await actor.start.remote()
        if config.serve.enabled:
            runtime.deploy_serve(
                prefill_names=[f"prefill-{i}" for i in range(inference.prefill_worker_count)],
                decode_names=[f"decode-{i}" for i in range(inference.decode_worker_count)],
                host=config.serve.host, port=config.serve.port, api_key=api_key,
                follow=mesh)
        self.address = replace(
            mesh, serve_url=runtime.serve_url, ray_address=config.ray.address or runtime.ray_address,
            pid=os.getpid(), started_at=time.time(), dashboard_url=runtime.dashboard_url,
            metrics_url=metrics_url, ray_auth_token_file=str(runtime.ray_auth_token_file or ""),
        )
        write_mesh_address(self.address)  # its credentials are not written
        runtime.supervisor.start()
        _log.info("mesh_ready", run_dir=str(self.run_dir), nats_url=mesh.nats_url, serve_url=runtime.serve_url)
        return self.address

    async def restart_trainer(self, trainer_config: TrainerConfig) -> Any:
        """The trainer actor again, with ``trainer_config`` (a training job's next stage): the
        old one stopped and killed for good, a new one spawned under the same name. It resumes
        from the ledger's last durable step (the previous stage's weights) with fresh optimizers:
        a new stage's settings (its lr among them) start a new optimizer."""
        if self.address is None:
            raise RuntimeError("restart_trainer needs a started mesh")
        # The supervisor pauses meanwhile: it would take the new actor, not yet started, for a
        # crashed one and start it a second time.
        await self.runtime.supervisor.stop()
        old = self.runtime.actors.pop("trainer")
        try:
            await asyncio.wait_for(old.stop.remote(), timeout=ACTOR_STOP_TIMEOUT_S)
        except Exception as exc:  # a dying actor is killed all the same
            _log.warning("actor_stop_failed", actor="trainer", error=repr(exc))
        ray.kill(old, no_restart=True)
        await _name_released("trainer", self.ray_namespace)
        self.config = msgspec.structs.replace(self.config, trainer=trainer_config)
        scheduler = self.runtime.actors["gpu-scheduler"]
        self.trainer = await self.runtime.spawn(
            "trainer", TrainerActor, self.address.only("trainer"), trainer_config, self.config.model,
            self._sglang_workers(), options=self._placed("trainer", await scheduler.actor_options.remote("trainer")))
        await self.trainer.reset_optimizers.remote()
        self.runtime.supervisor.start()
        _log.info("trainer_restarted", lr=trainer_config.lr)
        return self.trainer

    def _api_key(self) -> str:
        from rollmesh.serve_apps import required_api_key

        serve = self.config.serve
        return required_api_key(serve.api_key_file, os.environ, host=serve.host,
                                security_enabled=self.config.security.enabled)

    def _sglang_workers(self) -> list[str]:
        """The decode workers that are SGLang workers: the trainer pushes weights into their
        servers (``trainer.weight_sync``)."""
        inference = self.config.inference
        return [f"decode-{i}" for i in range(inference.decode_worker_count)] if inference.backend == "sglang" else []

    def _placed(self, role: str, options: dict[str, Any] | None = None) -> dict[str, Any]:
        """Ray options for ``role``'s actors: its accelerator grant plus ``ray.role_resources``."""
        return with_role_resources(options or {}, self.config.ray.role_resources.get(role, {}))

    async def stop(self) -> None:
        await self.runtime.stop()
        (self.run_dir / "mesh.json").unlink(missing_ok=True)


async def _name_released(name: str, namespace: str, *, timeout_s: float = 60.0) -> None:
    """Wait until no live actor holds ``name`` (a killed one lets it go asynchronously)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            ray.get_actor(name, namespace=namespace)
        except ValueError:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"actor name {name!r} still taken {timeout_s:.0f} s after its actor was killed")
        await asyncio.sleep(0.2)  # polls Ray's registry; bounded by the deadline


def with_role_resources(options: dict[str, Any], extra: dict[str, float]) -> dict[str, Any]:
    """``options`` (a grant's ``num_gpus`` or ``resources``) with ``extra`` custom resources added."""
    if not extra:
        return options
    return {**options, "resources": {**options.get("resources", {}), **extra}}
