"""OCI images as sandbox roots: read an OCI image layout (a directory with ``index.json`` and
``blobs/``) or a ``docker save`` tarball, and unpack its layers once into a content-addressed
cache (``<cache>/roots/<manifest digest>``).

Knows the OCI image spec (index, manifest, layer media types, whiteouts) and tarfile; nothing of
sandboxes, profiles or config. Extraction is written here rather than left to tarfile's
``data_filter`` because that filter refuses the absolute symlinks every Debian image holds
(``/etc/alternatives/*``: they resolve inside the sandbox's root at run time, never on the host)
and knows no whiteouts. What it must refuse it refuses, with ``UnsafeImageError``: names that
are absolute or climb out with ``..``, members that would be written through a symlink (a lower
layer's ``evil -> /etc`` then ``evil/passwd``), hard links to outside the root. Nothing here ever
follows a link on the host: parents are checked with lstat and files opened with O_NOFOLLOW.
Device nodes and fifos are skipped (an unprivileged broker cannot make them; each sandbox gets
its own ``/dev``); owners are not kept (the root is shown read-only), setuid bits are dropped.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import tarfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

from rollmesh.sandbox.cache_dirs import staged_dir
from rollmesh.sandbox.errors import ImageLayoutError, UnsafeImageError

_INDEX_TYPES = ("application/vnd.oci.image.index.v1+json",
                "application/vnd.docker.distribution.manifest.list.v2+json")
_OPAQUE = ".wh..wh..opq"
_WHITEOUT = ".wh."
_ARCH = {"x86_64": "amd64", "aarch64": "arm64"}.get(platform.machine(), platform.machine())
_COPY_CHUNK = 1 << 20


class _Blobs:
    """Blobs by path inside the image (``blobs/sha256/<hex>``, ``<id>/layer.tar``): files of a
    layout directory, or members of a tarball."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._tar = tarfile.open(path) if path.is_file() else None  # noqa: SIM115 - closed in close()
        self._names = ({m.name.removeprefix("./"): m for m in self._tar.getmembers() if m.isfile()}
                       if self._tar is not None else {})

    def has(self, name: str) -> bool:
        return name in self._names if self._tar is not None else (self.path / name).is_file()

    @contextmanager
    def open(self, name: str) -> Iterator[IO[bytes]]:
        if not self.has(name):
            raise ImageLayoutError("not an OCI image layout or docker-save tarball", image=str(self.path),
                                   reason=f"{name} is missing")
        if self._tar is None:
            with open(self.path / name, "rb") as handle:
                yield handle
        else:
            handle = self._tar.extractfile(self._names[name])
            assert handle is not None
            yield handle

    def read(self, name: str) -> bytes:
        with self.open(name) as handle:
            return handle.read()

    def close(self) -> None:
        if self._tar is not None:
            self._tar.close()


def image_key(path: Path) -> str:
    """The image's content address: the digest of its manifest (what names it in the cache)."""
    blobs = _Blobs(path)
    try:
        return _manifest(blobs)[0]
    finally:
        blobs.close()


def unpack_image(path: str | Path, cache_dir: Path) -> Path:
    """The unpacked root of the image at ``path`` under ``cache_dir/roots/``, unpacked now unless
    an earlier call (any run sharing the cache) already did. Unpacked into a temporary directory
    and renamed into place, so a crash never leaves a half root under the digest's name."""
    path = Path(path)
    if not path.exists():
        raise ImageLayoutError("no image there", image=str(path), reason="the path does not exist")
    blobs = _Blobs(path)
    try:
        key, layers = _manifest(blobs)
        final = cache_dir / "roots" / key.replace(":", "-")
        if final.is_dir():
            return final
        with staged_dir(final, built=Path.is_dir) as staging:
            modes: dict[Path, int] = {}
            for name, media_type, digest in layers:
                _apply_layer(blobs, name, media_type, digest, staging, modes, image=str(path))
            for directory, mode in sorted(modes.items(), key=lambda item: -len(item[0].parts)):
                if directory.is_dir() and not directory.is_symlink():
                    directory.chmod(mode)
            staging.chmod(0o755)
        return final
    finally:
        blobs.close()


