"""Every connection rollmesh makes into a mesh's NATS goes through ``MeshAddress.connect``
(issue 24: one type for where the mesh is, with one ``connect``): nothing in ``rollmesh/`` but
that method calls ``bus.connection.connect_bus``. And the check does catch a call elsewhere.

Read from the source (``ast``), so a call in a function that no test runs counts too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

PACKAGE = Path(__file__).resolve().parents[1] / "rollmesh"
# (file relative to the package, the function holding the call)
ALLOWED = {("mesh_address.py", "MeshAddress.connect")}


def connect_bus_calls(package: Path) -> set[tuple[str, str]]:
    """Each ``connect_bus(...)`` call under ``package``: (file, qualified name of its function)."""
    found: set[tuple[str, str]] = set()
    for path in sorted(package.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        relative = path.relative_to(package).as_posix()

        def visit(node: ast.AST, scope: tuple[str, ...]) -> None:
            if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                scope = (*scope, node.name)
            if isinstance(node, ast.Call):
                func = node.func
                name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
                if name == "connect_bus":
                    found.add((relative, ".".join(scope)))
            for child in ast.iter_child_nodes(node):
                visit(child, scope)

        visit(tree, ())
    return found


def test_only_mesh_address_connect_calls_connect_bus() -> None:
    assert connect_bus_calls(PACKAGE) == ALLOWED


def test_the_check_finds_a_connect_bus_call_anywhere_else(tmp_path: Path) -> None:
    (tmp_path / "mesh_address.py").write_text(
        "class MeshAddress:\n    async def connect(self):\n        return await connect_bus('u', name='n')\n")
    (tmp_path / "shell.py").write_text(
        "from rollmesh.bus import connection\n\nclass Shell:\n    async def start(self):\n"
        "        self.nc = await connection.connect_bus('u', name='n')\n")
    assert connect_bus_calls(tmp_path) == {*ALLOWED, ("shell.py", "Shell.start")}
