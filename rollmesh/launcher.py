"""Starts the mesh in order and stops it in reverse.

Knows Ray (this is where ``ray.remote`` is applied to the role classes), the embedded nats-server
and the actor classes. The story: make the run directory, start or join the bus, start or join
Ray, spawn the GPU scheduler, sandbox broker, prefill and decode workers, trainer, resharder and
rollout workers, deploy the Serve app, write ``mesh.json``. ``stop`` undoes it backwards.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

import ray
import structlog

from rollmesh.actors.gpu_scheduler import GpuSchedulerActor
from rollmesh.actors.inference_workers import DecodeWorkerActor, PrefillWorkerActor
from rollmesh.actors.resharder import ResharderActor
from rollmesh.actors.role_base import MeshContext
from rollmesh.actors.rollout_worker import RolloutWorkerActor
from rollmesh.actors.sandbox_broker import SandboxBrokerActor
from rollmesh.actors.trainer import TrainerActor
from rollmesh.bus.embedded_server import EmbeddedNatsServer
from rollmesh.config import RollmeshConfig
from rollmesh.mesh_info import MeshInfo, new_run_dir, write_mesh_info
from rollmesh.scheduling.grants import GpuScheduler

_log = structlog.get_logger("rollmesh.launcher")

# Actors mostly wait on NATS, Ray calls and each other: they reserve no CPU, so the whole mesh
# fits on a 2-core machine, and torch in each is limited to one thread.
ACTOR_OPTIONS: dict[str, Any] = {"num_cpus": 0, "max_concurrency": 1000}
# The actor that holds each role's accelerator grant (the first worker of a role, for now).
GRANT_HOLDERS = {"prefill": "prefill-0", "decode": "decode-0", "trainer": "trainer"}


def create_actor(name: str, cls: type, *args: Any, ray_namespace: str,
                 options: dict[str, Any] | None = None) -> Any:
    """``cls`` as a named Ray actor with ``ACTOR_OPTIONS``, constructed as ``cls(name, *args)``;
    the caller awaits ``actor.start.remote()`` (after recording the handle, so a failed start can
    still be killed)."""
    return ray.remote(cls).options(
        name=name, namespace=ray_namespace, **ACTOR_OPTIONS, **(options or {})
    ).remote(name, *args)


class Mesh:
    def __init__(self, config: RollmeshConfig, *, run_dir: Path | None = None) -> None:
        self.config = config
        self.run_dir = Path(run_dir) if run_dir else new_run_dir(config.run_root)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.ray_namespace = f"rollmesh-{config.namespace}"
        self.nats_server: EmbeddedNatsServer | None = None
        self.actors: dict[str, Any] = {}
        self.prefill_workers: list[Any] = []
        self.decode_workers: list[Any] = []
        self.trainer: Any = None
        self.info: MeshInfo | None = None
        self._started_ray = False
        self._serve_url = ""

    async def start(self) -> MeshInfo:
        try:
            return await self._start()
        except BaseException:
            # Half a mesh must not outlive a failed start: stop what did come up, in reverse.
            await self.stop()
            raise

    async def _start(self) -> MeshInfo:
        nats_url = self._start_bus()
        self._start_ray()
        mesh = MeshContext(namespace=self.config.namespace, nats_url=nats_url,
                           run_dir=str(self.run_dir.resolve()),
                           telemetry=self.config.telemetry, nats=self.config.nats)
        scheduler = await self._spawn("gpu-scheduler", GpuSchedulerActor, mesh, self.config.scheduler)
        # Grants first: each role's actor is then placed with the Ray resources it was granted.
        await scheduler.grant.remote(GRANT_HOLDERS)
        await self._spawn("sandbox-broker", SandboxBrokerActor, mesh, self.config.sandbox)
        inference = self.config.inference
        for index in range(inference.num_prefill_workers):
            self.prefill_workers.append(await self._spawn(
                f"prefill-{index}", PrefillWorkerActor, mesh, self.config.model, inference,
                options=await scheduler.actor_options.remote("prefill")))
        for index in range(inference.num_decode_workers):
            self.decode_workers.append(await self._spawn(
                f"decode-{index}", DecodeWorkerActor, mesh, self.config.model, inference, index,
                options=await scheduler.actor_options.remote("decode")))
        self.trainer = await self._spawn("trainer", TrainerActor, mesh, self.config.trainer,
                                         self.config.model,
                                         options=await scheduler.actor_options.remote("trainer"))
        await self._spawn("resharder", ResharderActor, mesh, self.config.resharder)
        for index in range(self.config.rollout.num_workers):
            await self._spawn(f"rollout-worker-{index}", RolloutWorkerActor, mesh, self.config.rollout,
                              self.config.model, self.prefill_workers, self.decode_workers)
        if self.config.serve.enabled:
            self._serve_url = self._deploy_serve()
        self.info = MeshInfo(
            nats_url=nats_url, namespace=self.config.namespace, run_dir=str(self.run_dir.resolve()),
            serve_url=self._serve_url, ray_namespace=self.ray_namespace,
            ray_address=self.config.ray.address or "", pid=os.getpid(), started_at=time.time(),
        )
        write_mesh_info(self.info)
        _log.info("mesh_ready", run_dir=str(self.run_dir), nats_url=nats_url, serve_url=self._serve_url)
        return self.info

    async def stop(self) -> None:
        if self._serve_url:
            from rollmesh.serve_apps import shutdown_inference_app

            shutdown_inference_app()
            self._serve_url = ""
        for name, actor in reversed(list(self.actors.items())):
            try:
                await asyncio.wait_for(actor.stop.remote(), timeout=15)
            except Exception as exc:  # a dying actor must not keep the rest running
                _log.warning("actor_stop_failed", actor=name, error=repr(exc))
            ray.kill(actor)
        self.actors.clear()
        if self._started_ray:
            ray.shutdown()
            self._started_ray = False
        if self.nats_server is not None:
            self.nats_server.stop()
            self.nats_server = None
        (self.run_dir / "mesh.json").unlink(missing_ok=True)

    def _start_bus(self) -> str:
        if self.config.nats.url:
            return self.config.nats.url
        self.nats_server = EmbeddedNatsServer(self.run_dir / "nats")
        return self.nats_server.start()

    def _start_ray(self) -> None:
        if ray.is_initialized():
            return
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        declared = GpuScheduler(self.config.scheduler, clock=time.time, new_id=lambda: "").ray_resources()
        ray.init(
            address=self.config.ray.address,
            num_cpus=self.config.ray.num_cpus,
            # Declared accelerators as a custom resource, so grants schedule with zero real GPUs
            # (joining a cluster, its nodes must declare them instead).
            resources=None if self.config.ray.address else declared,
            namespace=self.ray_namespace,
            include_dashboard=False,
            logging_level="warning",
            log_to_driver=False,
        )
        self._started_ray = True

    async def _spawn(self, name: str, cls: type, *args: Any, options: dict[str, Any] | None = None) -> Any:
        actor = create_actor(name, cls, *args, ray_namespace=self.ray_namespace, options=options)
        self.actors[name] = actor
        await actor.start.remote()
        return actor

    def _deploy_serve(self) -> str:
        from rollmesh.serve_apps import build_inference_app, deploy_inference_app

        app = build_inference_app(
            prefill_actor_names=[f"prefill-{i}" for i in range(self.config.inference.num_prefill_workers)],
            decode_actor_names=[f"decode-{i}" for i in range(self.config.inference.num_decode_workers)],
            ray_namespace=self.ray_namespace, model_name="rollmesh-tiny",
            max_seq_len=self.config.model.max_seq_len, vocab_size=self.config.model.vocab_size,
        )
        return deploy_inference_app(app, host=self.config.serve.host, port=self.config.serve.port)