# -- reading the layout ------------------------------------------------------------------------


def _manifest(blobs: _Blobs) -> tuple[str, list[tuple[str, str, str]]]:
    """(cache key, [(blob name, media type, digest)] in the order layers apply)."""
    image = str(blobs.path)
    if blobs.has("index.json"):
        descriptor = _pick(_json(blobs, "index.json", image), image)
        while descriptor.get("mediaType") in _INDEX_TYPES:
            descriptor = _pick(_json(blobs, _blob_name(descriptor, image), image), image)
        name = _blob_name(descriptor, image)
        manifest = _json(blobs, name, image, digest=descriptor["digest"])
        layers = [(_blob_name(layer, image), str(layer.get("mediaType", "")), layer["digest"])
                  for layer in manifest.get("layers", [])]
        return descriptor["digest"], layers
    if blobs.has("manifest.json"):  # docker save before Docker 25: <id>/layer.tar, uncompressed or gzip
        raw = blobs.read("manifest.json")
        entries = json.loads(raw)
        if not isinstance(entries, list) or not entries or "Layers" not in entries[0]:
            raise ImageLayoutError("not a docker-save tarball", image=image, reason="manifest.json has no Layers")
        return "sha256:" + hashlib.sha256(raw).hexdigest(), [(str(n), "", "") for n in entries[0]["Layers"]]
    raise ImageLayoutError("not an OCI image layout or docker-save tarball", image=image,
                           reason="neither index.json nor manifest.json is there")


def _pick(index: dict, image: str) -> dict:
    """The index's manifest for this machine (linux and its architecture), else its only one."""
    manifests = index.get("manifests") or []
    if not manifests:
        raise ImageLayoutError("the image index lists no manifests", image=image)
    for descriptor in manifests:
        found = descriptor.get("platform") or {}
        if found.get("os", "linux") == "linux" and found.get("architecture", _ARCH) == _ARCH:
            return descriptor
    if len(manifests) == 1:
        return manifests[0]
    raise ImageLayoutError("the image has no manifest for this machine", image=image, reason=f"linux/{_ARCH}")


def _blob_name(descriptor: dict, image: str) -> str:
    algorithm, _, hexdigest = str(descriptor.get("digest", "")).partition(":")
    if algorithm != "sha256" or len(hexdigest) != 64 or not all(c in "0123456789abcdef" for c in hexdigest):
        raise ImageLayoutError("a descriptor's digest is not sha256:<64 hex>", image=image,
                               reason=repr(descriptor.get("digest")))
    return f"blobs/sha256/{hexdigest}"


def _json(blobs: _Blobs, name: str, image: str, *, digest: str = "") -> dict:
    raw = blobs.read(name)
    if digest and "sha256:" + hashlib.sha256(raw).hexdigest() != digest:
        raise ImageLayoutError("a blob's bytes do not match its digest", image=image, reason=name)
    try:
        return json.loads(raw)
    except ValueError as exc:
        raise ImageLayoutError("a blob is not JSON", image=image, reason=f"{name}: {exc}") from exc


# -- applying layers ---------------------------------------------------------------------------


