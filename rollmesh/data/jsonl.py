"""A JSONL file read with random access, without holding it in memory.

One streaming pass builds an index of where each row's line starts (an ``array('q')``: 8 bytes per
row); ``raw_row(index)`` then reads that one line with ``os.pread`` and decodes it with msgspec. A
blank (whitespace-only) line is not a row, but it is counted in the 1-based line numbers that
errors name. Knows files and JSON; nothing of field names, stage kinds or reading order.

Hand-rolled because the ``datasets`` library's JSON loader converts the whole file to an Arrow
cache (as large as the data) before the first row can be read, or, streaming, gives no random
access; and it infers one schema for all rows, so one row of another shape fails the whole load
instead of being one bad row.
"""

from __future__ import annotations

import os
from array import array
from bisect import bisect_right
from pathlib import Path
from typing import IO, Any

import msgspec

from rollmesh.data.errors import (
    BadRowError,
    DatasetFormatError,
    DatasetNotFoundError,
    DatasetReadError,
    json_type,
)

_BOM = b"\xef\xbb\xbf"
_DECODER = msgspec.json.Decoder()


class JsonlDataset:
    """The rows of one JSONL file, each a JSON object on its own line."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        if not self.path.exists():
            raise DatasetNotFoundError(self.path)
        if not self.path.is_file():
            raise DatasetFormatError(self.path, "not a file")
        # offsets[i]: where row i's line starts. Blank lines are rare, so the line number of a
        # row is kept sparsely: from row _shift_rows[k] on, _shifts[k] blank lines precede it.
        self.offsets = array("q")
        self._shift_rows = array("q")
        self._shifts = array("q")
        self._size = self._index()
        self._file: IO[bytes] | None = None

    def __len__(self) -> int:
        return len(self.offsets)

    @property
    def index_nbytes(self) -> int:
        """Bytes the index holds: 8 per row, plus 16 per run of blank lines."""
        return sum(part.itemsize * len(part) for part in (self.offsets, self._shift_rows, self._shifts))

    def row_label(self, index: int) -> int:
        """Row ``index``'s 1-based line number in the file, as an editor shows it."""
        self._check_index(index)
        k = bisect_right(self._shift_rows, index) - 1
        return index + 1 + (self._shifts[k] if k >= 0 else 0)

    def raw_row(self, index: int) -> dict[str, Any]:
        """Row ``index`` decoded; BadRowError when its line is not one JSON object."""
        self._check_index(index)
        start = self.offsets[index]
        # A row's bytes run to the next row's start: blank lines between are whitespace, which
        # JSON ignores, so no end offsets need to be kept.
        end = self.offsets[index + 1] if index + 1 < len(self.offsets) else self._size
        try:
            data = os.pread(self._fileno(), end - start, start)
        except OSError as exc:
            raise DatasetReadError(self.path, f"reading row {index}: {exc}") from exc
        if len(data) != end - start:
            raise DatasetReadError(self.path, "the file is shorter than when it was indexed")
        try:
            row = _DECODER.decode(data)
        except msgspec.DecodeError as exc:
            raise BadRowError(self.path, self.row_label(index), f"not JSON: {exc}") from exc
        if not isinstance(row, dict):
            reason = f"not a JSON object ({json_type(row)})"
            raise BadRowError(self.path, self.row_label(index), reason)
        return row

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> JsonlDataset:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __getstate__(self) -> dict[str, Any]:
        # An open file does not pickle; the copy opens its own on first read.
        return {**self.__dict__, "_file": None}

    def __repr__(self) -> str:
        return f"JsonlDataset({str(self.path)!r}, rows={len(self)})"

    def _index(self) -> int:
        """Read the file once, recording row starts; returns its size in bytes."""
        offset = blank = 0
        try:
            with open(self.path, "rb") as file:
                for line_number, line in enumerate(file, start=1):
                    start = offset
                    offset += len(line)
                    if line_number == 1 and line.startswith(_BOM):
                        start, line = start + len(_BOM), line[len(_BOM):]
                    if not line.strip():
                        blank += 1
                        continue
                    if blank != (self._shifts[-1] if self._shifts else 0):
                        self._shift_rows.append(len(self.offsets))
                        self._shifts.append(blank)
                    self.offsets.append(start)
        except OSError as exc:
            raise DatasetReadError(self.path, f"indexing: {exc}") from exc
        return offset

    def _fileno(self) -> int:
        if self._file is None:
            self._file = open(self.path, "rb", buffering=0)
        return self._file.fileno()

    def _check_index(self, index: int) -> None:
        if not 0 <= index < len(self.offsets):
            raise IndexError(f"row {index} of {len(self.offsets)} in {self.path}")

