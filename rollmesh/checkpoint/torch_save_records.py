"""Where a ``torch.save``d tensor's bytes lie inside a file, so they can be read straight into place.

Knows the ``torch.save`` zip layout (uncompressed members: ``<archive>/data.pkl``, the pickle that
rebuilds the tensor from a storage, and ``<archive>/data/<key>``, the storage's raw bytes) and
the zip format; nothing of checkpoints. torch_dist checkpoints store every chunk as one such
record at a byte offset of a shard file. ``torch.load`` would copy each record's storage out of
the file bytes once more; knowing where the bytes lie lets a reader ``readinto`` its destination
tensor directly. Only the plain case is located (one storage holding exactly one contiguous
tensor); anything else returns None and the caller falls back to ``torch.load``.
"""

from __future__ import annotations

import io
import pickle
import struct
import zipfile
from dataclasses import dataclass
from typing import Any, BinaryIO

_LOCAL_HEADER = struct.Struct("<4s2B4HL2L2H")  # a zip member's local header (30 bytes)


@dataclass(frozen=True)
class TensorBytes:
    """The tensor's raw bytes: ``length`` bytes at ``offset`` of the file (little-endian, C order)."""

    offset: int
    length: int


class _Window(io.RawIOBase):
    """Bytes ``[start, start + length)`` of an open file, as a seekable file of their own."""

    def __init__(self, handle: BinaryIO, start: int, length: int) -> None:
        self._handle, self._start, self._length, self._position = handle, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: self._length}[whence]
        self._position = max(0, base + offset)
        return self._position

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        count = max(0, min(len(view), self._length - self._position))
        self._handle.seek(self._start + self._position)
        read = self._handle.readinto(view[:count]) or 0
        self._position += read
        return read


class _TensorRecipe(pickle.Unpickler):
    """Unpickles only what ``torch.save`` writes for one plain tensor, recording instead of building."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return lambda storage, offset, size, stride, *_: ("tensor", storage, offset, tuple(size), tuple(stride))
        if (module, name) == ("collections", "OrderedDict"):
            return dict
        if module == "torch" and name.endswith("Storage"):
            return name
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a plain tensor record")

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise pickle.UnpicklingError("unexpected persistent id")
        return ("storage", str(pid[2]), int(pid[4]))  # key, element count


def locate_tensor_bytes(handle: BinaryIO, start: int, length: int, *, shape: tuple[int, ...],
                        itemsize: int) -> TensorBytes | None:
    """Where, in ``handle``, the data of the tensor saved at ``[start, start + length)`` lies,
    if it is one contiguous tensor of ``shape`` filling its own storage; else None."""
    try:
        archive = zipfile.ZipFile(_Window(handle, start, length))
        names = archive.namelist()
        pickle_name = next(name for name in names if name.endswith("/data.pkl"))
        recipe = _TensorRecipe(io.BytesIO(archive.read(pickle_name))).load()
        kind, storage, storage_offset, size, stride = recipe
        _, key, storage_elements = storage
        if kind != "tensor" or size != shape or stride != _contiguous_strides(shape):
            return None
        numel = 1
        for extent in shape:
            numel *= extent
        if storage_offset + numel > storage_elements:
            return None
        member = archive.getinfo(f"{pickle_name.rsplit('/', 1)[0]}/data/{key}")
        if member.compress_type != zipfile.ZIP_STORED or member.file_size != storage_elements * itemsize:
            return None
        handle.seek(start + member.header_offset)
        fields = _LOCAL_HEADER.unpack(handle.read(_LOCAL_HEADER.size))
        data_start = member.header_offset + _LOCAL_HEADER.size + fields[-2] + fields[-1]
    except (zipfile.BadZipFile, pickle.UnpicklingError, StopIteration, KeyError, ValueError, TypeError,
            struct.error, EOFError):
        return None
    return TensorBytes(start + data_start + storage_offset * itemsize, numel * itemsize)


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for extent in reversed(shape):
        strides.append(step)
        step *= max(extent, 1)
    return tuple(reversed(strides))
