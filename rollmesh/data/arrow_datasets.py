"""Parquet files and Hugging Face ``datasets`` saved to disk, read through the ``datasets`` library.

Both are read as a memory-mapped Arrow table: a row is sliced out of the map and converted when
``raw_row`` asks for it, so a dataset larger than memory is never loaded into RAM (the pages the
rows touch are the kernel's page cache, which it drops under pressure).

- A ``Dataset.save_to_disk`` directory (``state.json``, ``dataset_info.json``,
  ``data-*.arrow``) is mapped where it lies by ``datasets.load_from_disk``. A ``DatasetDict``
  directory (``dataset_dict.json`` and one directory per split) is read whole only when it holds
  a single split; otherwise the split is named by its directory (``data/gsm8k/train``), since
  silently taking ``train`` would let an eval read training rows.
- A Parquet file's pages are encoded (and mostly compressed), so it cannot be mapped as a table:
  ``datasets.Dataset.from_parquet`` converts it once, a row group at a time, into an Arrow file
  in a cache, keyed by the file's path and modification time, which every later open (config
  check, feeder, trainer, a resumed job) maps without converting again.
  The cache is ``$ROLLMESH_DATASETS_CACHE``, else ``$XDG_CACHE_HOME/rollmesh/datasets`` (default
  ``~/.cache/rollmesh/datasets``): not next to the data (often read-only or under version
  control), not a temporary directory (each process would convert the whole file again), and not
  ``~/.cache/huggingface`` (shared with every other Hugging Face user of the machine).

Local files only: nothing here names a Hub repository, so the library makes no network call (tested
with sockets refused). Rows come back as JSON values, as a JSONL row would: the table is read with
no format (Python values, whatever format it was saved with: ``set_format("numpy")`` would give
arrays), the library's Python objects pass through ``msgspec.to_builtins`` (dates as ISO strings,
bytes as base64; a decoded image has no JSON form: a bad row), and a null inside a nested object is
dropped, because an Arrow struct gives every element every key (a message column's ``tool_calls:
null`` on a user message) where the JSON it came from had none. A null top-level column stays:
rows.py reads it as absent.

``datasets`` (~1 s to import) is imported on first open, so JSONL users never pay for it. Knows
the ``datasets`` library and Arrow; nothing of field names, stage kinds or reading order.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import msgspec

from rollmesh.data.errors import BadRowError, DatasetFormatError, DatasetNotFoundError, DatasetReadError

PARQUET_SUFFIXES = (".parquet",)
DATASETS_CACHE_ENV = "ROLLMESH_DATASETS_CACHE"
# The files datasets' save_to_disk writes (datasets.config.DATASET_STATE_JSON_FILENAME and
# DATASETDICT_JSON_FILENAME), named here so telling the formats apart needs no import.
SAVED_STATE_FILE = "state.json"
SAVED_DICT_FILE = "dataset_dict.json"


def datasets_cache_dir() -> Path:
    """Where Parquet files' Arrow conversions are kept (see the module docstring)."""
    configured = os.environ.get(DATASETS_CACHE_ENV)
    if configured:
        return Path(configured).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "rollmesh" / "datasets"


