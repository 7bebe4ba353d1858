"""Where a mesh is and how to get in: one ``MeshAddress``, its ``mesh.json``, and ``connect``.

Every process that talks to a mesh holds one: the launcher builds it and writes its public part
to ``mesh.json`` in the run directory; each actor is handed it (with only its roles'
credentials, ``only``); the CLI finds it from ``mesh.json`` or the config (``cli.target``); the
Serve replica's dashboard and decode-loan follower are handed it. ``connect`` is the one way
into the mesh's NATS. Knows msgspec, the file system, the config and the bus's credential types;
nats-py's connection is imported inside ``connect`` only and Ray never, so a CLI command can find
a mesh cheaply.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import re
import time
import typing
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec
import structlog

from rollmesh.bus.errors import BusSecurityError
from rollmesh.bus.permissions import ACTOR_ROLES
from rollmesh.bus.security import BusCredentials
from rollmesh.config import NatsConfig, NatsTlsConfig, TelemetryConfig
from rollmesh.telemetry.redaction import redact_url

if TYPE_CHECKING:
    from nats.aio.client import Client

_log = structlog.get_logger("rollmesh.mesh_address")

MESH_FILE = "mesh.json"


@dataclass(frozen=True, kw_only=True)
class MeshAddress:
    """Where the mesh is (its ``mesh.json`` fields) and how to get in (never written there)."""

    # tls:// when the mesh speaks TLS to NATS (nats_url_for_clients), so a client reading
    # mesh.json knows to bring a CA; comma-separated for a cluster.
    nats_url: str
    namespace: str
    run_dir: str
    serve_url: str = ""
    ray_namespace: str = ""
    ray_address: str = ""
    pid: int = 0
    started_at: float = 0.0
    # Prometheus metrics of the whole mesh (docs/metrics.md); "" when not served.
    metrics_url: str = ""
    # The live dashboard (``rollmesh dashboard``); "" when Serve or the dashboard is off.
    dashboard_url: str = ""
    # A local Ray's token (mode 0600), for commands that join that Ray (``convert --backend ray
    # --run-dir``); "" when the mesh joined a cluster (``ray.address``), whose auth is its own.
    ray_auth_token_file: str = ""
    # -- how to get in; not in mesh.json --------------------------------------------------------
    # security.enabled: NATS role -> credentials (paths and variable names, no secrets); an actor
    # is handed only the roles it connects as (``only``). Empty: an open NATS.
    credentials: Mapping[str, BusCredentials] = field(default_factory=dict)
    nats_tls: NatsTlsConfig = NatsTlsConfig()
    # The connect timeout, the JetStream replicas the streams are made with, and what an actor's
    # consumers need (max_deliver, the rollout ack wait).
    nats: NatsConfig = NatsConfig()
    # What an actor's shell sets logging, tracing and metric reports up with.
    telemetry: TelemetryConfig = TelemetryConfig()

    @property
    def secured(self) -> bool:
        """Connections authenticate as a role (and may not create streams: the launcher's "mesh"
        user made them)."""
        return bool(self.credentials)

    def only(self, *roles: str) -> MeshAddress:
        """This address with the credentials of ``roles`` only."""
        return replace(self, credentials={r: c for r, c in self.credentials.items() if r in roles})

    def credentials_for(self, role: str) -> BusCredentials | None:
        """The credentials a connection as ``role`` (a NATS role, or an actor's role such as
        "decode") uses; None on an open NATS."""
        if not self.credentials:
            return None
        nats_role = ACTOR_ROLES.get(role, role)
        found = self.credentials.get(nats_role)
        if found is None:
            raise BusSecurityError("no NATS credentials handed over for this role", role=nats_role)
        return found

    async def connect(self, name: str, *, role: str, retry_every_s: float | None = None,
                      on_unreachable: Callable[[Exception], None] = lambda exc: None) -> Client:
        """A NATS connection to the mesh as ``role``, reconnecting forever once made
        (``bus.connection.connect_bus``). A first connect that fails raises ``BusConnectError``,
        ``BusTlsError`` or ``BusSecurityError``; with ``retry_every_s`` it is instead reported to
        ``on_unreachable`` and tried again after that long, until one is made (a Serve replica
        may start before its mesh)."""
        from rollmesh.bus.connection import connect_bus
        from rollmesh.bus.errors import BusConnectError
        from rollmesh.bus.tls import client_tls_context

        while True:
            try:
                return await connect_bus(self.nats_url, name=name, connect_timeout_s=self.nats.connect_timeout_s,
                                         credentials=self.credentials_for(role),
                                         tls=client_tls_context(self.nats_tls))
            except (BusConnectError, BusSecurityError) as exc:
                if retry_every_s is None:
                    raise
                on_unreachable(exc)
                _log.warning("mesh_bus_unreachable", client=name, url=redact_url(self.nats_url))
                await asyncio.sleep(retry_every_s)  # the next attempt, not a synchronisation


class MeshNotFoundError(LookupError):
    def __init__(self, reason: str, *, run_dir: str = "") -> None:
        super().__init__(reason)
        self.run_dir = run_dir


def nats_url_for_clients(url: str, *, tls: bool) -> str:
    """``url`` (comma-separated for a cluster) with the scheme clients need: ``tls://`` for each
    ``nats://`` server when the mesh speaks TLS to NATS, so a client reading mesh.json knows it
    must bring a CA (and, for mutual TLS, a certificate) before it dials."""
    if not tls:
        return url
    return ",".join(re.sub(r"^nats://", "tls://", part.strip()) for part in url.split(","))


def new_run_dir(run_root: str | Path) -> Path:
    """A fresh ``<run_root>/<UTC time>-<short id>`` directory; names sort by start time."""
    run_id = time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + "-" + uuid.uuid4().hex[:6]
    path = Path(run_root) / run_id
    path.mkdir(parents=True, exist_ok=False)
    return path


def latest_run_dir(run_root: str | Path) -> Path | None:
    root = Path(run_root)
    runs = sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []
    return runs[-1] if runs else None


# How to get in: held by the processes that connect, never written to mesh.json.
_ACCESS_FIELDS = frozenset({"credentials", "nats_tls", "nats", "telemetry"})


def _mesh_file_struct() -> type[msgspec.Struct]:
    """The on-disk ``mesh.json``, made from MeshAddress's other fields (so a new one is written
    without a second list): users' scripts read it, so its keys keep MeshAddress's order and new
    ones go last with defaults (an older file still reads); decoding it checks each type."""
    hints = typing.get_type_hints(MeshAddress)
    return msgspec.defstruct("MeshFile", [
        (f.name, hints[f.name]) if f.default is dataclasses.MISSING else (f.name, hints[f.name], f.default)
        for f in dataclasses.fields(MeshAddress) if f.name not in _ACCESS_FIELDS
    ], frozen=True, kw_only=True)


_MeshFile = _mesh_file_struct()
_FILE_FIELDS = _MeshFile.__struct_fields__


def write_mesh_address(address: MeshAddress) -> Path:
    """``address``'s mesh.json fields (never its credentials, TLS or config) to its run directory."""
    on_disk = _MeshFile(**{name: getattr(address, name) for name in _FILE_FIELDS})
    path = Path(address.run_dir) / MESH_FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(msgspec.json.format(msgspec.json.encode(on_disk)))
    os.replace(tmp, path)  # readers polling for readiness never see half a file
    return path


def read_mesh_address(run_dir: str | Path | None, *, run_root: str | Path) -> MeshAddress:
    """The mesh of ``run_dir``, or of the latest run under ``run_root`` when run_dir is None: where
    it is; how to get in is the reader's to add (``cli.target.find_mesh``)."""
    directory = Path(run_dir) if run_dir else latest_run_dir(run_root)
    if directory is None:
        raise MeshNotFoundError(f"no runs under {run_root}; start one with `rollmesh up`")
    path = directory / MESH_FILE
    if not path.exists():
        raise MeshNotFoundError(f"{path} does not exist: is the mesh up?", run_dir=str(directory))
    on_disk = msgspec.json.decode(path.read_bytes(), type=_MeshFile)
    return MeshAddress(**msgspec.structs.asdict(on_disk))

