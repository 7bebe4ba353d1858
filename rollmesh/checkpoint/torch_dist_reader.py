"""Reads Megatron-core ``torch_dist`` checkpoints (torch.distributed.checkpoint) chunk by chunk.

Knows the DCP on-disk format: a pickled global index in ``.metadata`` (each tensor's global shape
and dtype, its chunks as boxes, and where each chunk's bytes lie: file, offset, length) and
``__<rank>_<n>.distcp`` files in which every chunk is one ``torch.save``d tensor. The plan is made
from the index alone (``tensors``); data is read one chunk at a time by byte range
(``read_region``), so memory holds at most the region asked for plus one chunk, never the model.
Megatron stacks per-layer tensors on a leading layer axis (``decoder.layers.<param>``), and MoE
expert weights on a second, expert axis (``decoder.layers.mlp.experts.experts.linear_fc1.weight``,
[layers, global experts, 2 * ffn, hidden], one chunk per layer, expert and TP rank's gate or up
rows; whatever the expert module: ``SequentialMLP``, ``GroupedMLP`` and ``TEGroupedMLP`` all save
this layout); ``layer_sources`` indexes every canonical per-layer, per-expert name by the box it
occupies. Byte entries (``_extra_state``) carry no weights and are skipped. Not read: the
``singleton_local_shards`` layout (one key per expert, SwiGLU halves under ``_w``/``_v`` keys).
"""

from __future__ import annotations

import io
import mmap
import os
import pickle
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch

from rollmesh.checkpoint.arch_maps import canonical_megatron_name, per_expert_name
from rollmesh.checkpoint.chunk_geometry import Box, check_tiling, plan_copies
from rollmesh.checkpoint.convert_planner import StoredChunk, TensorInfo
from rollmesh.checkpoint.errors import CheckpointReadError
from rollmesh.checkpoint.torch_save_records import locate_tensor_bytes

METADATA_FILE = ".metadata"
_STACKED = re.compile(r"^decoder\.layers\.(?!\d+\.)(.+)$")
_PER_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


