"""What a stage reads its data through (the ``Dataset`` protocol), and opening one by its path.

A dataset is a JSONL file (``.jsonl``, ``.ndjson``: jsonl.py), a Parquet file (``.parquet``) or a
directory written by Hugging Face ``datasets``' ``save_to_disk`` (both arrow_datasets.py), behind
the same names. ``check_dataset`` is what config loading calls, so a missing file or a field
mapping that fits no row fails before any training starts. Knows the formats' readers and row
mapping; nothing of reading order, NATS, Ray or torch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from rollmesh.data.arrow_datasets import PARQUET_SUFFIXES, open_arrow_dataset
from rollmesh.data.errors import BadRowError, DatasetFormatError, DatasetNotFoundError, EmptyDatasetError
from rollmesh.data.jsonl import JsonlDataset
from rollmesh.data.rows import map_row
from rollmesh.run_config import FieldMap, StageKind

JSONL_SUFFIXES = (".jsonl", ".ndjson")
# Rows config loading tries before it calls a field mapping wrong: enough to see past a few bad
# rows at the top of a file, few enough to stay quick on any file.
PROBE_ROWS = 100


@runtime_checkable
class Dataset(Protocol):
    """Rows by index, each decoded on demand, never all in memory."""

    path: Path

    def __len__(self) -> int: ...

    def raw_row(self, index: int) -> dict[str, Any]:
        """Row ``index`` (0-based) as a dict; BadRowError when it is not one."""
        ...

    def row_label(self, index: int) -> int:
        """Row ``index``'s 1-based number as the file counts it (a JSONL line number; a table's
        row number for Parquet and saved datasets)."""
        ...

    def close(self) -> None:
        """Let go of open files (a later read opens them again)."""
        ...

    def __enter__(self) -> Dataset: ...

    def __exit__(self, *exc_info: object) -> None: ...


def open_dataset(path: Path | str) -> Dataset:
    """The dataset at ``path``, indexed and ready to read; typed errors when it cannot be."""
    path = Path(path)
    if not path.exists():
        raise DatasetNotFoundError(path)
    if path.is_dir() or path.suffix.lower() in PARQUET_SUFFIXES:
        return open_arrow_dataset(path)
    if path.suffix.lower() not in JSONL_SUFFIXES:
        raise DatasetFormatError(path, f"unknown format {path.suffix or '(no suffix)'!r}: rollmesh "
                                       f"reads JSONL ({', '.join(JSONL_SUFFIXES)}), Parquet "
                                       f"({', '.join(PARQUET_SUFFIXES)}) and directories written by "
                                       "datasets' save_to_disk")
    return JsonlDataset(path)


def check_dataset(path: Path | str, *, fields: FieldMap | None = None,
                  kind: StageKind | None = None) -> int:
    """The number of rows at ``path``, or a typed error: DatasetNotFoundError, DatasetFormatError,
    EmptyDatasetError for a file without rows. Given ``fields`` and ``kind``, the first rows are
    also mapped, and when none of the first ``PROBE_ROWS`` fits, the first one's BadRowError is
    raised (a field mapping that names a column the data lacks). Later bad rows are left to the
    reader, which reports and skips them."""
    with open_dataset(path) as dataset:
        if len(dataset) == 0:
            raise EmptyDatasetError(dataset.path, bad_rows=0)
        if fields is not None and kind is not None:
            _probe(dataset, fields, kind)
        return len(dataset)


def _probe(dataset: Dataset, fields: FieldMap, kind: StageKind) -> None:
    """Raise the first row's BadRowError when none of the first PROBE_ROWS rows maps."""
    first: BadRowError | None = None
    for index in range(min(len(dataset), PROBE_ROWS)):
        try:
            map_row(dataset.raw_row(index), fields, kind=kind, path=dataset.path,
                    row=dataset.row_label(index))
            return
        except BadRowError as exc:
            first = first or exc
    assert first is not None
    raise first
