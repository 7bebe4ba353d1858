"""What a mesh start imports: the launcher process (``rollmesh up``/``train``/``demo``) and every
role's actor module import without torch and transformers (seconds each, paid by every mesh start
and every Ray worker process); the roles that run a model import them when they build it.

Checked in a fresh interpreter, as a mesh start runs: this test process has imported torch long ago.
"""

from __future__ import annotations

import ast
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import rollmesh.actors

pytestmark = pytest.mark.unit

LAUNCHER_MODULES = (
    "rollmesh.cli.mesh",
    "rollmesh.cli.train",
    "rollmesh.cli.demo",
    "rollmesh.launcher",
    "rollmesh.mesh_runtime",
    "rollmesh.metrics_hub_shell",
)
ACTOR_MODULES = tuple(f"rollmesh.actors.{info.name}" for info in pkgutil.iter_modules(rollmesh.actors.__path__))


def imported_heavy_packages(code: str) -> list[str]:
    """Runs ``code`` in a new interpreter; the heavy packages it left in ``sys.modules``."""
    probe = code + "\nimport sys; print([p for p in ('torch', 'transformers') if p in sys.modules])"
    done = subprocess.run([sys.executable, "-c", probe], check=True, timeout=120, capture_output=True, text=True)
    return ast.literal_eval(done.stdout.strip().splitlines()[-1])


def test_the_launcher_and_every_role_module_import_without_torch() -> None:
    modules = [*LAUNCHER_MODULES, *ACTOR_MODULES]
    assert "rollmesh.actors.trainer" in modules and "rollmesh.actors.inference_workers" in modules
    assert imported_heavy_packages("; ".join(f"import {module}" for module in modules)) == []


def test_the_metrics_hub_opens_its_tensorboard_directory_without_torch(tmp_path: Path) -> None:
    """The hub runs in the launcher process; tensorboardX imports torch, so its writer waits for
    the first write (on the hub's tick thread)."""
    code = ("from pathlib import Path; from rollmesh.telemetry.metrics_tensorboard import TensorBoardScalars; "
            f"scalars = TensorBoardScalars(Path({str(tmp_path)!r})); assert scalars.directory.is_dir()")
    assert imported_heavy_packages(code) == []


def test_tensorboard_scalars_are_written_once_the_writer_is_made(tmp_path: Path) -> None:
    from rollmesh.telemetry.metrics_aggregate import AggregatedMetric, AggregatedPoint
    from rollmesh.telemetry.metrics_tensorboard import TensorBoardScalars

    scalars = TensorBoardScalars(tmp_path)
    metric = AggregatedMetric("rollmesh_generated_tokens", "counter", "tokens", "1",
                              points={(): AggregatedPoint(labels={}, value=3.0)})
    assert scalars.write([metric], now=1.0) == 1
    scalars.close()
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
