"""The inference service alone (``rollmesh serve``): prefill and decode workers behind the Serve app.

Knows the inference worker classes; the bus, Ray and Serve mechanics are ``MeshRuntime``'s. Not
argparse or signals (the CLI owns those). The story: make a run directory, start the bus (embedded unless
``nats.url``), start a local Ray, spawn one prefill and one decode worker (with
``inference.backend = "sglang"``: one SGLang worker, no prefill worker), deploy the Serve app.
``stop`` undoes it backwards, and a failed start stops whatever did come up.
"""

from __future__ import annotations

from pathlib import Path

import structlog

from rollmesh.actors.inference_workers import DecodeWorkerActor, PrefillWorkerActor
from rollmesh.actors.sglang_worker import SGLangWorkerActor
from rollmesh.config import RollmeshConfig
from rollmesh.mesh_address import new_run_dir
from rollmesh.mesh_runtime import MeshRuntime
from rollmesh.model_source import resolve_model

_log = structlog.get_logger("rollmesh.inference_service")

PREFILL_NAME = "prefill-0"
DECODE_NAME = "decode-0"


class InferenceService:
    def __init__(self, config: RollmeshConfig, *, host: str, port: int, api_key: str = "",
                 run_dir: Path | None = None) -> None:
        self.host = host
        self.port = port
        self._api_key = api_key  # never logged
        self.run_dir = Path(run_dir) if run_dir else new_run_dir(config.run_root)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        # An empty model.path serves the demo model, built into the run directory.
        self.config = config = resolve_model(config, self.run_dir)
        self.ray_namespace = f"rollmesh-serve-{config.namespace}"
        self.runtime = MeshRuntime(config, run_dir=self.run_dir, ray_namespace=self.ray_namespace)

    @property
    def url(self) -> str:
        return self.runtime.serve_url

    async def start(self) -> str:
        """Bring the service up; returns its base URL."""
        try:
            return await self._start()
        except BaseException:
            await self.stop()
            raise

    async def _start(self) -> str:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        runtime = self.runtime
        bus = runtime.start_bus()
        await runtime.prepare_streams(bus)  # security.enabled: as "mesh", before the workers
        runtime.start_ray()
        mesh = bus.only("inference")
        model, inference = self.config.model, self.config.inference
        prefill_names = [PREFILL_NAME] if inference.prefill_worker_count else []
        for name in prefill_names:
            await runtime.spawn(name, PrefillWorkerActor, mesh, model, inference)
        # inference.backend = "sglang": the decode worker serves through SGLang (launched or attached).
        decode_class = SGLangWorkerActor if inference.backend == "sglang" else DecodeWorkerActor
        await runtime.spawn(DECODE_NAME, decode_class, mesh, model, inference)
        url = runtime.deploy_serve(prefill_names=prefill_names, decode_names=[DECODE_NAME],
                                   host=self.host, port=self.port, api_key=self._api_key)
        _log.info("inference_service_ready", run_dir=str(self.run_dir), url=url)
        return url

    async def stop(self) -> None:
        await self.runtime.stop()
