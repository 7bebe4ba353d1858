"""Where a running mesh is: ``mesh.json`` in its run directory, and how to find the latest run.

Knows msgspec and the file system only, so CLI commands like ``submit`` and ``watch`` can find a
mesh without importing Ray.
"""

from __future__ import annotations

import os
import re
import time
import uuid
from pathlib import Path

import msgspec

MESH_FILE = "mesh.json"


class MeshInfo(msgspec.Struct, frozen=True, kw_only=True):
    # As clients must dial it: tls:// when the mesh speaks TLS to NATS (nats_url_for_clients).
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


def write_mesh_info(info: MeshInfo) -> Path:
    path = Path(info.run_dir) / MESH_FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(msgspec.json.format(msgspec.json.encode(info)))
    os.replace(tmp, path)  # readers polling for readiness never see half a file
    return path


def read_mesh_info(run_dir: str | Path | None, *, run_root: str | Path) -> MeshInfo:
    """The mesh of ``run_dir``, or of the latest run under ``run_root`` when run_dir is None."""
    directory = Path(run_dir) if run_dir else latest_run_dir(run_root)
    if directory is None:
        raise MeshNotFoundError(f"no runs under {run_root}; start one with `rollmesh up`")
    path = directory / MESH_FILE
    if not path.exists():
        raise MeshNotFoundError(f"{path} does not exist: is the mesh up?", run_dir=str(directory))
    return msgspec.json.decode(path.read_bytes(), type=MeshInfo)
