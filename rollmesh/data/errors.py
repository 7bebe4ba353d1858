"""Errors raised while opening and reading datasets.

Knows nothing but the standard library. Every error is a ``ValueError`` (bad input), so the config
loader's ``except ValueError`` turns one found at load into a config error. Foreign exceptions
(OSError, msgspec's DecodeError) are wrapped at the boundary with ``raise X(...) from exc``::

    DatasetError               root of every dataset error (path)
    +-- DatasetNotFoundError   the dataset file does not exist
    +-- DatasetFormatError     not a dataset rollmesh reads (an unknown suffix, a directory that is
    |                          no saved dataset, a DatasetDict of several splits) (reason)
    +-- DatasetReadError       the file could not be read, or changed since it was indexed (reason)
    +-- BadRowError            one row cannot be used (row: 1-based, as the file counts it; reason)
    +-- EmptyDatasetError      no row of the dataset can be used (bad_rows: how many are bad)
"""

from __future__ import annotations

from pathlib import Path


class DatasetError(ValueError):
    """Root of every dataset error; ``path`` is the dataset's file."""

    def __init__(self, message: str, *, path: Path | str) -> None:
        super().__init__(message)
        self.path = Path(path)


class DatasetNotFoundError(DatasetError):
    """The dataset file does not exist."""

    def __init__(self, path: Path | str) -> None:
        super().__init__(f"dataset {path}: no such file", path=path)


class DatasetFormatError(DatasetError):
    """A path rollmesh cannot read as a dataset: a suffix it does not know, a directory that
    ``datasets``' ``save_to_disk`` did not write, a saved DatasetDict with several splits."""

    def __init__(self, path: Path | str, reason: str) -> None:
        super().__init__(f"dataset {path}: {reason}", path=path)
        self.reason = reason


class DatasetReadError(DatasetError):
    """The file failed to read (an OSError), or is shorter than when it was indexed."""

    def __init__(self, path: Path | str, reason: str) -> None:
        super().__init__(f"dataset {path}: {reason}", path=path)
        self.reason = reason


class BadRowError(DatasetError):
    """One row cannot be used: not JSON, not an object, a missing field or a wrong type.

    ``row`` is the 1-based number a person finds the row by (a JSONL file's line number, blank
    lines counted; a Parquet or saved dataset's row number); ``reason`` names the field as the row
    spells it and the config key that maps it, e.g. ``no 'question' field (fields.prompt)``. The
    message reads ``path:row: reason``."""

    def __init__(self, path: Path | str, row: int, reason: str) -> None:
        super().__init__(f"{path}:{row}: {reason}", path=path)
        self.row = row
        self.reason = reason


class EmptyDatasetError(DatasetError):
    """No row can be used: the file has no rows, or every one of them is bad (``bad_rows``)."""

    def __init__(self, path: Path | str, bad_rows: int) -> None:
        detail = f"all {bad_rows} rows are bad" if bad_rows else "no rows"
        super().__init__(f"dataset {path}: {detail}", path=path)
        self.bad_rows = bad_rows


def json_type(value: object) -> str:
    """JSON's name for ``value``'s type with its article, as reasons spell it: 'a list', 'an
    object', 'null'."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    names = {dict: "an object", list: "a list", str: "a string", int: "a number", float: "a number"}
    return names.get(type(value), f"a {type(value).__name__}")