class ArrowDataset:
    """Rows of one memory-mapped Arrow table; subclasses say how the table is loaded."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        if not self.path.exists():
            raise DatasetNotFoundError(self.path)
        self._table: Any = None  # the datasets.Dataset; None after close() and in pickled copies
        self._num_rows = -1  # known once opened; a reopen must find as many rows
        self._num_rows = len(self._open())

    def __len__(self) -> int:
        return self._num_rows

    def row_label(self, index: int) -> int:
        """Row ``index``'s 1-based number: a table's rows have no line numbers."""
        self._check_index(index)
        return index + 1

    def raw_row(self, index: int) -> dict[str, Any]:
        """Row ``index`` as JSON values; BadRowError when a value has no JSON form."""
        self._check_index(index)
        row = self._open()[index]
        return {column: _json_column(self.path, index + 1, column, value)
                for column, value in row.items()}

    def close(self) -> None:
        # A mapped table has no file handle of ours to close: dropping it unmaps it once unused.
        self._table = None

    def __enter__(self) -> ArrowDataset:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __getstate__(self) -> dict[str, Any]:
        # The copy maps the same files again on its first read (Ray ships readers to actors).
        return {**self.__dict__, "_table": None}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self.path)!r}, rows={len(self)})"

    def _load(self) -> Any:
        raise NotImplementedError

    def _open(self) -> Any:
        if self._table is None:
            datasets = _datasets()
            try:
                with _progress_bars_off(datasets):
                    table = self._load()
            except (OSError, ValueError, TypeError, datasets.exceptions.DatasetsError,
                    _pyarrow().ArrowException) as exc:
                raise DatasetReadError(self.path, f"reading it with datasets: {exc}") from exc
            # A format saved with the data (set_format("numpy"), a subset of columns) would
            # change what a row looks like: rows are always every column as Python values.
            table = table.with_format(None)
            if self._num_rows >= 0 and len(table) != self._num_rows:
                raise DatasetReadError(self.path, f"it changed since it was opened: {self._num_rows} "
                                                  f"rows then, {len(table)} now")
            self._table = table
        return self._table

    def _check_index(self, index: int) -> None:
        if not 0 <= index < self._num_rows:
            raise IndexError(f"row {index} of {self._num_rows} in {self.path}")


class ParquetDataset(ArrowDataset):
    """A Parquet file, converted once into an Arrow file in ``datasets_cache_dir()`` and mapped."""

    def __init__(self, path: Path | str) -> None:
        path = Path(path)
        if path.exists() and not path.is_file():
            raise DatasetFormatError(path, "not a file")
        super().__init__(path)

    def _load(self) -> Any:
        table = _datasets().Dataset.from_parquet(str(self.path), cache_dir=str(datasets_cache_dir()),
                                                 keep_in_memory=False)
        # The conversion decodes one row group at a time, and Arrow's allocator (mimalloc) keeps
        # what it freed: measured, a 390 MB file of one row group left 700 MB resident after its
        # conversion, 30 MB once released.
        _pyarrow().default_memory_pool().release_unused()
        return table


class SavedDataset(ArrowDataset):
    """A ``save_to_disk`` directory, mapped where it lies. ``split`` is the split directory read
    when ``path`` is a one-split ``DatasetDict``."""

    def __init__(self, path: Path | str) -> None:
        path = Path(path)
        self.split = _single_split(path) if (path / SAVED_DICT_FILE).is_file() else None
        if self.split is None and not (path / SAVED_STATE_FILE).is_file():
            raise DatasetFormatError(path, _not_saved_reason(path))
        super().__init__(path)

    def _load(self) -> Any:
        source = self.path / self.split if self.split else self.path
        return _datasets().load_from_disk(str(source), keep_in_memory=False)


def open_arrow_dataset(path: Path) -> ArrowDataset:
    """``path`` as a Parquet file or a saved dataset; DatasetFormatError when it is neither."""
    if path.is_dir():
        return SavedDataset(path)
    return ParquetDataset(path)


def _single_split(path: Path) -> str:
    """The one split of the DatasetDict saved at ``path``; DatasetFormatError naming its splits
    (and how to choose one) when it has several."""
    try:
        splits = json.loads((path / SAVED_DICT_FILE).read_text())["splits"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise DatasetReadError(path, f"{SAVED_DICT_FILE} is unreadable: {exc!r}") from exc
    if not isinstance(splits, list) or not all(isinstance(split, str) for split in splits) or not splits:
        raise DatasetReadError(path, f"{SAVED_DICT_FILE} names no splits")
    if len(splits) > 1:
        choices = ", ".join(str(path / split) for split in splits)
        raise DatasetFormatError(path, f"a DatasetDict with splits {', '.join(map(repr, splits))}: "
                                       f"name one split's directory ({choices})")
    return splits[0]


def _not_saved_reason(path: Path) -> str:
    shards = sorted(path.glob("*.parquet"))
    if shards:
        return (f"a directory of {len(shards)} Parquet files: give one file as data, or load them "
                f"with datasets and save_to_disk the split to read")
    return (f"a directory that is not a dataset saved with datasets' save_to_disk (no "
            f"{SAVED_STATE_FILE} or {SAVED_DICT_FILE})")


def _json_column(path: Path, row: int, column: str, value: Any) -> Any:
    try:
        return _drop_nested_nulls(msgspec.to_builtins(value))
    except (TypeError, msgspec.EncodeError) as exc:
        raise BadRowError(path, row, f"{column!r} holds a {type(value).__name__}, which has no "
                                     "JSON form") from exc


def _drop_nested_nulls(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _drop_nested_nulls(item) for key, item in value.items() if item is not None}
    if isinstance(value, list):
        return [_drop_nested_nulls(item) for item in value]
    return value


def _datasets() -> Any:
    import datasets  # noqa: PLC0415 - ~1 s to import: only when a Parquet or saved dataset is opened

    return datasets


def _pyarrow() -> Any:
    import pyarrow  # noqa: PLC0415 - comes with datasets; imported with it

    return pyarrow


@contextmanager
def _progress_bars_off(datasets: Any) -> Iterator[None]:
    """The library's progress bars off while it converts (they would cut through rollmesh's own
    progress lines), and back as they were after."""
    was_on = not datasets.are_progress_bars_disabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if was_on:
            datasets.enable_progress_bars()
