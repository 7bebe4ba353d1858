"""Writing small OCI image layouts and docker-save tarballs for the image tests (there is no
Docker on our machines): layers are tar bytes built here, blobs named by their sha256."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import subprocess
import tarfile
from pathlib import Path

Member = tuple[str, str, bytes | str]  # (name, "file" | "dir" | "symlink" | "hardlink", data or target)


def layer(members: list[Member], *, compress: bool = False) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name, kind, payload in members:
            info = tarfile.TarInfo(name)
            if kind == "file":
                data = payload if isinstance(payload, bytes) else payload.encode()
                info.size, info.mode = len(data), 0o755 if name.endswith(("cat", ".so.6", ".so.2")) else 0o644
                tar.addfile(info, io.BytesIO(data))
                continue
            info.type = {"dir": tarfile.DIRTYPE, "symlink": tarfile.SYMTYPE, "hardlink": tarfile.LNKTYPE}[kind]
            info.mode = 0o755
            info.linkname = "" if kind == "dir" else str(payload)
            tar.addfile(info)
    raw = buffer.getvalue()
    return gzip.compress(raw) if compress else raw


def write_layout(path: Path, layers: list[bytes]) -> Path:
    """An OCI image layout at ``path`` (index.json -> manifest -> config + layers)."""
    blobs = path / "blobs" / "sha256"
    blobs.mkdir(parents=True)

    def blob(data: bytes) -> str:
        digest = hashlib.sha256(data).hexdigest()
        (blobs / digest).write_bytes(data)
        return f"sha256:{digest}"

    def descriptor(media_type: str, data: bytes) -> dict:
        return {"mediaType": media_type, "digest": blob(data), "size": len(data)}

    config = json.dumps({"architecture": "amd64", "os": "linux", "rootfs": {"type": "layers"}}).encode()
    manifest = json.dumps({
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": descriptor("application/vnd.oci.image.config.v1+json", config),
        "layers": [descriptor("application/vnd.oci.image.layer.v1.tar" + ("+gzip" if data[:2] == b"\x1f\x8b" else ""),
                              data) for data in layers],
    }).encode()
    index = {"schemaVersion": 2, "manifests": [descriptor("application/vnd.oci.image.manifest.v1+json", manifest)]}
    (path / "index.json").write_text(json.dumps(index))
    (path / "oci-layout").write_text(json.dumps({"imageLayoutVersion": "1.0.0"}))
    return path


def write_docker_save(path: Path, layers: list[bytes]) -> Path:
    """A ``docker save`` tarball in the pre-25 format: manifest.json naming <id>/layer.tar."""
    with tarfile.open(path, "w") as tar:
        names = []
        for number, data in enumerate(layers):
            name = f"{number:064x}/layer.tar"
            names.append(name)
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        manifest = json.dumps([{"Config": "config.json", "RepoTags": ["test:latest"], "Layers": names}]).encode()
        info = tarfile.TarInfo("manifest.json")
        info.size = len(manifest)
        tar.addfile(info, io.BytesIO(manifest))
    return path


def host_binary_members(binary: str) -> list[Member]:
    """``binary`` and the shared libraries it loads, at their host paths: a root that can run it."""
    members: list[Member] = []
    libraries = [binary]
    for line in subprocess.run(["ldd", binary], capture_output=True, text=True, check=True).stdout.splitlines():
        words = line.split()
        if len(words) >= 3 and words[1] == "=>" and words[2].startswith("/"):
            libraries.append(words[2])
        elif words and words[0].startswith("/"):
            libraries.append(words[0])
    for path in libraries:
        members.append((path.lstrip("/"), "file", Path(os.path.realpath(path)).read_bytes()))
    return members
