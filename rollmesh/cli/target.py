"""What every CLI command shares: the config it runs with and the mesh it talks to.

Knows the config loader, ``mesh.json`` and argparse; never imports Ray or nats-py at import time,
so finding a mesh stays cheap. A command finds its mesh, in this order: ``--nats-url`` (+
``--namespace``), ``--run-dir``, the config's ``nats.url`` (a cluster deployment), the latest run
under the run root. With security it connects as a NATS role ("client" for submit and watch,
"mesh" for sched and sandbox): ``find_mesh`` hands back a ``MeshAddress`` holding that role's
credentials, and the command connects with ``MeshAddress.connect`` inside
``bus_errors_as_cli_errors``.

A mesh found through its run directory (``--run-dir`` or the latest run) brings its own access,
so ``rollmesh submit --run-dir R`` works from any directory without ``--config``:

- TLS: the ``[security.nats_tls]`` the mesh was started with, from the run's ``config.json``
  (where every path is absolute), unless ``--config`` (or a ``ROLLMESH_SECURITY__NATS_TLS__*``
  variable) sets any of ``[security.nats_tls]``: then that whole section, as given, wins (a user's
  own client certificate, another CA bundle).
- Credentials for the role: ``--config``'s ``[security.credentials.<role>]`` when it has one,
  else the run's, else the key the mesh generated in its run directory
  (``security/<role>.nk``).
- JetStream replicas are always the run's (its streams were made with them).

``--nats-url`` and a configured ``nats.url`` name no run: there the config (``--config``, else
the embedded defaults) is all there is. A TLS handshake that fails is one ``CliError`` line that
names the setting to fix; asyncio's "returning true from eof_received() has no effect when using
ssl" warning (nats-py upgrades a plain socket to TLS in place, see ``quiet_asyncio_ssl_warning``)
is silenced in the CLI.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import msgspec

from rollmesh.bus.errors import BusSecurityError, BusTlsError
from rollmesh.bus.security import BusCredentials, role_seed_path
from rollmesh.cli.errors import EXIT_USAGE, CliError
from rollmesh.config import (
    RUN_CONFIG_FILE,
    ConfigError,
    NatsCredentialsConfig,
    NatsTlsConfig,
    RollmeshConfig,
    SecurityConfig,
    load_config,
    load_run_config,
)
from rollmesh.mesh_address import MeshAddress, MeshNotFoundError, read_mesh_address
from rollmesh.messages import check_namespace
from rollmesh.moved_names import forward_moved_names

# Issue 24: one type for where the mesh is.
__getattr__ = forward_moved_names(__name__, {
    "MeshTarget": "rollmesh.mesh_address:MeshAddress",
    "read_cli_mesh_info": "rollmesh.cli.target:read_cli_mesh_address",
})


@contextmanager
def bus_errors_as_cli_errors(mesh: MeshAddress) -> Iterator[None]:
    """Around ``mesh.connect(...)``: a refused TLS handshake or unusable TLS material or
    credentials is one ``CliError`` naming the setting to fix."""
    quiet_asyncio_ssl_warning()
    try:
        yield
    except BusTlsError as exc:
        raise CliError(tls_failure_message(exc, mesh.nats_tls, mesh.nats_url)) from exc
    except BusSecurityError as exc:
        raise CliError(f"cannot use the NATS credentials or TLS files: {exc}") from exc


def namespace_arg(text: str) -> str:
    """argparse ``type=``: a bad namespace is a usage error (exit 2), not a crash later."""
    try:
        return check_namespace(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def model_dir_arg(text: str) -> str:
    """argparse ``type=`` of ``--model DIR``: the path made absolute (the mesh's processes may run
    in another directory); ``check_model_dir`` checks it when the command runs."""
    return str(Path(text).expanduser().absolute())


def check_model_dir(path: str | None) -> None:
    """A ``--model`` that is no Hugging Face model directory is a usage error (exit 2), found
    before anything starts."""
    if path is not None and not (Path(path) / "config.json").is_file():
        raise CliError(f"--model {path} is not a model directory (no config.json)", exit_code=EXIT_USAGE)


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


def find_mesh(args: argparse.Namespace, config: RollmeshConfig, *, role: str = "client") -> MeshAddress:
    """The mesh this command talks to, and how as ``role`` (the module docstring says in which
    order)."""
    namespace = getattr(args, "namespace", None)
    nats_url = getattr(args, "nats_url", None) or (config.nats.url if args.run_dir is None else None)
    if nats_url:
        namespace = namespace or config.namespace
        return MeshAddress(nats_url=nats_url, namespace=namespace, run_dir="", nats=config.nats,
                           credentials=_role_credentials(role, namespace,
                                                         _configured_credentials(config.security, role)),
                           nats_tls=config.security.nats_tls)
    info = read_cli_mesh_address(args, config)
    run = run_config_of(info)
    credentials = _configured_credentials(config.security, role)
    if credentials is None and run is not None:
        credentials = _configured_credentials(run.security, role)
    # A mesh with security on an embedded server keeps each role's generated key in its run dir.
    generated = role_seed_path(info.run_dir, role)
    if credentials is None and generated.is_file():
        credentials = NatsCredentialsConfig(nkey_seed_file=str(generated))
    nats_tls = config.security.nats_tls
    if run is not None and nats_tls == NatsTlsConfig():  # --config left TLS alone: the mesh's own
        nats_tls = run.security.nats_tls
    namespace = namespace or info.namespace
    # The connect timeout is this command's; the replicas the run's (its streams were made so).
    nats = config.nats if run is None else msgspec.structs.replace(config.nats, replicas=run.nats.replicas)
    return replace(info, namespace=namespace, nats=nats, nats_tls=nats_tls,
                   credentials=_role_credentials(role, namespace, credentials))


def run_config_of(info: MeshAddress) -> RollmeshConfig | None:
    """The config the mesh was started with (its run's ``config.json``); None for a run directory
    without one (a mesh of an older rollmesh)."""
    if not (Path(info.run_dir) / RUN_CONFIG_FILE).is_file():
        return None
    try:
        return load_run_config(info.run_dir)
    except ConfigError as exc:
        raise CliError(f"the mesh's own config is unreadable: {exc}") from exc


def read_cli_mesh_address(args: argparse.Namespace, config: RollmeshConfig) -> MeshAddress:
    """The mesh of ``--run-dir``, else the latest under the run root (where it is, as its
    mesh.json says); a CliError when none is up."""
    try:
        return read_mesh_address(args.run_dir, run_root=config.run_root)
    except MeshNotFoundError as exc:
        raise CliError(str(exc)) from exc


def _configured_credentials(security: SecurityConfig, role: str) -> NatsCredentialsConfig | None:
    return security.credentials.get(role) if security.enabled else None


def _role_credentials(role: str, namespace: str,
                      source: NatsCredentialsConfig | None) -> dict[str, BusCredentials]:
    """``MeshAddress.credentials`` of a command that connects as ``role``: none on an open NATS."""
    return {role: BusCredentials(role, namespace, source)} if source is not None else {}


def tls_failure_message(exc: BusTlsError, tls: NatsTlsConfig, url: str) -> str:
    """One line for a failed TLS handshake: what failed and which setting to fix."""
    where = f"TLS to the NATS server at {url} failed ({exc.reason})"
    if not exc.verify_failed:
        return (f"{where}: it refused this client; mutual TLS needs security.nats_tls.cert_file and "
                "key_file, a certificate signed by the CA the server trusts")
    if "mismatch" in exc.reason or "not valid for" in exc.reason:
        return (f"{where}: the server's certificate does not name the address dialled; its "
                "subjectAltName must hold it (e.g. IP:127.0.0.1), see docs/security.md")
    if tls.enabled and tls.ca_file:
        return f"{where}: security.nats_tls.ca_file ({tls.ca_file}) is not the CA that signed the server's certificate"
    return (f"{where}: security.nats_tls.ca_file is not set, so the system's CA store was used; "
            "set it to the CA that signed the server's certificate")


class _AsyncioSslEofFilter(logging.Filter):
    """Drops asyncio's "returning true from eof_received() has no effect when using ssl". nats-py
    upgrades its plain socket to TLS in place (``loop.start_tls``), which never calls the new
    stream protocol's ``connection_made``, so that protocol does not know it is on TLS, answers
    EOF as a plain one would, and asyncio warns whenever the TLS peer hangs up (a refused
    handshake, the server closing). Harmless; every other asyncio record passes."""

    MESSAGE = "returning true from eof_received() has no effect when using ssl"

    def filter(self, record: logging.LogRecord) -> bool:
        return record.msg != self.MESSAGE


def quiet_asyncio_ssl_warning() -> None:
    """Install ``_AsyncioSslEofFilter`` on the asyncio logger, once per process."""
    logger = logging.getLogger("asyncio")
    if not any(isinstance(existing, _AsyncioSslEofFilter) for existing in logger.filters):
        logger.addFilter(_AsyncioSslEofFilter())
