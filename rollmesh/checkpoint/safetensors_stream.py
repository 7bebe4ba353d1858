"""Safetensors files written as a stream: the header first, from shapes known in advance, then
each tensor's bytes as they are produced, hashed on the way.

Knows the safetensors byte layout (an 8-byte little-endian header length, a JSON header naming
each tensor's dtype, shape and ``data_offsets`` within the data that follows, padded with spaces
to 8 bytes) and torch dtypes; nothing of checkpoints or models. Because every offset is fixed
before any data is written, a converter can write a shard while holding one tensor (or one block
of rows of one) at a time, never the whole shard, and the file is written front to back once, so
its sha256 comes for free.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch

_DTYPE_NAMES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}
# transformers refuses a safetensors file whose metadata does not say which framework wrote it.
SHARD_METADATA = {"format": "pt"}
_WRITE_PIECE = 1 << 20
_WRITEBACK_STEP = 64 << 20


@dataclass(frozen=True)
class TensorSlot:
    """One tensor of a shard, as the header will describe it."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count * torch.empty(0, dtype=self.dtype).element_size()


def safetensors_header(slots: list[TensorSlot]) -> bytes:
    """The length prefix and JSON header for ``slots`` laid out in order, data following."""
    entries: dict[str, object] = {"__metadata__": SHARD_METADATA}
    offset = 0
    for slot in slots:
        if slot.dtype not in _DTYPE_NAMES:
            raise ValueError(f"{slot.name}: safetensors has no dtype for {slot.dtype}")
        entries[slot.name] = {"dtype": _DTYPE_NAMES[slot.dtype], "shape": list(slot.shape),
                              "data_offsets": [offset, offset + slot.nbytes]}
        offset += slot.nbytes
    header = json.dumps(entries, separators=(",", ":")).encode()
    header += b" " * (-(8 + len(header)) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    return struct.pack("<Q", len(header)) + header


def _sync_file_range() -> Callable[[int, int, int, int], int] | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        function = libc.sync_file_range
    except (OSError, AttributeError):  # not Linux: close() fsyncs everything anyway
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint]
    return function


_SYNC_FILE_RANGE = _sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2  # <linux/fs.h>: start writeback of dirty pages, do not wait


def start_writeback(descriptor: int, offset: int, nbytes: int) -> None:
    """Ask the kernel to start writing ``nbytes`` at ``offset`` of a file to disk (Linux's
    ``sync_file_range``; a no-op elsewhere). Durability still comes from fsync."""
    if _SYNC_FILE_RANGE is not None:
        _SYNC_FILE_RANGE(descriptor, offset, nbytes, _SYNC_FILE_RANGE_WRITE)


class StreamedShard:
    """Writes one safetensors file at ``path`` whose tensors arrive in slot order, whole or as
    consecutive blocks of leading rows. ``close`` checks every byte arrived, syncs the file and
    returns its sha256."""

    def __init__(self, path: Path, slots: list[TensorSlot]) -> None:
        if len({slot.name for slot in slots}) != len(slots):
            raise ValueError(f"{path.name}: a tensor name appears twice")
        self.path = Path(path)
        self._slots = slots
        self._next = 0  # index of the slot being filled
        self._filled = 0  # bytes of it written so far
        self._digest = hashlib.sha256()
        self._written = self._flushed = 0  # bytes written, and handed to the disk
        self._handle: BinaryIO = open(self.path, "wb")  # noqa: SIM115 - closed by close()/abort()
        self._write(safetensors_header(slots))

    def append(self, name: str, tensor: torch.Tensor) -> None:
        """The next bytes of tensor ``name``: all of it, or its next block of rows."""
        if self._next >= len(self._slots):
            raise ValueError(f"{self.path.name}: {name} arrived after the last tensor")
        slot = self._slots[self._next]
        if name != slot.name or tensor.dtype != slot.dtype or tuple(tensor.shape[1:]) != slot.shape[1:]:
            raise ValueError(f"{self.path.name}: expected {slot.name} {slot.dtype} rows of {slot.shape[1:]}, "
                             f"got {name} {tensor.dtype} {tuple(tensor.shape)}")
        if tensor.dim() == 0 and slot.shape:
            raise ValueError(f"{self.path.name}: {name} is a scalar, the slot is {slot.shape}")
        data = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
        if self._filled + data.nbytes > slot.nbytes:
            raise ValueError(f"{self.path.name}: {name} overflows its {slot.nbytes} bytes")
        self._write(memoryview(data))
        self._filled += data.nbytes
        if self._filled == slot.nbytes:
            self._next, self._filled = self._next + 1, 0
            while self._next < len(self._slots) and self._slots[self._next].nbytes == 0:
                self._next += 1  # an empty tensor has no bytes to wait for

    def close(self) -> str:
        while self._next < len(self._slots) and self._slots[self._next].nbytes == 0:
            self._next += 1
        if self._next != len(self._slots):
            missing = self._slots[self._next].name
            self.abort()
            raise ValueError(f"{self.path.name}: closed before {missing} was complete")
        self._handle.flush()
        os.fsync(self._handle.fileno())
        self._handle.close()
        return self._digest.hexdigest()

    def abort(self) -> None:
        self._handle.close()
        self.path.unlink(missing_ok=True)

    def _write(self, data: bytes | memoryview) -> None:
        view = memoryview(data).cast("B")
        # In pieces, so the hash reads each piece while it is still in the CPU cache.
        for start in range(0, len(view), _WRITE_PIECE):
            piece = view[start:start + _WRITE_PIECE]
            self._handle.write(piece)
            self._digest.update(piece)
            self._written += len(piece)
        if self._written - self._flushed >= _WRITEBACK_STEP:
            # Start the disk writing what is written so far, without waiting: the fsync in
            # close() then has little left to wait for, and the disk works while we compute.
            self._handle.flush()
            start_writeback(self._handle.fileno(), self._flushed, self._written - self._flushed)
            self._flushed = self._written
