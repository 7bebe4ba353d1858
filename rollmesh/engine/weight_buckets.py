"""Weight versions published in buckets: safetensors files of at most ``bucket_bytes`` each and a
versioned manifest naming every bucket with its sha256, the manifest written last.

Knows torch, safetensors and the filesystem; not NATS (the trainer announces the manifest's path
and sha256, the inference workers load it). Layout of version N:

    weights/v00000N/bucket-00001-of-00003.safetensors ... manifest.json

A reader that holds the manifest's sha256 (from ``WeightsPublished``) trusts nothing else: each
bucket is checked against the manifest's sha256 as it is read, so a bucket damaged or replaced
on disk is refused by name. Buckets bound what one read or write holds at a time, and let a
reader verify and decode one bucket while the next is read. ``load_published`` reads both this
layout and the single ``save_weights`` file, which operators still hand to
``/update_weights_from_disk``.
"""

from __future__ import annotations

import hashlib
import shutil
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import msgspec
import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from rollmesh.checkpoint.atomic_dir import staged_directory
from rollmesh.checkpoint.errors import CheckpointWriteError
from rollmesh.checkpoint.hf_writer import plan_shards
from rollmesh.engine.errors import WeightsChecksumError, WeightsFileError
from rollmesh.engine.weights import load_weights

MANIFEST_FILE = "manifest.json"
MANIFEST_FORMAT = "rollmesh-weights/1"


class WeightBucket(msgspec.Struct, frozen=True):
    file: str
    sha256: str
    num_bytes: int
    tensors: list[str]


class WeightsManifest(msgspec.Struct, frozen=True):
    format: str
    version: int
    total_bytes: int  # the buckets' file bytes
    buckets: list[WeightBucket]


@dataclass(frozen=True)
class PublishedBuckets:
    manifest_path: Path
    manifest_sha256: str
    total_bytes: int
    gather_s: float  # the state dict copied off the model, contiguous on the CPU
    write_s: float  # buckets serialised, hashed, written and synced; the manifest last


def version_directory(weights_dir: Path, version: int) -> Path:
    return Path(weights_dir) / f"v{version:06d}"


def write_buckets(state_dict: Mapping[str, torch.Tensor], weights_dir: Path, *, version: int,
                  bucket_bytes: int) -> PublishedBuckets:
    """Publish ``state_dict`` as version ``version`` under ``weights_dir`` (atomically: the
    directory appears complete or not at all)."""
    final = version_directory(weights_dir, version)
    started = time.perf_counter()
    tensors = {name: tensor.detach().to("cpu").contiguous() for name, tensor in state_dict.items()}
    gathered = time.perf_counter()
    sizes = {name: tensor.numel() * tensor.element_size() for name, tensor in tensors.items()}
    plan = plan_shards(sizes, bucket_bytes) if tensors else []
    buckets = []
    try:
        with staged_directory(final) as staging:
            for number, names in enumerate(plan, start=1):
                file = f"bucket-{number:05d}-of-{len(plan):05d}.safetensors"
                data = save_safetensors({name: tensors[name] for name in names})
                (staging / file).write_bytes(data)
                buckets.append(WeightBucket(file, hashlib.sha256(data).hexdigest(), len(data), list(names)))
            manifest = msgspec.json.encode(WeightsManifest(MANIFEST_FORMAT, version,
                                                           sum(b.num_bytes for b in buckets), buckets))
            (staging / MANIFEST_FILE).write_bytes(manifest)  # last: it names the rest
    except (CheckpointWriteError, SafetensorError, RuntimeError, ValueError) as exc:
        raise WeightsFileError(str(final), f"cannot publish: {exc}") from exc
    return PublishedBuckets(final / MANIFEST_FILE, hashlib.sha256(manifest).hexdigest(),
                            sum(b.num_bytes for b in buckets), gathered - started, time.perf_counter() - gathered)


def read_manifest(path: Path, expected_sha256: str | None) -> WeightsManifest:
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise WeightsFileError(str(path), f"cannot read: {exc}") from exc
    if expected_sha256 is not None and hashlib.sha256(data).hexdigest() != expected_sha256.lower():
        raise WeightsChecksumError(str(path), expected_sha256, hashlib.sha256(data).hexdigest())
    try:
        manifest = msgspec.json.decode(data, type=WeightsManifest)
    except msgspec.DecodeError as exc:
        raise WeightsFileError(str(path), f"not a weights manifest: {exc}") from exc
    if manifest.format != MANIFEST_FORMAT:
        raise WeightsFileError(str(path), f"manifest format {manifest.format!r}, this reader knows {MANIFEST_FORMAT!r}")
    for bucket in manifest.buckets:
        if Path(bucket.file).name != bucket.file:  # data from disk: no path may leave the directory
            raise WeightsFileError(str(path), f"bad bucket name {bucket.file!r}")
    return manifest


def read_buckets(manifest_path: Path, expected_sha256: str | None = None) -> Iterator[dict[str, torch.Tensor]]:
    """Each bucket's tensors in turn, each checked against the manifest before it is decoded."""
    manifest_path = Path(manifest_path)
    manifest = read_manifest(manifest_path, expected_sha256)
    for bucket in manifest.buckets:
        path = manifest_path.parent / bucket.file
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise WeightsFileError(str(path), f"cannot read: {exc}") from exc
        actual = hashlib.sha256(data).hexdigest()
        if actual != bucket.sha256:
            raise WeightsChecksumError(str(path), bucket.sha256, actual)
        try:
            tensors = load_safetensors(data)
        except (SafetensorError, RuntimeError, ValueError) as exc:
            raise WeightsFileError(str(path), f"not a safetensors file: {exc}") from exc
        if sorted(tensors) != sorted(bucket.tensors):
            raise WeightsFileError(str(path), "holds other tensors than the manifest names")
        yield tensors


def load_published(path: str | Path, expected_sha256: str | None = None) -> dict[str, torch.Tensor]:
    """A published version: a bucket manifest, or a single ``save_weights`` file."""
    path = Path(path)
    if path.name != MANIFEST_FILE:
        return load_weights(path, expected_sha256)
    state: dict[str, torch.Tensor] = {}
    for tensors in read_buckets(path, expected_sha256):
        state.update(tensors)
    return state


def remove_published(path: str | Path) -> None:
    """Delete a published version, bucketed (its directory) or a single file."""
    path = Path(path)
    if path.name == MANIFEST_FILE:
        shutil.rmtree(path.parent, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
