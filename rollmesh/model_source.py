"""Which model directory a mesh runs: ``model.path``, or the demo's model built in the run directory.

Knows the config tree and the demo model's builder; nothing of Ray or NATS. Resolved once, where a
mesh or the inference service starts, so every actor receives an absolute ``model.path`` (actors
may run in another working directory) and none of them builds a model of its own.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import msgspec
import structlog

from rollmesh.config import RollmeshConfig

_log = structlog.get_logger("rollmesh.model_source")

DEMO_MODEL_DIR = "demo-model"


class ModelPathError(ValueError):
    """``model.path`` names no model directory."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"model.path {path!r}: {reason}")
        self.path = path
        self.reason = reason


def resolve_model(config: RollmeshConfig, run_dir: Path) -> RollmeshConfig:
    """``config`` with ``model.path`` absolute; when it is empty, the demo model built into
    ``<run_dir>/demo-model`` (kept across ``up --resume``: the same files, from ``demo.seed``)."""
    if config.model.path:
        path = Path(config.model.path).expanduser().absolute()
        if not (path / "config.json").is_file():
            raise ModelPathError(config.model.path, "not a model directory (no config.json)")
    else:
        path = ensure_demo_model(Path(run_dir) / DEMO_MODEL_DIR, seed=config.demo.seed)
    model = msgspec.structs.replace(config.model, path=str(path))
    return msgspec.structs.replace(config, model=model)


def ensure_demo_model(directory: Path, *, seed: int) -> Path:
    """The demo model at ``directory``, built there unless a complete one is already there."""
    from rollmesh.demo.demo_model import build_demo_model

    directory = directory.absolute()
    if (directory / "config.json").is_file():
        return directory
    staging = directory.with_name(directory.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    build_demo_model(staging, seed=seed)
    staging.replace(directory)  # config.json appears only in a complete directory
    _log.info("demo_model_built", path=str(directory), seed=seed)
    return directory
