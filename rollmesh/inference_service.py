"""The inference service alone (``rollmesh serve``): prefill and decode workers behind the Serve app.

Knows Ray, the embedded nats-server and the launcher's way of spawning actors; not argparse or
signals (the CLI owns those). The story: make a run directory, start the bus (embedded unless
``nats.url``), start a local Ray, spawn one prefill and one decode worker, deploy the Serve app.
``stop`` undoes it backwards, and a failed start stops whatever did come up.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import ray
import structlog

from rollmesh.actors.inference_workers import DecodeWorkerActor, PrefillWorkerActor
from rollmesh.actors.role_base import MeshContext
from rollmesh.bus.embedded_server import EmbeddedNatsServer
from rollmesh.config import RollmeshConfig
from rollmesh.launcher import create_actor
from rollmesh.mesh_info import new_run_dir

_log = structlog.get_logger("rollmesh.inference_service")

MODEL_NAME = "rollmesh-tiny"
PREFILL_NAME = "prefill-0"
DECODE_NAME = "decode-0"
ACTOR_STOP_TIMEOUT_S = 15.0


class InferenceService:
    def __init__(self, config: RollmeshConfig, *, host: str, port: int, api_key: str = "",
                 run_dir: Path | None = None) -> None:
        self.config = config
        self.host = host
        self.port = port
        self._api_key = api_key  # never logged
        self.run_dir = Path(run_dir) if run_dir else new_run_dir(config.run_root)
        self.ray_namespace = f"rollmesh-serve-{config.namespace}"
        self.nats_server: EmbeddedNatsServer | None = None
        self.actors: dict[str, Any] = {}
        self.url = ""
        self._started_ray = False

    async def start(self) -> str:
        """Bring the service up; returns its base URL."""
        try:
            return await self._start()
        except BaseException:
            await self.stop()
            raise

    async def _start(self) -> str:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        nats_url = self._start_bus()
        self._start_ray()
        mesh = MeshContext(namespace=self.config.namespace, nats_url=nats_url,
                           run_dir=str(self.run_dir.resolve()),
                           telemetry=self.config.telemetry, nats=self.config.nats)
        model, inference = self.config.model, self.config.inference
        await self._spawn(PREFILL_NAME, PrefillWorkerActor, mesh, model, inference)
        await self._spawn(DECODE_NAME, DecodeWorkerActor, mesh, model, inference)
        self.url = self._deploy_serve()
        _log.info("inference_service_ready", run_dir=str(self.run_dir), url=self.url)
        return self.url

    async def stop(self) -> None:
        if self.url:
            from rollmesh.serve_apps import shutdown_inference_app

            shutdown_inference_app()
            self.url = ""
        for name, actor in reversed(list(self.actors.items())):
            try:
                await asyncio.wait_for(actor.stop.remote(), timeout=ACTOR_STOP_TIMEOUT_S)
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

    def _start_bus(self) -> str:
        if self.config.nats.url:
            return self.config.nats.url
        self.nats_server = EmbeddedNatsServer(self.run_dir / "nats")
        return self.nats_server.start()

    def _start_ray(self) -> None:
        if ray.is_initialized():
            return
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        ray.init(address=self.config.ray.address, num_cpus=self.config.ray.num_cpus,
                 namespace=self.ray_namespace, include_dashboard=False,
                 logging_level="warning", log_to_driver=False)
        self._started_ray = True

    async def _spawn(self, name: str, cls: type, *args: Any) -> Any:
        actor = create_actor(name, cls, *args, ray_namespace=self.ray_namespace)
        self.actors[name] = actor
        await actor.start.remote()
        return actor

    def _deploy_serve(self) -> str:
        from rollmesh.serve_apps import build_inference_app, deploy_inference_app

        app = build_inference_app(
            prefill_actor_names=[PREFILL_NAME], decode_actor_names=[DECODE_NAME],
            ray_namespace=self.ray_namespace, model_name=MODEL_NAME,
            max_seq_len=self.config.model.max_seq_len, vocab_size=self.config.model.vocab_size,
            api_key=self._api_key,
        )
        return deploy_inference_app(app, host=self.host, port=self.port)
