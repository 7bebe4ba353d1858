"""The host's Python, shown read-only at a private path inside a sandbox whose root is an image,
so the stdlib-only guest runs whatever the root holds (a minimal Debian has no Python at all).

Knows ELF loading as ``ldd`` reports it and the interpreter's own sysconfig; nothing of bwrap or
sandboxes. Inside, the interpreter is started through the host's dynamic loader with
``--library-path`` (``ld.so --library-path /.rollmesh/python/lib python3 ...``): its libraries
come from the private directory while the root's own ``/lib`` stays what the root's tools see,
and no ``LD_LIBRARY_PATH`` leaks into the commands the guest starts. ``ldd`` (glibc's) is used
rather than an ELF parser of our own: it is how glibc itself resolves what the loader will load.
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

from rollmesh.sandbox.errors import BackendUnavailableError

PRIVATE_PYTHON = "/.rollmesh/python"
_PROBE = ("import json, sys, sysconfig; print(json.dumps({'stdlib': sysconfig.get_path('stdlib'), "
          "'dynload': sysconfig.get_path('platstdlib') + '/lib-dynload', 'executable': sys.executable}))")


@dataclass(frozen=True, slots=True)
class HostPython:
    """What to bind (host path -> path inside) and the argv prefix that starts it inside."""

    binds: tuple[tuple[str, str], ...]
    argv: tuple[str, ...]


def host_python(python: str) -> HostPython:
    """The bundle of the host interpreter ``python`` (its binary, standard library, the shared
    libraries it and its extension modules load, and the loader); BackendUnavailableError when
    it cannot be worked out."""
    try:
        found = json.loads(subprocess.run([python, "-I", "-S", "-c", _PROBE], capture_output=True, text=True,
                                          timeout=30, check=True).stdout)
    except (OSError, subprocess.SubprocessError, ValueError) as exc:
        raise BackendUnavailableError("cannot inspect the host Python for image roots", backend="bwrap",
                                      reason=f"{python}: {exc}") from exc
    stdlib, dynload = Path(found["stdlib"]), Path(found["dynload"])
    if dynload.parent != stdlib:
        raise BackendUnavailableError("the host Python's lib-dynload is not inside its stdlib", backend="bwrap",
                                      reason=f"{dynload} vs {stdlib}")
    binary = os.path.realpath(python)
    libraries, loader = _shared_libraries([binary, *map(str, sorted(dynload.glob("*.so")))])
    inside_lib = f"{PRIVATE_PYTHON}/lib"
    binds = [(binary, f"{PRIVATE_PYTHON}/bin/python3"), (str(stdlib), f"{inside_lib}/{stdlib.name}"),
             (loader, f"{inside_lib}/{Path(loader).name}")]
    binds += [(path, f"{inside_lib}/{name}") for name, path in sorted(libraries.items())]
    argv = (f"{inside_lib}/{Path(loader).name}", "--library-path", inside_lib, f"{PRIVATE_PYTHON}/bin/python3")
    return HostPython(tuple(binds), argv)


def _shared_libraries(files: list[str]) -> tuple[dict[str, str], str]:
    """{soname: host path} of what ``files`` load, and the loader they name."""
    libraries: dict[str, str] = {}
    loader = ""
    for path in files:
        try:
            out = subprocess.run(["ldd", path], capture_output=True, text=True, timeout=30, check=False).stdout
        except (OSError, subprocess.SubprocessError) as exc:
            raise BackendUnavailableError("ldd failed on the host Python", backend="bwrap",
                                          reason=f"{path}: {exc}") from exc
        for line in out.splitlines():
            words = line.split()
            if len(words) >= 3 and words[1] == "=>" and words[2].startswith("/"):
                libraries[words[0]] = os.path.realpath(words[2])
            elif words and words[0].startswith("/") and "ld-linux" in words[0]:
                loader = os.path.realpath(words[0])
    if not loader:
        raise BackendUnavailableError("ldd named no dynamic loader for the host Python", backend="bwrap",
                                      reason=files[0])
    return libraries, loader
