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

The same buckets can travel without files (``serialize_buckets`` then ``weight_memory``): the
bytes and both sha256 levels are identical, only the medium differs.

Both ends of the bucket format are written here by hand (``bucket_parts``, ``encode_bucket``,
``decode_bucket``), and safetensors' own ``load`` stays the reader of files: its ``save`` copies
every tensor twice (to ``bytes``, then into the output) and was the largest single cost of a
publication on CPU, and its ``load`` takes ``bytes`` only, which would copy a shared-memory bucket
once more. The format is safetensors' (an 8-byte little-endian header length, a JSON header padded
with spaces to 8 bytes, then the tensors' bytes back to back); a test checks that safetensors reads
what ``encode_bucket`` writes. A serialised bucket is held as its parts, never joined: the header,
then a view of each tensor's bytes. Hashed part by part, written with one ``writelines`` and put
into shared memory part by part, their concatenation is the safetensors file, and no copy is made
before the one into the file or the object store. ``decode_bucket`` and ``decode_bucket_parts``
return views of their buffers (the stager copies them).

sha256 is most of a publication's CPU time (about 1 GB/s per core), so buckets are hashed on a few
threads at once: ``hashlib`` releases the GIL while it hashes a large buffer.
"""

from __future__ import annotations

import functools
import hashlib
import json
import shutil
import struct
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec
import numpy as np
from safetensors import SafetensorError

from rollmesh.checkpoint.atomic_dir import staged_directory
from rollmesh.checkpoint.errors import CheckpointWriteError
from rollmesh.engine.errors import WeightsChecksumError, WeightsFileError

# torch (seconds to import) is imported where tensors are made or read, not here: the launcher and
# every role's module reach this file (the manifest types, ``map_threads``) before any tensor exists.
if TYPE_CHECKING:
    import torch

MANIFEST_FILE = "manifest.json"
MANIFEST_FORMAT = "rollmesh-weights/1"
# Threads that hash (and verify) buckets at once; more than the cores only adds switching.
HASH_THREADS = 4


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


@dataclass(frozen=True)
class SerializedWeights:
    """One version's buckets in memory: the manifest and each bucket's safetensors bytes, as parts
    (``bucket_parts``: views of the state dict's tensors, valid while those are not changed)."""

    version: int
    manifest: bytes
    manifest_sha256: str
    buckets: list[tuple[WeightBucket, list[np.ndarray]]]  # each bucket's parts (uint8)
    total_bytes: int
    gather_s: float
    serialize_s: float  # buckets laid out and hashed


def serialize_buckets(state_dict: Mapping[str, torch.Tensor], *, version: int, bucket_bytes: int,
                      alongside: Callable[[list[list[np.ndarray]]], object] | None = None) -> SerializedWeights:
    """``state_dict`` as buckets of at most ``bucket_bytes`` (a larger tensor gets one alone),
    each hashed (on ``HASH_THREADS`` threads), and the manifest naming them. Nothing is copied
    but what is not a contiguous CPU tensor already. ``alongside(each bucket's parts)`` runs on
    its own thread while they are hashed (the shared-memory copy needs no hash), and has
    finished when this returns."""
    from rollmesh.checkpoint.hf_writer import plan_shards

    started = time.perf_counter()
    tensors = {name: tensor.detach().to("cpu").contiguous() for name, tensor in state_dict.items()}
    gathered = time.perf_counter()
    sizes = {name: tensor.numel() * tensor.element_size() for name, tensor in tensors.items()}
    plan = plan_shards(sizes, bucket_bytes) if tensors else []
    laid_out = []
    for number, names in enumerate(plan, start=1):
        file = f"bucket-{number:05d}-of-{len(plan):05d}.safetensors"
        try:
            laid_out.append((file, list(names), bucket_parts({name: tensors[name] for name in names})))
        except (KeyError, RuntimeError, ValueError) as exc:
            raise WeightsFileError(file, f"cannot publish version {version}: {exc!r}") from exc
    with ThreadPoolExecutor(1, thread_name_prefix="weights-alongside") as side:
        beside = side.submit(alongside, [parts for _, _, parts in laid_out]) if alongside else None
        digests = map_threads(hash_parts, [parts for _, _, parts in laid_out])
        if beside is not None:
            beside.result()
    buckets = [(WeightBucket(file, digest, parts_size(parts), names), parts)
               for (file, names, parts), digest in zip(laid_out, digests)]
    total = sum(bucket.num_bytes for bucket, _ in buckets)
    manifest = msgspec.json.encode(WeightsManifest(MANIFEST_FORMAT, version, total, [b for b, _ in buckets]))
    return SerializedWeights(version, manifest, hashlib.sha256(manifest).hexdigest(), buckets, total,
                             gathered - started, time.perf_counter() - gathered)


def map_threads(function: Callable, items: Sequence) -> list:
    """``[function(item) for item in items]`` on up to ``HASH_THREADS`` threads (for work that
    releases the GIL: hashing, torch copies)."""
    if len(items) < 2:
        return [function(item) for item in items]
    with ThreadPoolExecutor(min(HASH_THREADS, len(items)), thread_name_prefix="weights-hash") as pool:
        return list(pool.map(function, items))


def hash_parts(parts: Sequence) -> str:
    """The sha256 of the parts' bytes back to back, without joining them."""
    digest = hashlib.sha256()
    for part in parts:
        digest.update(memoryview(part).cast("B"))
    return digest.hexdigest()


def parts_size(parts: Sequence) -> int:
    return sum(memoryview(part).nbytes for part in parts)


def write_serialized(serialized: SerializedWeights, weights_dir: Path) -> Path:
    """Write serialised buckets as their version's directory (atomically: it appears complete or
    not at all, the manifest written last); returns the manifest's path."""
    final = version_directory(weights_dir, serialized.version)
    try:
        with staged_directory(final) as staging:
            for bucket, parts in serialized.buckets:
                with open(staging / bucket.file, "wb") as out:
                    out.writelines(memoryview(part).cast("B") for part in parts)
            (staging / MANIFEST_FILE).write_bytes(serialized.manifest)  # last: it names the rest
    except CheckpointWriteError as exc:
        raise WeightsFileError(str(final), f"cannot publish: {exc}") from exc
    return final / MANIFEST_FILE


def write_buckets(state_dict: Mapping[str, torch.Tensor], weights_dir: Path, *, version: int,
                  bucket_bytes: int) -> PublishedBuckets:
    """Publish ``state_dict`` as version ``version`` under ``weights_dir`` (atomically: the
    directory appears complete or not at all)."""
    serialized = serialize_buckets(state_dict, version=version, bucket_bytes=bucket_bytes)
    started = time.perf_counter()
    manifest_path = write_serialized(serialized, weights_dir)
    return PublishedBuckets(manifest_path, serialized.manifest_sha256, serialized.total_bytes, serialized.gather_s,
                            serialized.serialize_s + time.perf_counter() - started)


def read_manifest(path: Path, expected_sha256: str | None) -> WeightsManifest:
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise WeightsFileError(str(path), f"cannot read: {exc}") from exc
    return decode_manifest(data, expected_sha256, where=str(path))


def decode_manifest(data: bytes | memoryview, expected_sha256: str | None, *, where: str) -> WeightsManifest:
    """A manifest's bytes, checked against ``expected_sha256`` (from ``WeightsPublished``)."""
    if expected_sha256 is not None and hashlib.sha256(data).hexdigest() != expected_sha256.lower():
        raise WeightsChecksumError(where, expected_sha256, hashlib.sha256(data).hexdigest())
    try:
        manifest = msgspec.json.decode(data, type=WeightsManifest)
    except msgspec.DecodeError as exc:
        raise WeightsFileError(where, f"not a weights manifest: {exc}") from exc
    if manifest.format != MANIFEST_FORMAT:
        raise WeightsFileError(where, f"manifest format {manifest.format!r}, this reader knows {MANIFEST_FORMAT!r}")
    for bucket in manifest.buckets:
        if Path(bucket.file).name != bucket.file:  # data from disk: no path may leave the directory
            raise WeightsFileError(where, f"bad bucket name {bucket.file!r}")
    return manifest


@functools.cache
def _safetensors_dtypes() -> dict[str, torch.dtype]:
    """safetensors' dtype names (its format spec) as torch dtypes."""
    import torch

    return {
        "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
        "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
        "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    }


@functools.cache
def _dtype_names() -> dict[torch.dtype, str]:
    return {dtype: name for name, dtype in _safetensors_dtypes().items()}


def bucket_parts(tensors: Mapping[str, torch.Tensor]) -> list[np.ndarray]:
    """``tensors`` (contiguous, on the CPU) in the safetensors format as parts: the length and
    header, then a uint8 view of each non-empty tensor's bytes (no copy). Joined, they are the file."""
    import torch

    header, size, views = {}, 0, []
    for name, tensor in tensors.items():
        num_bytes = tensor.numel() * tensor.element_size()
        header[name] = {"dtype": _dtype_names()[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [size, size + num_bytes]}
        size += num_bytes
        if num_bytes:
            if not tensor.is_contiguous() or tensor.device.type != "cpu":
                raise ValueError(f"{name} is not a contiguous CPU tensor")
            views.append(tensor.detach().reshape(-1).view(torch.uint8).numpy())
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    return [np.frombuffer(struct.pack("<Q", len(head)) + head, dtype=np.uint8), *views]


def encode_bucket(tensors: Mapping[str, torch.Tensor]) -> np.ndarray:
    """``tensors`` (on the CPU) in the safetensors format, copied once into one new buffer."""
    parts = bucket_parts({name: tensor.detach().contiguous() for name, tensor in tensors.items()})
    out = np.empty(parts_size(parts), dtype=np.uint8)
    at = 0
    for part in parts:
        out[at:at + part.nbytes] = part
        at += part.nbytes
    return out


def decode_bucket(data, bucket: WeightBucket, *, where: str) -> dict[str, torch.Tensor]:
    """The tensors of one bucket held in ``data`` (any contiguous buffer), checked against the
    manifest's sha256 and tensor names first. The tensors are views of ``data`` (which they keep
    alive): copy them before writing to them."""
    import torch

    view = memoryview(data).cast("B")
    actual = hashlib.sha256(view).hexdigest()
    if actual != bucket.sha256:
        raise WeightsChecksumError(where, bucket.sha256, actual)
    try:
        (header_len,) = struct.unpack_from("<Q", view, 0)
        header = json.loads(bytes(view[8:8 + header_len]))
        header.pop("__metadata__", None)
        start = 8 + header_len
        tensors = {}
        with warnings.catch_warnings():  # read-only buffers: the views are only ever read
            warnings.simplefilter("ignore", UserWarning)
            for name, entry in header.items():
                begin, end = entry["data_offsets"]
                if not 0 <= begin <= end <= len(view) - start:
                    raise ValueError(f"{name} lies outside the bucket")
                dtype = _safetensors_dtypes()[entry["dtype"]]
                flat = (torch.frombuffer(view, dtype=torch.uint8, count=end - begin, offset=start + begin)
                        if end > begin else torch.empty(0, dtype=torch.uint8))
                tensors[name] = flat.view(dtype).reshape(entry["shape"])
    except (struct.error, ValueError, KeyError, TypeError, RuntimeError) as exc:
        raise WeightsFileError(where, f"not a safetensors bucket: {exc!r}") from exc
    if sorted(tensors) != sorted(bucket.tensors):
        raise WeightsFileError(where, "holds other tensors than the manifest names")
    return tensors


def decode_bucket_parts(parts: Sequence, bucket: WeightBucket, *, where: str) -> dict[str, torch.Tensor]:
    """``decode_bucket`` for a bucket held as its parts (``bucket_parts``: the header, then each
    non-empty tensor's bytes in order), checked against the manifest's sha256 over all of them
    first. One part is a whole bucket. Views of the parts, as ``decode_bucket`` gives."""
    import torch

    if len(parts) == 1:
        return decode_bucket(parts[0], bucket, where=where)
    actual = hash_parts(parts)
    if actual != bucket.sha256:
        raise WeightsChecksumError(where, bucket.sha256, actual)
    # The bytes are the file's; only their split into parts is checked here against the header.
    views = [memoryview(part).cast("B") for part in parts]
    try:
        (header_len,) = struct.unpack_from("<Q", views[0], 0)
        if len(views[0]) != 8 + header_len:
            raise ValueError("the first part is not exactly the header")
        header = json.loads(bytes(views[0][8:]))
        header.pop("__metadata__", None)
        entries = sorted(header.items(), key=lambda item: item[1]["data_offsets"][0])
        tensors, position, next_part = {}, 0, 1
        with warnings.catch_warnings():  # read-only buffers: the views are only ever read
            warnings.simplefilter("ignore", UserWarning)
            for name, entry in entries:
                begin, end = entry["data_offsets"]
                if begin != position or end < begin:
                    raise ValueError(f"{name} is not where the header's previous tensor ended")
                position = end
                flat = torch.empty(0, dtype=torch.uint8)
                if end > begin:
                    if next_part >= len(views) or len(views[next_part]) != end - begin:
                        raise ValueError(f"{name} is not one part of its own")
                    flat = torch.frombuffer(views[next_part], dtype=torch.uint8)
                    next_part += 1
                tensors[name] = flat.view(_safetensors_dtypes()[entry["dtype"]]).reshape(entry["shape"])
        if next_part != len(views):
            raise ValueError(f"{len(views) - next_part} parts beyond the header's tensors")
    except (struct.error, ValueError, KeyError, TypeError, RuntimeError) as exc:
        raise WeightsFileError(where, f"not a safetensors bucket: {exc!r}") from exc
    if sorted(tensors) != sorted(bucket.tensors):
        raise WeightsFileError(where, "holds other tensors than the manifest names")
    return tensors


def read_buckets(manifest_path: Path, expected_sha256: str | None = None) -> Iterator[dict[str, torch.Tensor]]:
    """Each bucket's tensors in turn, each checked against the manifest before it is decoded."""
    from safetensors.torch import load as load_safetensors

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
    from rollmesh.engine.weights import load_weights

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
