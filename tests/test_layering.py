"""The layering rules hold (``.importlinter``, CONTRIBUTING.md "Layers"), and the check that holds
them does catch each kind of forbidden import, including one inside a function.

import-linter runs in a subprocess so that it analyses the tree it is pointed at, not whichever
``rollmesh`` this test process imported first.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]
_LINT = ("import sys; from importlinter.cli import lint_imports; "
         "sys.exit(lint_imports(config_filename='.importlinter', no_cache=True, no_logo=True))")


def lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(root), "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-c", _LINT], cwd=root, env=env, capture_output=True,
                          text=True, timeout=120)


def test_no_package_imports_a_layer_it_must_not() -> None:
    result = lint_imports(REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


def test_the_check_fails_on_each_kind_of_forbidden_import(tmp_path: Path) -> None:
    shutil.copytree(REPO / "rollmesh", tmp_path / "rollmesh",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / ".importlinter", tmp_path)
    forbidden = {  # module -> a forbidden import it gains, written inside a function
        "engine/decode.py": "from rollmesh.bus.publisher import BusPublisher",
        "serve_apps/router_calls.py": "from rollmesh.actors.role_base import RoleActor",
        "bus/streams.py": "from rollmesh.rollout.tasks import Task",
        "messages/base.py": "import rollmesh.ports",
    }
    for module, statement in forbidden.items():
        with open(tmp_path / "rollmesh" / module, "a") as file:
            file.write(f"\n\ndef _layering_probe():\n    {statement}\n")

    result = lint_imports(tmp_path)
    assert result.returncode != 0
    for chain in ("rollmesh.engine.decode -> rollmesh.bus.publisher",
                  "rollmesh.serve_apps.router_calls -> rollmesh.actors.role_base",
                  "rollmesh.bus.streams -> rollmesh.rollout.tasks",
                  "rollmesh.messages.base -> rollmesh.ports"):
        assert chain in result.stdout, result.stdout
    assert "4 broken" in result.stdout, result.stdout
