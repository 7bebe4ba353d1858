"""rollmesh.data: the datasets stages read, row by row, without holding them in memory.

Plain logic: imports neither ray, nats nor torch. ``dataset`` is the ``Dataset`` protocol and
opening one by path (``check_dataset`` for config loading); ``jsonl`` reads a JSONL file through an
index of line offsets (8 bytes a row); ``arrow_datasets`` reads Parquet files and ``datasets``
saved to disk as memory-mapped Arrow through the ``datasets`` library; ``rows`` maps a raw row to
a ``PromptRow`` by the stage's ``fields`` and kind; ``order`` is the reading order over epochs
(file order or seeded shuffles); ``reader`` reads rows in that order, reporting and skipping bad
ones; ``errors`` holds the typed errors. docs/datasets.md describes the formats.
"""

from rollmesh.data.arrow_datasets import (
    DATASETS_CACHE_ENV,
    PARQUET_SUFFIXES,
    ArrowDataset,
    ParquetDataset,
    SavedDataset,
    datasets_cache_dir,
)
from rollmesh.data.dataset import JSONL_SUFFIXES, Dataset, check_dataset, open_dataset
from rollmesh.data.errors import (
    BadRowError,
    DatasetError,
    DatasetFormatError,
    DatasetNotFoundError,
    DatasetReadError,
    EmptyDatasetError,
)
from rollmesh.data.jsonl import JsonlDataset
from rollmesh.data.order import EpochOrder
from rollmesh.data.reader import PromptReader
from rollmesh.data.rows import ROLES, PromptRow, map_row

__all__ = [
    "DATASETS_CACHE_ENV",
    "JSONL_SUFFIXES",
    "PARQUET_SUFFIXES",
    "ROLES",
    "ArrowDataset",
    "BadRowError",
    "Dataset",
    "DatasetError",
    "DatasetFormatError",
    "DatasetNotFoundError",
    "DatasetReadError",
    "EmptyDatasetError",
    "EpochOrder",
    "JsonlDataset",
    "ParquetDataset",
    "PromptReader",
    "PromptRow",
    "SavedDataset",
    "check_dataset",
    "datasets_cache_dir",
    "map_row",
    "open_dataset",
]
