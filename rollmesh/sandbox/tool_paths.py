"""Where the tool scripts that run inside sandboxes live, and which Python runs them.

Knows the package layout and the standard library only. Tool scripts are data, not modules:
they run as ``python -I -S <script>`` inside a sandbox, so they import nothing of rollmesh and no
site packages. Paths are host paths; the sandbox backends show them at the same place inside.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

from rollmesh.sandbox.errors import ToolNotFoundError

TOOLS_DIR = Path(__file__).resolve().parent / "tools"
SYSTEM_PYTHON = "/usr/bin/python3"
_TOOL_NAME = re.compile(r"[a-z][a-z0-9_]*")


def tool_script_path(name: str) -> Path:
    """``tool_script_path("molar_mass")`` -> ``.../rollmesh/sandbox/tools/molar_mass.py``."""
    # The name may come from a model's tool call: only plain names, never a path.
    if not _TOOL_NAME.fullmatch(name):
        raise ToolNotFoundError(f"not a tool name: {name!r}", tool=name)
    path = TOOLS_DIR / f"{name}.py"
    if not path.is_file():
        raise ToolNotFoundError(f"no sandbox tool named {name!r}", tool=name)
    return path


def python_for_sandbox() -> str:
    """The system Python when there is one: it lives under /usr, which every sandbox shows,
    while a virtualenv's interpreter may sit below a directory a sandbox hides."""
    if os.access(SYSTEM_PYTHON, os.X_OK):
        return SYSTEM_PYTHON
    return sys.executable
