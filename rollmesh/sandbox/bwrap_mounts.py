"""The root filesystem of a bubblewrap sandbox as bwrap arguments: the host's minimal read-only
view (``root = "host"``) or an image's unpacked root (``dir:`` / ``oci:``), both laid on bwrap's
own tmpfs so the synthesized ``/etc`` files and rollmesh's private mounts always have a place.

Knows bwrap's mount options and the layout of a root directory; nothing of limits, cgroups,
leases or how an image was made. An image root is shown entry by entry (never bound whole at
``/``), and a top-level symlink of the image becomes a bwrap ``--symlink``: binding it would make
bwrap resolve it on the host (an image's ``usr -> /etc`` would show the host's ``/etc``). ``/etc``
is a fresh directory with each of the image's entries bound in, so passwd, group and hosts can
be synthesized whatever the image holds.
"""

from __future__ import annotations

import os
from pathlib import Path

MERGED_USR_LINKS = ("bin", "lib", "lib64", "lib32", "libx32", "sbin")
ETC_FILES = ("ld.so.cache", "ld.so.conf", "nsswitch.conf", "localtime", "alternatives", "mime.types")
ETC_NETWORK_FILES = ("resolv.conf", "hosts", "gai.conf", "ssl", "ca-certificates")
# Made by the sandbox itself (or synthesized), never taken from an image.
_OWN_TOP = frozenset({"proc", "dev", "tmp", "sys", "workspace", ".rollmesh", "etc"})
_OWN_ETC = frozenset({"passwd", "group", "hosts"})


def host_root_args(*, network: bool) -> list[str]:
    """``/usr`` read-only, the merged-usr links as on the host, a few ``/etc`` files (with
    network also resolv.conf and the CA store)."""
    args = ["--ro-bind", "/usr", "/usr"]
    for link in MERGED_USR_LINKS:
        host = Path("/") / link
        if host.is_symlink():
            args += ["--symlink", os.readlink(host), str(host)]
        elif host.is_dir():
            args += ["--ro-bind", str(host), str(host)]
    args += ["--perms", "0755", "--dir", "/etc"]
    for name in (*ETC_FILES, *(ETC_NETWORK_FILES if network else ())):
        host = Path("/etc") / name
        if host.is_symlink() and os.readlink(host).startswith("/usr/"):
            args += ["--symlink", os.readlink(host), str(host)]
        elif host.exists():
            args += ["--ro-bind", str(host), str(host)]
    return args


def image_root_args(root: Path, *, network: bool) -> list[str]:
    """Every top-level entry of the unpacked ``root`` read-only at ``/<entry>`` (symlinks as
    symlinks), and ``/etc`` rebuilt from the image's entries but passwd, group and hosts; with
    network, the host's resolv.conf (an image's own is what its build machine had, or nothing).
    Computed once per image: a sandbox start only replays the list."""
    args: list[str] = []
    for entry in sorted(root.iterdir()):
        if entry.name in _OWN_TOP:
            continue
        args += _entry_args(entry, f"/{entry.name}")
    args += ["--perms", "0755", "--dir", "/etc"]
    etc = root / "etc"
    if etc.is_dir() and not etc.is_symlink():
        for entry in sorted(etc.iterdir()):
            if entry.name not in _OWN_ETC and not (network and entry.name == "resolv.conf"):
                args += _entry_args(entry, f"/etc/{entry.name}")
    resolv = Path("/etc/resolv.conf")
    if network and resolv.exists():
        args += ["--ro-bind", str(resolv.resolve()), "/etc/resolv.conf"]
    return args


def _entry_args(entry: Path, inside: str) -> list[str]:
    if entry.is_symlink():
        return ["--symlink", os.readlink(entry), inside]
    if entry.is_dir() or entry.is_file():
        return ["--ro-bind", str(entry), inside]
    return []  # sockets, fifos: nothing a root needs


def shown_in_image(root: Path, paths: list[str]) -> list[str]:
    """Those of the host ``paths`` (shown at the same place inside) that can be mounted in the
    image ``root``: bwrap cannot make a mount point inside a directory the image itself binds
    read-only, so a path below one of the image's own top-level directories must already exist
    there (``/opt/x`` when the image has ``/opt`` but no ``/opt/x`` is left out)."""
    shown = []
    for path in paths:
        parts = Path(path).parts[1:]
        top = root / parts[0] if parts else root
        if not (top.exists() or top.is_symlink()) or (root / Path(*parts)).is_dir():
            shown.append(path)
    return shown
