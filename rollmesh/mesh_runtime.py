"""What every way of running rollmesh shares: the bus, Ray, named actors and the Serve app.

Knows Ray, Ray Serve (through ``rollmesh.serve_apps``) and the embedded nats-server; knows no
role. ``Mesh`` (the whole mesh) and ``InferenceService`` (``rollmesh serve``) each tell their own
story on top of one ``MeshRuntime``; ``stop`` undoes whatever came up, in reverse, and is safe to
call after a half-finished start.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import ray
import structlog

from rollmesh.actor_supervisor import ActorSupervisor
from rollmesh.bus.embedded_server import EmbeddedNatsServer
from rollmesh.bus.security import BusCredentials, configured_credentials, generate_role_nkeys
from rollmesh.config import RollmeshConfig
from rollmesh.local_ray import LocalRayEnvironment, write_ray_auth_token
from rollmesh.mesh_address import MeshAddress, nats_url_for_clients

_log = structlog.get_logger("rollmesh.mesh_runtime")

# Actors mostly wait on NATS, Ray calls and each other: they reserve no CPU, so the whole mesh
# fits on a 2-core machine, and torch in each is limited to one thread. A killed actor's process
# is re-created by Ray (max_restarts) and its role started again by the ActorSupervisor.
ACTOR_OPTIONS: dict[str, Any] = {"num_cpus": 0, "max_concurrency": 1000, "max_restarts": -1}
ACTOR_STOP_TIMEOUT_S = 15.0


class MeshRuntime:
    def __init__(self, config: RollmeshConfig, *, run_dir: Path, ray_namespace: str) -> None:
        self.config = config
        self.run_dir = run_dir
        self.ray_namespace = ray_namespace
        self.nats_server: EmbeddedNatsServer | None = None
        self.actors: dict[str, Any] = {}
        self.serve_url = ""
        self.dashboard_url = ""
        # security.enabled: each NATS role's credentials (paths, no secrets), set by start_bus.
        self.bus_credentials: dict[str, BusCredentials] = {}
        self._started_ray = False
        # The GCS address of the Ray started or joined, and a local Ray's token file (mesh.json).
        self.ray_address = ""
        self.ray_auth_token_file: Path | None = None
        self._local_ray_env: LocalRayEnvironment | None = None
        self.metrics_hub: Any = None  # MetricsHubShell, once start_metrics ran
        self.supervisor = ActorSupervisor(lambda: self.actors, interval_s=config.ray.supervise_interval_s)

    def start_bus(self) -> MeshAddress:
        """The mesh's address: at the configured NATS URL, or at an embedded nats-server with
        JetStream in the run dir, started here. With security.enabled, each role's credentials
        come from config (a cluster) or are made here, and the embedded server gets one user per
        role with its permissions."""
        url = self._start_nats()
        config = self.config
        # The URL as clients dial it (tls:// when the bus speaks TLS), the same for every holder.
        return MeshAddress(nats_url=nats_url_for_clients(url, tls=config.security.nats_tls.enabled),
                           namespace=config.namespace, run_dir=str(Path(self.run_dir).resolve()),
                           ray_namespace=self.ray_namespace, credentials=self.bus_credentials,
                           nats_tls=config.security.nats_tls, nats=config.nats, telemetry=config.telemetry)

    def _start_nats(self) -> str:
        from rollmesh.bus.permissions import render_authorization
        from rollmesh.bus.tls import server_tls_block

        security, namespace = self.config.security, self.config.namespace
        if self.config.nats.url:
            if security.enabled:
                self.bus_credentials = configured_credentials(security, namespace)
            return self.config.nats.url
        auth = ""
        if security.enabled:
            from rollmesh.sandbox_brokers import credential_broker_ids

            # Several sandbox brokers: one user each, made now (before Ray lists the nodes).
            generated = generate_role_nkeys(self.run_dir, namespace, credential_broker_ids(self.config.sandbox))
            self.bus_credentials = generated.credentials
            auth = render_authorization(generated.users, namespace)
        self.nats_server = EmbeddedNatsServer(self.run_dir / "nats", auth_config=auth,
                                              tls_config=server_tls_block(security.nats_tls))
        return self.nats_server.start()

    async def prepare_streams(self, mesh: MeshAddress) -> None:
        """With security.enabled, create the streams as the "mesh" user before any actor starts
        (roles may not create them); an open NATS leaves it to every actor, as before."""
        if not mesh.secured:
            return
        from rollmesh.bus.streams import StreamLimits, ensure_streams

        nc = await mesh.connect("rollmesh-mesh", role="mesh")
        try:
            await ensure_streams(nc.jetstream(), self.config.namespace,
                                 StreamLimits(replicas=self.config.nats.replicas))
        finally:
            await nc.close()

    async def start_metrics(self, mesh: MeshAddress) -> str:
        """Serve the mesh's Prometheus metrics and write its TensorBoard scalars (the hub takes
        every actor's snapshots from NATS, as the "mesh" user); returns the metrics URL."""
        from rollmesh.metrics_hub_shell import MetricsHubShell

        self.metrics_hub = MetricsHubShell(mesh.only("mesh"))
        return await self.metrics_hub.start()

    def start_ray(self, *, resources: dict[str, float] | None = None) -> None:
        """Join ``ray.address`` (its auth is the cluster's), or start a local Ray on
        ``ray.node_ip_address`` with token auth, its token in the run directory (``resources``
        only apply to a local one)."""
        if ray.is_initialized():
            return
        options: dict[str, Any] = {}
        if not self.config.ray.address:
            self.ray_auth_token_file = write_ray_auth_token(self.run_dir).resolve()
            self._local_ray_env = LocalRayEnvironment(token_file=self.ray_auth_token_file,
                                                      node_ip_address=self.config.ray.node_ip_address)
            self._local_ray_env.apply()
            options = self._local_ray_env.init_options()
        ray.init(
            address=self.config.ray.address,
            num_cpus=self.config.ray.num_cpus,
            resources=None if self.config.ray.address else resources,
            namespace=self.ray_namespace,
            include_dashboard=False,
            logging_level="warning",
            log_to_driver=False,
            **options,
        )
        self._started_ray = True
        self.ray_address = ray.get_runtime_context().gcs_address

    async def spawn(self, name: str, cls: type, *args: Any, options: dict[str, Any] | None = None) -> Any:
        """``cls(name, *args)`` as a named actor, started; recorded first so a failed start is
        still stopped."""
        actor = self.create(name, cls, *args, options=options)
        await actor.start.remote()
        return actor

    def create(self, name: str, cls: type, *args: Any, options: dict[str, Any] | None = None) -> Any:
        """``cls(name, *args)`` as a named actor, not yet started (its ``start`` is the caller's to
        await): Ray starts its process and runs the constructor in the background. Recorded at
        once, so a failed start of this or any other actor still stops it."""
        actor = ray.remote(cls).options(
            name=name, namespace=self.ray_namespace, **ACTOR_OPTIONS, **(options or {})
        ).remote(name, *args)
        self.actors[name] = actor
        return actor

    def deploy_serve(self, *, prefill_names: list[str], decode_names: list[str], host: str, port: int,
                     api_key: str = "", follow: MeshAddress | None = None) -> str:
        """Deploy the Serve app (HTTPS with serve.tls_cert_file/tls_key_file). With ``follow``
        (the mesh's address) it follows the mesh, as the "dashboard" role: its router uses the
        decode workers the GPU scheduler lends, and with dashboard.enabled it serves the live
        dashboard too, at ``dashboard_url``."""
        from rollmesh.dashboard import DASHBOARD_PATH
        from rollmesh.serve_apps import build_inference_app, deploy_inference_app

        followed = follow.only("dashboard") if follow is not None else None

        # The workers' model (model.path made absolute by resolve_model): the app's text routes
        # speak its tokenizer and chat template.
        app = build_inference_app(
            prefill_actor_names=prefill_names, decode_actor_names=decode_names,
            ray_namespace=self.ray_namespace, model=self.config.model, api_key=api_key,
            telemetry=self.config.telemetry,
            run_dir=str(Path(self.run_dir).resolve()), follow=followed, dashboard=self.config.dashboard,
            sessions=self.config.serve,
        )
        self.serve_url = deploy_inference_app(app, host=host, port=port,
                                              tls_cert_file=self.config.serve.tls_cert_file,
                                              tls_key_file=self.config.serve.tls_key_file)
        self.dashboard_url = self.serve_url + DASHBOARD_PATH if followed is not None and self.config.dashboard.enabled else ""
        return self.serve_url

    async def stop(self) -> None:
        await self.supervisor.stop()  # stopping actors must not look like crashes to restart
        if self.serve_url:
            from rollmesh.serve_apps import shutdown_inference_app

            shutdown_inference_app()
            self.serve_url = self.dashboard_url = ""
        for name, actor in reversed(list(self.actors.items())):
            try:
                await asyncio.wait_for(actor.stop.remote(), timeout=ACTOR_STOP_TIMEOUT_S)
            except Exception as exc:  # a dying actor must not keep the rest running
                _log.warning("actor_stop_failed", actor=name, error=repr(exc))
            ray.kill(actor)
        self.actors.clear()
        if self.metrics_hub is not None:  # after the actors: their last snapshots count
            await self.metrics_hub.stop()
            self.metrics_hub = None
        if self._started_ray:
            ray.shutdown()
            self._started_ray = False
        if self._local_ray_env is not None:
            self._local_ray_env.restore()
            self._local_ray_env = None
        if self.nats_server is not None:
            self.nats_server.stop()
            self.nats_server = None
