"""Where the code that runs inside sandboxes lives (the tool scripts and the guest's files),
and which Python runs it.

Knows the package layout and the standard library only. Tool scripts are data, not modules:
they run as ``python -I -S <script>`` inside a sandbox, so they import nothing of rollmesh and no
site packages. Paths are host paths; the sandbox backends show the tools at the same place
inside, and the guest's files where each backend says.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

from rollmesh.moved_names import forward_moved_names
from rollmesh.sandbox.errors import ToolNotFoundError

TOOLS_DIR = Path(__file__).resolve().parent / "tools"
GUEST_DIR = Path(__file__).resolve().parent
GUEST_FILES = ("guest.py", "guest_wire.py", "guest_files.py", "guest_transfers.py")  # stdlib only, run by SYSTEM_PYTHON
SYSTEM_PYTHON = "/usr/bin/python3"
# Commands in a sandbox get exactly PATH, HOME and LANG (plus what the exec adds): nothing of the
# broker's environment, so API keys and tokens of the actor never reach them.
SANDBOX_PATH = "/usr/local/bin:/usr/bin:/bin"
# The guest's own environment (commands get a fresh one from it). One malloc arena: the guest's
# address space stays small, which matters where it lends RLIMIT_AS to the commands it starts.
GUEST_ENV = {"PATH": SANDBOX_PATH, "LANG": "C.UTF-8", "MALLOC_ARENA_MAX": "1"}
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


# Deprecated names (issue 24: the guest was "agent"), removed in the next release.
__getattr__ = forward_moved_names(__name__, {
    "AGENT_DIR": "rollmesh.sandbox.tool_paths:GUEST_DIR",
    "AGENT_FILES": "rollmesh.sandbox.tool_paths:GUEST_FILES",
    "AGENT_ENV": "rollmesh.sandbox.tool_paths:GUEST_ENV",
})
