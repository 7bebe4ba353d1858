"""A profile's Python environment: a virtual environment made by the root's own ``python3`` and
filled with wheels the host's pip fetched, built once per content hash into
``<cache>/envs/<hash>`` and shown read-only at ``/.rollmesh/venv`` inside the sandboxes.

Knows bwrap's command line (a short-lived build sandbox with the profile's root), the venv
module and pip's command line; nothing of leases or limits. Three steps, so the tools see exactly
the interpreter the environment was made for and the host's pip config (index, find-links,
certificates, constraints) applies as the operator set it:

1. in a build sandbox with the root (no network): ``python3 -m venv --without-pip`` at
   ``/.rollmesh/venv`` (the path it will have in every sandbox: its scripts name it), and a probe
   of that interpreter's version, implementation, machine and glibc;
2. on the host: ``pip download --only-binary=:all:`` for those tags (so wheels only);
3. in a build sandbox again (no network): the host's pip package, run by the venv's python,
   installs from those wheels alone (``--no-index --isolated``).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from rollmesh.sandbox.cache_dirs import staged_dir
from rollmesh.sandbox.errors import ImageBuildError
from rollmesh.sandbox.tool_paths import SANDBOX_PATH
from rollmesh.sandbox_config import SandboxPythonConfig

ENV_MOUNT = "/.rollmesh/venv"
BUILD_TIMEOUT_S = 1800.0
_PROBE = """
import json, os, platform, sys, venv
venv.EnvBuilder(symlinks=True, with_pip=False).create(sys.argv[1])
libc = os.confstr("CS_GNU_LIBC_VERSION") if hasattr(os, "confstr") else ""
print(json.dumps({"version": "%d%d" % sys.version_info[:2], "implementation": sys.implementation.name,
                  "machine": platform.machine(), "libc": libc or ""}))
"""


def env_key(python: SandboxPythonConfig, root_key: str) -> str:
    """The content hash naming an environment: the root it is built for and what goes in."""
    requirements = Path(python.requirements).read_text() if python.requirements else ""
    text = json.dumps([root_key, python.packages, requirements, python.no_deps])
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def build_env(profile: str, python: SandboxPythonConfig, *, bwrap: str, root_args: Sequence[str],
              root_python: str, root_key: str, cache_dir: Path) -> Path:
    """The environment's directory, built now unless the cache already holds it;
    ImageBuildError (naming the profile and what failed) otherwise."""
    if python.requirements and not Path(python.requirements).is_file():
        raise ImageBuildError("python.requirements is not a file", profile=profile, reason=python.requirements)
    final = cache_dir / "envs" / env_key(python, root_key)
    if (final / "pyvenv.cfg").is_file():
        return final
    with staged_dir(final, built=lambda done: (done / "pyvenv.cfg").is_file()) as staging, \
            tempfile.TemporaryDirectory(prefix="rollmesh-wheels-") as wheels:
        Path(wheels).chmod(0o755)
        probe = _sandboxed(profile, "making the virtual environment", bwrap, root_args,
                           [(str(staging), ENV_MOUNT, True)],
                           [root_python, "-I", "-c", _PROBE, ENV_MOUNT])
        tags = json.loads(probe.strip().splitlines()[-1])
        _download(profile, python, tags, wheels)
        _install(profile, python, bwrap, root_args, staging, wheels)
    return final


def _download(profile: str, python: SandboxPythonConfig, tags: dict, wheels: str) -> None:
    if tags["implementation"] != "cpython" or not tags["libc"].startswith("glibc "):
        raise ImageBuildError("the root's python3 is not CPython on glibc (only manylinux wheels are fetched)",
                              profile=profile, reason=f"{tags['implementation']}, {tags['libc'] or 'no glibc'}")
    machine, minor = tags["machine"], int(tags["libc"].split()[1].split(".")[1])
    platforms = [f"manylinux_2_{m}_{machine}" for m in range(minor, 4, -1)]
    platforms += [f"manylinux2014_{machine}", f"manylinux2010_{machine}", f"manylinux1_{machine}", f"linux_{machine}"]
    argv = [sys.executable, "-m", "pip", "download", "--dest", wheels, "--only-binary=:all:", "--quiet",
            "--python-version", tags["version"], "--implementation", "cp",
            *(f"--abi={abi}" for abi in (f"cp{tags['version']}", "abi3", "none")),
            *(f"--platform={name}" for name in platforms)]
    argv += _what(python, requirements=python.requirements)
    _run(profile, "fetching its packages with the host's pip", argv)


def _install(profile: str, python: SandboxPythonConfig, bwrap: str, root_args: Sequence[str], staging: Path,
             wheels: str) -> None:
    spec = importlib.util.find_spec("pip")
    if spec is None or spec.origin is None:
        raise ImageBuildError("the host has no pip to install packages with", profile=profile,
                              reason=f"no pip for {sys.executable}")
    binds = [(str(staging), ENV_MOUNT, True), (wheels, "/.rollmesh/wheels", False),
             (str(Path(spec.origin).parent), "/.rollmesh/pip/pip", False)]
    requirements = None
    if python.requirements:
        binds.append((str(Path(python.requirements).resolve()), "/.rollmesh/requirements.txt", False))
        requirements = "/.rollmesh/requirements.txt"
    argv = [f"{ENV_MOUNT}/bin/python", "/.rollmesh/pip/pip", "install", "--isolated", "--no-index",
            "--find-links", "/.rollmesh/wheels", "--no-cache-dir", "--disable-pip-version-check", "--quiet",
            "--no-warn-script-location", *_what(python, requirements=requirements)]
    _sandboxed(profile, "installing its packages", bwrap, root_args, binds, argv)


def _what(python: SandboxPythonConfig, *, requirements: str | None) -> list[str]:
    return [*(["--no-deps"] if python.no_deps else []), *python.packages,
            *(["-r", requirements] if requirements else [])]


def _sandboxed(profile: str, step: str, bwrap: str, root_args: Sequence[str],
               binds: Sequence[tuple[str, str, bool]], argv: Sequence[str]) -> str:
    """Run ``argv`` in a build sandbox: the profile's root, no network, no capabilities, a private
    /tmp, and ``binds`` (host path, path inside, writable)."""
    args = [bwrap, "--unshare-all", "--die-with-parent", "--new-session", "--cap-drop", "ALL", *root_args,
            "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp", "--dir", "/.rollmesh"]
    for source, inside, writable in binds:
        args += ["--bind" if writable else "--ro-bind", source, inside]
    args += ["--chdir", "/tmp", "--clearenv", "--setenv", "PATH", SANDBOX_PATH, "--setenv", "HOME", "/tmp",
             "--setenv", "LANG", "C.UTF-8", "--", *argv]
    return _run(profile, step, args)


def _run(profile: str, step: str, argv: Sequence[str]) -> str:
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, check=False)
    except (OSError, subprocess.SubprocessError) as exc:
        raise ImageBuildError(f"its Python environment failed while {step}", profile=profile,
                              reason=str(exc)) from exc
    if done.returncode != 0:
        tail = "\n".join(done.stderr.strip().splitlines()[-15:])
        raise ImageBuildError(f"its Python environment failed while {step}", profile=profile,
                              reason=f"exit status {done.returncode}: {tail}")
    return done.stdout
