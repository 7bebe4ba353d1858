"""Sandbox images: what each profile's sandboxes are made of (``root``, ``python``,
``network_allow``), made ready once, before any lease, at broker start.

Knows the profile config, the OCI unpacker (``oci_layout``), the environment builder
(``python_env``) and the bwrap root arguments; nothing of leases or the bus. A profile that keeps
the defaults (host root, no environment, no egress) gets no image: its sandboxes are exactly
today's. Every failure is an ``ImageBuildError`` naming the profile, so a broker with a broken
image refuses to start instead of failing leases one by one::

    root = "host"          the host's minimal read-only view (/usr, a few /etc files)
    root = "dir:PATH"      an unpacked root filesystem (debootstrap, an exported container)
    root = "oci:PATH"      an OCI image layout or docker-save tarball, unpacked once into
                           <cache>/roots/<manifest digest>
    python = {...}         a venv per content hash in <cache>/envs/<hash>, at /.rollmesh/venv
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from rollmesh.sandbox.bwrap_mounts import host_root_args, image_root_args
from rollmesh.sandbox.errors import ImageBuildError, SandboxError
from rollmesh.sandbox.oci_layout import unpack_image
from rollmesh.sandbox.python_env import build_env
from rollmesh.sandbox.tool_paths import SYSTEM_PYTHON
from rollmesh.sandbox_config import SandboxConfig, SandboxProfileConfig

_PYTHONS = ("usr/local/bin/python3", "usr/bin/python3", "bin/python3")


@dataclass(frozen=True, slots=True)
class SandboxImage:
    """A profile's prepared image. ``root_dir`` None: the host's minimal view."""

    profile: str
    root_dir: Path | None = None
    venv: Path | None = None
    network_allow: tuple[str, ...] = ()

    def describe(self) -> str:
        parts = [f"root {self.root_dir}" if self.root_dir is not None else "host root"]
        if self.venv is not None:
            parts.append(f"python env {self.venv.name}")
        if self.network_allow:
            parts.append(f"egress to {', '.join(self.network_allow)}")
        return ", ".join(parts)


def needs_image(profile: SandboxProfileConfig) -> bool:
    return profile.root != "host" or profile.python is not None or bool(profile.network_allow)


def prepare_images(config: SandboxConfig, *, cache_dir: Path, bwrap: str | None = None) -> dict[str, SandboxImage]:
    """The image of every profile that asks for one, unpacked and built now (or found in
    ``cache_dir``). ``bwrap``: the bubblewrap binary environments are built with (default: on
    PATH)."""
    images: dict[str, SandboxImage] = {}
    for name in config.profile_names():
        profile = config.profile(name)
        assert profile is not None
        if not needs_image(profile):
            continue
        try:
            images[name] = _prepare(name, profile, cache_dir, bwrap or shutil.which("bwrap"))
        except ImageBuildError:
            raise
        except (SandboxError, OSError, ValueError) as exc:
            raise ImageBuildError("its image could not be made ready", profile=name, reason=str(exc)) from exc
    return images


def _prepare(name: str, profile: SandboxProfileConfig, cache_dir: Path, bwrap: str | None) -> SandboxImage:
    kind, _, where = profile.root.partition(":")
    root_dir: Path | None = None
    if kind == "dir":
        root_dir = Path(where).resolve()
        if not root_dir.is_dir():
            raise ImageBuildError("its root is not a directory", profile=name, reason=str(root_dir))
        root_key = f"dir:{root_dir}"
    elif kind == "oci":
        cache_dir.mkdir(parents=True, exist_ok=True)
        cache_dir.chmod(cache_dir.stat().st_mode | 0o755)
        root_dir = unpack_image(where, cache_dir)
        root_key = root_dir.name
    else:
        root_key = f"host:{os.path.realpath(SYSTEM_PYTHON)}:{_mtime(SYSTEM_PYTHON)}"
    venv = None
    if profile.python is not None:
        if bwrap is None:
            raise ImageBuildError("a python environment is built in a bubblewrap sandbox, and there is no bwrap",
                                  profile=name, reason="install bubblewrap")
        root_args = image_root_args(root_dir, network=False) if root_dir else host_root_args(network=False)
        cache_dir.mkdir(parents=True, exist_ok=True)
        venv = build_env(name, profile.python, bwrap=bwrap, root_args=root_args,
                         root_python=_root_python(name, root_dir), root_key=root_key, cache_dir=cache_dir)
    for path in (root_dir, venv):
        if path is not None:
            _check_reachable(name, path)
    return SandboxImage(name, root_dir, venv, tuple(profile.network_allow))


def _root_python(profile: str, root_dir: Path | None) -> str:
    if root_dir is None:
        return SYSTEM_PYTHON
    for candidate in _PYTHONS:
        if os.path.lexists(root_dir / candidate):
            return f"/{candidate}"
    raise ImageBuildError("its root has no python3 to build the python environment with", profile=profile,
                          reason=f"none of {', '.join('/' + p for p in _PYTHONS)} in {root_dir}")


def _check_reachable(profile: str, path: Path) -> None:
    """When sandboxes run as their own uids (the broker is root), what they mount must be
    reachable by any uid: bwrap makes its mounts as the sandbox's user."""
    if os.geteuid() != 0:
        return
    for directory in [path, *path.parents]:
        if not directory.stat().st_mode & 0o001:
            raise ImageBuildError("its image is not reachable by the sandboxes' uids", profile=profile,
                                  reason=f"{directory} is not world-executable (chmod o+x, or set "
                                         "sandbox.image_cache_dir elsewhere)")


def _mtime(path: str) -> int:
    try:
        return int(os.stat(path).st_mtime)
    except OSError:
        return 0
