"""What every CLI command shares: the config it runs with and the mesh it talks to.

Knows the config loader, ``mesh.json`` and argparse; never imports Ray or nats-py, so finding a
mesh stays cheap. A command finds its mesh, in this order: ``--nats-url`` (+ ``--namespace``),
``--run-dir``, the config's ``nats.url`` (a cluster deployment), the latest run under the run root.
With security it connects as a NATS role ("client" for submit and watch): the config's
``security.credentials`` for it, else the key the mesh generated in its run directory.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollmesh.bus.security import role_seed_path
from rollmesh.cli.errors import EXIT_USAGE, CliError
from rollmesh.config import ConfigError, NatsCredentialsConfig, NatsTlsConfig, RollmeshConfig, load_config
from rollmesh.mesh_info import MeshInfo, MeshNotFoundError, read_mesh_info
from rollmesh.messages import check_namespace


@dataclass(frozen=True)
class MeshTarget:
    nats_url: str
    namespace: str
    # The run directory when the mesh was found through mesh.json, else None.
    run_dir: Path | None = None
    info: MeshInfo | None = None
    connect_timeout_s: float = 5.0
    # JetStream replicas the streams are ensured with (the config's nats.replicas).
    replicas: int = 1
    # The NATS role to connect as and where its credentials are (None: an open NATS), and TLS.
    role: str = "client"
    credentials: NatsCredentialsConfig | None = None
    nats_tls: NatsTlsConfig = NatsTlsConfig()

    @property
    def secured(self) -> bool:
        return self.credentials is not None

    def bus_options(self) -> dict[str, Any]:
        """``connect_bus`` keyword arguments: the role's credentials and the TLS context."""
        from rollmesh.bus.security import BusCredentials
        from rollmesh.bus.tls import client_tls_context

        credentials = (BusCredentials(self.role, self.namespace, self.credentials)
                       if self.credentials is not None else None)
        return {"credentials": credentials, "tls": client_tls_context(self.nats_tls)}


def namespace_arg(text: str) -> str:
    """argparse ``type=``: a bad namespace is a usage error (exit 2), not a crash later."""
    try:
        return check_namespace(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be above 0, got {value}")
    return value


def add_target_options(parser: argparse.ArgumentParser, *, nats: bool = True) -> None:
    """``--run-dir`` or ``--nats-url`` (mutually exclusive), and ``--namespace``."""
    group = parser.add_argument_group("which mesh")
    where = group.add_mutually_exclusive_group()
    where.add_argument("--run-dir", type=Path, metavar="DIR",
                       help="the mesh's run directory (default: the latest run under --run-root)")
    if nats:
        where.add_argument("--nats-url", metavar="URL",
                           help="talk to this NATS server directly instead of reading mesh.json")
        group.add_argument("--namespace", type=namespace_arg, metavar="NS",
                           help="subject namespace (default: the mesh's, else the config's)")


def load_cli_config(args: argparse.Namespace, overrides: dict[str, Any] | None = None) -> RollmeshConfig:
    """The config of ``--config`` (embedded defaults when absent) with env and CLI overrides."""
    merged = dict(overrides or {})
    if args.run_root is not None:
        merged["run_root"] = str(args.run_root)
    try:
        return load_config(args.config, overrides={k: v for k, v in merged.items() if v is not None})
    except ConfigError as exc:
        raise CliError(f"bad config: {exc}", exit_code=EXIT_USAGE) from exc


def find_mesh(args: argparse.Namespace, config: RollmeshConfig, *, role: str = "client") -> MeshTarget:
    namespace = getattr(args, "namespace", None)
    nats_url = getattr(args, "nats_url", None)
    timeout_s, replicas = config.nats.connect_timeout_s, config.nats.replicas
    access = dict(role=role, credentials=_configured_credentials(config, role),
                  nats_tls=config.security.nats_tls)
    if nats_url:
        return MeshTarget(nats_url, namespace or config.namespace, connect_timeout_s=timeout_s,
                          replicas=replicas, **access)
    if args.run_dir is None and config.nats.url:
        return MeshTarget(config.nats.url, namespace or config.namespace,
                          connect_timeout_s=timeout_s, replicas=replicas, **access)
    info = read_cli_mesh_info(args, config)
    # A mesh with security on an embedded server keeps each role's generated key in its run dir.
    generated = role_seed_path(info.run_dir, role)
    if access["credentials"] is None and generated.is_file():
        access["credentials"] = NatsCredentialsConfig(nkey_seed_file=str(generated))
    return MeshTarget(info.nats_url, namespace or info.namespace, Path(info.run_dir), info,
                      connect_timeout_s=timeout_s, replicas=replicas, **access)


def read_cli_mesh_info(args: argparse.Namespace, config: RollmeshConfig) -> MeshInfo:
    """The mesh of ``--run-dir``, else the latest under the run root; a CliError when none is up."""
    try:
        return read_mesh_info(args.run_dir, run_root=config.run_root)
    except MeshNotFoundError as exc:
        raise CliError(str(exc)) from exc


def _configured_credentials(config: RollmeshConfig, role: str) -> NatsCredentialsConfig | None:
    return config.security.credentials.get(role) if config.security.enabled else None