class TorchDistCheckpoint:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        metadata_path = self.path / METADATA_FILE
        try:
            with open(metadata_path, "rb") as handle:
                metadata = pickle.load(handle)  # noqa: S301 - DCP's own format; a trusted local checkpoint
        except FileNotFoundError as exc:
            raise CheckpointReadError(f"no {METADATA_FILE}: not a torch_dist checkpoint", path=str(metadata_path)) from exc
        except Exception as exc:  # pickle raises many things on a damaged file
            raise CheckpointReadError(f"unreadable {METADATA_FILE}: {exc!r}", path=str(metadata_path)) from exc
        self._where = {(index.fqn, tuple(index.offset or ())): info for index, info in metadata.storage_data.items()}
        self._tensors: dict[str, TensorInfo] = {}
        for name, entry in metadata.state_dict_metadata.items():
            if not hasattr(entry, "chunks"):
                continue  # bytes (``_extra_state``): no weights
            shape = tuple(entry.size)
            itemsize = torch.empty(0, dtype=entry.properties.dtype).element_size()
            chunks = []
            for chunk in entry.chunks:
                box = Box(tuple(chunk.offsets), tuple(chunk.sizes))
                info = self._where.get((name, box.offsets))
                if info is None:
                    raise CheckpointReadError(f"{name}: the index names no file for the chunk at {box.offsets}",
                                              path=str(metadata_path))
                chunks.append(StoredChunk(name, box, info.relative_path, box.numel * itemsize))
            self._tensors[name] = TensorInfo(name, shape, itemsize, tuple(chunks))
        self.dtypes = {name: entry.properties.dtype for name, entry in metadata.state_dict_metadata.items()
                       if hasattr(entry, "chunks")}
        # Objects saved inside the checkpoint rather than in common.pt (Megatron-LM's torch_dcp
        # format keeps ``args`` there), each a torch.save'd byte record.
        self.objects = sorted(name for name, entry in metadata.state_dict_metadata.items()
                              if not hasattr(entry, "chunks") and (name, ()) in self._where)

    def read_object(self, name: str) -> Any:
        """An object saved inside the checkpoint (a byte entry of the index), unpickled."""
        info = self._where.get((name, ()))
        if name not in self.objects or info is None:
            raise CheckpointReadError(f"no object {name!r} in the checkpoint", path=str(self.path))
        file = self.path / info.relative_path
        try:
            with open(file, "rb") as handle:
                handle.seek(info.offset)
                raw = handle.read(info.length)
            return torch.load(io.BytesIO(raw), weights_only=False)  # noqa: S614 - a trusted local checkpoint
        except OSError as exc:
            raise CheckpointReadError(f"shard file {info.relative_path} is missing or unreadable: {exc.strerror}",
                                      path=str(file)) from exc
        except Exception as exc:  # a damaged record: the loader's errors vary
            raise CheckpointReadError(f"shard file {info.relative_path}: object {name!r} is corrupt: {exc!r}",
                                      path=str(file)) from exc

    def tensors(self) -> list[TensorInfo]:
        return list(self._tensors.values())

    def tensor(self, name: str) -> TensorInfo:
        try:
            return self._tensors[name]
        except KeyError:
            raise CheckpointReadError(f"no tensor {name!r} in the checkpoint", path=str(self.path)) from None

    def check(self) -> None:
        """Raise unless every tensor's chunks tile it exactly (the index is consistent)."""
        for tensor in self._tensors.values():
            try:
                check_tiling(tensor.shape, [chunk.box for chunk in tensor.chunks])
            except ValueError as exc:
                raise CheckpointReadError(f"{tensor.name}: {exc}", path=str(self.path / METADATA_FILE)) from exc

    def read_region(self, name: str, region: Box | None = None, *, out: torch.Tensor | None = None) -> torch.Tensor:
        """The part ``region`` (default: all) of tensor ``name``, assembled from its chunks, in
        ``out`` when given (contiguous, of the region's shape and the tensor's dtype): a caller
        converting many tensors reuses one buffer rather than paging in fresh memory for each,
        which cost more than the reads themselves on the test VM."""
        tensor = self.tensor(name)
        region = region or Box.whole(tensor.shape)
        out = torch.empty(region.sizes, dtype=self.dtypes[name]) if out is None else out
        if tuple(out.shape) != region.sizes or out.dtype != self.dtypes[name] or not out.is_contiguous():
            raise ValueError(f"{name}: out must be a contiguous {self.dtypes[name]} tensor of {region.sizes}")
        for copy in plan_copies([region], [chunk.box for chunk in tensor.chunks]):
            chunk = tensor.chunks[copy.source]
            destination = out[copy.region.relative_to(region)]
            if copy.region == chunk.box and _readable_in_place(destination):
                self._read_chunk(chunk, into=destination)  # straight into place: no copy
            else:
                destination.copy_(self._read_chunk(chunk)[copy.region.relative_to(chunk.box)])
        return out

    def read_source(self, source: LayerSource, *, out: torch.Tensor | None = None) -> torch.Tensor:
        """The canonical tensor ``source`` locates (its stacked leading axes dropped); ``out``
        as for ``read_region``, of the source box's shape."""
        tensor = self.read_region(source.stored, source.box, out=out)
        return tensor.reshape(tensor.shape[source.stacked:])

    def source_files(self, source: LayerSource) -> frozenset[str]:
        """The shard files holding part of ``source`` (what reading it opens)."""
        return frozenset(chunk.file for chunk in self.tensor(source.stored).chunks
                         if chunk.box.intersect(source.box) is not None)

    def source_nbytes(self, source: LayerSource) -> int:
        return source.box.numel * self.tensor(source.stored).itemsize

    def chunk_view(self, chunk: StoredChunk) -> torch.Tensor | None:
        """The stored chunk as a tensor over the file's pages, mapped private and read-only in
        effect: nothing is copied, the page cache's pages are ours until unmapped (when the last
        view goes). None when its record is not the plain layout ``locate_tensor_bytes`` places."""
        info = self._where[(chunk.tensor, chunk.box.offsets)]
        file = self.path / info.relative_path
        dtype = self.dtypes[chunk.tensor]
        try:
            with open(file, "rb") as handle:
                located = locate_tensor_bytes(handle, info.offset, info.length, shape=chunk.box.sizes,
                                              itemsize=self.tensor(chunk.tensor).itemsize)
                if located is None or located.length == 0:
                    return None
                start = located.offset - located.offset % mmap.ALLOCATIONGRANULARITY
                pages = mmap.mmap(handle.fileno(), located.offset + located.length - start, offset=start,
                                  flags=mmap.MAP_PRIVATE | _MAP_POPULATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as exc:
            raise CheckpointReadError(f"shard file {info.relative_path} is missing or unreadable: {exc.strerror}",
                                      path=str(file)) from exc
        except ValueError as exc:  # the mapping would pass the end of the file
            raise CheckpointReadError(f"shard file {info.relative_path} is truncated: {exc}", path=str(file)) from exc
        count = located.length // self.tensor(chunk.tensor).itemsize
        return torch.frombuffer(pages, dtype=dtype, count=count, offset=located.offset - start).reshape(chunk.box.sizes)

    def _read_chunk(self, chunk: StoredChunk, *, into: torch.Tensor | None = None) -> torch.Tensor:
        """The stored chunk, read into ``into`` (contiguous, of the chunk's shape) when given."""
        info = self._where[(chunk.tensor, chunk.box.offsets)]
        file = self.path / info.relative_path
        itemsize = self.tensor(chunk.tensor).itemsize
        try:
            with open(file, "rb") as handle:
                located = locate_tensor_bytes(handle, info.offset, info.length, shape=chunk.box.sizes,
                                              itemsize=itemsize)
                if located is not None:  # the usual case: the bytes go straight into place
                    target = into if into is not None else torch.empty(chunk.box.sizes, dtype=self.dtypes[chunk.tensor])
                    got = _read_into(handle, located.offset, target)
                    if got != located.length:
                        raise CheckpointReadError(f"shard file {info.relative_path} is truncated: {got} of "
                                                  f"{located.length} bytes of {chunk.tensor}", path=str(file))
                    return target
                handle.seek(info.offset)
                raw = handle.read(info.length)
        except OSError as exc:
            raise CheckpointReadError(f"shard file {info.relative_path} is missing or unreadable: {exc.strerror}",
                                      path=str(file)) from exc
        data = self._load_record(raw, chunk, info, file)
        if into is not None:
            into.copy_(data)
        return data

    def _load_record(self, raw: bytes, chunk: StoredChunk, info: Any, file: Path) -> torch.Tensor:
        """``torch.load`` of a record ``locate_tensor_bytes`` could not place (or a damaged one)."""
        if len(raw) != info.length:
            raise CheckpointReadError(f"shard file {info.relative_path} is truncated: {len(raw)} of "
                                      f"{info.length} bytes at offset {info.offset}", path=str(file))
        try:
            data = torch.load(io.BytesIO(raw), weights_only=True)
        except Exception as exc:  # a damaged shard: the loader's errors vary
            raise CheckpointReadError(f"shard file {info.relative_path} is corrupt at offset {info.offset}: "
                                      f"{exc!r}", path=str(file)) from exc
        if tuple(data.shape) != chunk.box.sizes:
            raise CheckpointReadError(f"shard file {info.relative_path}: chunk of {chunk.tensor} has shape "
                                      f"{tuple(data.shape)}, the index says {chunk.box.sizes}", path=str(file))
        return data


def stacked_source(per_layer: str, stacked_names: set[str]) -> tuple[str, int] | None:
    """``decoder.layers.3.mlp.linear_fc2.weight`` -> (``decoder.layers.mlp.linear_fc2.weight``, 3)
    when the checkpoint stacks that parameter over layers; else None."""
    match = _PER_LAYER.match(per_layer)
    if match is None:
        return None
    stacked = f"decoder.layers.{match.group(2)}"
    return (stacked, int(match.group(1))) if stacked in stacked_names else None


def per_layer_name(stacked: str, layer: int) -> str:
    match = _STACKED.match(stacked)
    if match is None:
        raise ValueError(f"{stacked!r} is not a layer-stacked name")
    return f"decoder.layers.{layer}.{match.group(1)}"


def layer_box(tensor: TensorInfo, layer: int) -> Box:
    """The box of one layer of a layer-stacked tensor."""
    whole = Box.whole(tensor.shape)
    return Box((layer,) + whole.offsets[1:], (1,) + whole.sizes[1:])


@dataclass(frozen=True)
class LayerSource:
    """Where one canonical per-layer (and per-expert) Megatron tensor lives in the checkpoint."""

    stored: str  # the checkpoint tensor holding it
    box: Box  # its part of that tensor: one layer (and one expert) of a stacked one, else the whole
    # How many leading axes of size 1 the box keeps (layer, then expert) that reading drops:
    # 0 for a tensor stored as it is, 1 for a layer of a layer-stacked one, 2 for an expert of
    # the layer-stacked grouped experts. (Truthy exactly when a layer axis is kept.)
    stacked: int


def layer_sources(checkpoint: TorchDistCheckpoint) -> dict[str, LayerSource]:
    """Canonical per-layer Megatron name -> where it lives (layer-stacked tensors unstacked,
    grouped experts split into one source per global expert)."""
    sources: dict[str, LayerSource] = {}
    for tensor in checkpoint.tensors():
        if _STACKED.match(tensor.name):
            parts = [(per_layer_name(tensor.name, layer), layer_box(tensor, layer), 1)
                     for layer in range(tensor.shape[0])]
        else:
            parts = [(tensor.name, Box.whole(tensor.shape), 0)]
        for name, box, lead in parts:
            if per_expert_name(name, 0) is None:
                sources[canonical_megatron_name(name)] = LayerSource(tensor.name, box, lead)
                continue
            for expert in range(box.sizes[lead]):  # the expert axis follows the layer axis
                offsets, sizes = list(box.offsets), list(box.sizes)
                offsets[lead], sizes[lead] = expert, 1
                sources[per_expert_name(name, expert)] = LayerSource(tensor.name, Box(tuple(offsets), tuple(sizes)),
                                                                     lead + 1)
    return sources


# Map the pages in one go rather than fault them in one at a time (Linux only).
_MAP_POPULATE = 0
# At most this many buffers per preadv call (Linux's IOV_MAX).
_IOV_MAX = 1024


def _readable_in_place(target: torch.Tensor) -> bool:
    """Contiguous, or rows (last axis contiguous) at a fixed stride: what ``_read_into`` fills."""
    if target.is_contiguous():
        return True
    if target.dim() == 0 or target.stride(-1) != 1:
        return False
    try:
        target.view(-1, target.shape[-1])
    except RuntimeError:  # the leading axes do not flatten to one stride
        return False
    return True


def _read_into(handle: BinaryIO, offset: int, target: torch.Tensor) -> int:
    """Read ``target``'s bytes (C order) from ``offset``: one read into a contiguous tensor, or a
    scatter read (preadv) of its rows into a strided one (a column block of a larger tensor),
    so no temporary copy is made either way. ``target`` passes ``_readable_in_place``."""
    if target.is_contiguous():
        handle.seek(offset)
        return handle.readinto(target.reshape(-1).view(torch.uint8).numpy()) or 0
    rows = target.view(-1, target.shape[-1]).view(torch.uint8).numpy()  # views, never copies
    got = 0
    for start in range(0, len(rows), _IOV_MAX):
        got += os.preadv(handle.fileno(), list(rows[start:start + _IOV_MAX]), offset + got)
    return got