def _apply_layer(blobs: _Blobs, name: str, media_type: str, digest: str, root: Path,
                 modes: dict[Path, int], *, image: str) -> None:
    if "zstd" in media_type:
        raise ImageLayoutError("zstd-compressed layers are not supported (Python's tarfile reads gzip, "
                               "bzip2 and xz)", image=image, reason=name)
    if digest:
        hasher = hashlib.sha256()
        with blobs.open(name) as handle:
            while chunk := handle.read(_COPY_CHUNK):
                hasher.update(chunk)
        if "sha256:" + hasher.hexdigest() != digest:
            raise ImageLayoutError("a layer's bytes do not match its digest", image=image, reason=name)
    with blobs.open(name) as handle, tarfile.open(fileobj=handle, mode="r:*") as tar:
        members = tar.getmembers()
        # Whiteouts hide what lower layers hold, never what this layer adds: apply them first.
        for member in members:
            parts = _parts(member.name, image)
            if not parts or not parts[-1].startswith(_WHITEOUT):
                continue
            directory = _parent(root, parts[:-1], image, member.name, create=False)
            if directory is None:
                continue  # hides something no lower layer has
            if parts[-1] == _OPAQUE:
                for child in directory.iterdir():
                    _remove(child)
            else:
                _remove(directory / parts[-1][len(_WHITEOUT):])
        for member in members:
            parts = _parts(member.name, image)
            if parts and not parts[-1].startswith(_WHITEOUT):
                _extract(tar, member, parts, root, modes, image)


def _extract(tar: tarfile.TarFile, member: tarfile.TarInfo, parts: list[str], root: Path,
             modes: dict[Path, int], image: str) -> None:
    parent = _parent(root, parts[:-1], image, member.name)
    assert parent is not None
    target = parent / parts[-1]
    if member.isdir():
        if target.is_symlink() or (target.exists() and not target.is_dir()):
            _remove(target)
        target.mkdir(mode=0o755, exist_ok=True)
        modes[target] = (member.mode & 0o777) | 0o700  # ours to write until the end, then as listed
        return
    if not (member.isfile() or member.issym() or member.islnk()):
        return  # devices and fifos: see the module docstring
    _remove(target)
    if member.issym():
        os.symlink(member.linkname, target)
    elif member.islnk():
        try:
            source_parts = _parts(member.linkname, image)
        except UnsafeImageError as exc:
            raise UnsafeImageError("a hard link points out of the root", image=image, member=member.name,
                                   reason=f"target {member.linkname!r}") from exc
        source_dir = _parent(root, source_parts[:-1], image, member.name, create=False)
        source = (source_dir or root) / (source_parts[-1] if source_parts else "")
        if source_dir is None or not source_parts or source.is_symlink() or not source.is_file():
            raise UnsafeImageError("a hard link's target is not a regular file of the image", image=image,
                                   member=member.name, reason=f"target {member.linkname!r}")
        os.link(source, target, follow_symlinks=False)
    else:
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as out, tar.extractfile(member) as data:  # type: ignore[union-attr]
            shutil.copyfileobj(data, out, _COPY_CHUNK)
        os.chmod(target, member.mode & 0o777)  # setuid/setgid dropped


def _parts(name: str, image: str) -> list[str]:
    """A member name as path components below the root; refuses absolute names and ``..``."""
    if name.startswith("/") or "\x00" in name:
        raise UnsafeImageError("a layer member has an absolute name", image=image, member=name,
                               reason="names must be relative to the root")
    parts = [part for part in name.split("/") if part not in ("", ".")]
    if ".." in parts:
        raise UnsafeImageError("a layer member climbs out of the root", image=image, member=name,
                               reason="'..' in its name")
    return parts


def _parent(root: Path, parts: list[str], image: str, member: str, *, create: bool = True) -> Path | None:
    """The directory ``root/parts...``, made where missing (``create``; else None when missing);
    refuses any component that is a symlink (writing through it could land anywhere on the
    host) or not a directory."""
    directory = root
    for part in parts:
        directory = directory / part
        if directory.is_symlink():
            raise UnsafeImageError("a layer member would be written through a symlink", image=image,
                                   member=member, reason=f"{directory.relative_to(root)} is a symlink")
        if not directory.exists():
            if not create:
                return None
            directory.mkdir(mode=0o755)
        elif not directory.is_dir():
            raise UnsafeImageError("a layer member's parent is not a directory", image=image, member=member,
                                   reason=f"{directory.relative_to(root)} is a file")
    return directory


def _remove(path: Path) -> None:
    if path.is_symlink() or (path.exists() and not path.is_dir()):
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)
