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
    # Each package gains one forbidden import, written inside a function (packages, not their
    # modules, so that renaming a module leaves this test as it is).
    forbidden = {"engine": "rollmesh.bus", "serve_apps": "rollmesh.actors",
                 "bus": "rollmesh.rollout", "messages": "rollmesh.config"}
    for package, target in forbidden.items():
        with open(tmp_path / "rollmesh" / package / "__init__.py", "a") as file:
            file.write(f"\n\ndef _layering_probe():\n    import {target}\n")

    result = lint_imports(tmp_path)
    assert result.returncode != 0
    for package, target in forbidden.items():
        assert f"rollmesh.{package} -> {target} " in result.stdout, result.stdout
    assert "4 broken" in result.stdout, result.stdout
