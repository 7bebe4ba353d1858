"""JSONL datasets on real files: the offset index, line numbers of bad rows, opening by path and
the check config loading runs."""

from __future__ import annotations

import json
import pickle
import sys
from pathlib import Path

import pytest

from rollmesh.data import (
    BadRowError,
    Dataset,
    DatasetFormatError,
    DatasetNotFoundError,
    EmptyDatasetError,
    JsonlDataset,
    check_dataset,
    open_dataset,
)
from rollmesh.run_config import FieldMap

pytestmark = pytest.mark.unit


def write(path: Path, text: str) -> Path:
    path.write_bytes(text.encode())
    return path


def test_rows_are_read_by_index_and_blank_lines_are_not_rows(tmp_path: Path) -> None:
    path = write(tmp_path / "d.jsonl", '{"prompt": "a"}\n\n   \n{"prompt": "b"}\r\n\n{"prompt": "c"}')
    dataset = JsonlDataset(path)
    assert len(dataset) == 3
    assert [dataset.raw_row(i)["prompt"] for i in (2, 0, 1)] == ["c", "a", "b"]
    # Line numbers count the blank lines, as an editor does.
    assert [dataset.row_label(i) for i in range(3)] == [1, 4, 6]
    with pytest.raises(IndexError):
        dataset.raw_row(3)


def test_a_unicode_row_and_a_byte_order_mark_read_back(tmp_path: Path) -> None:
    rows = [{"prompt": "数学: 1+1 = ? 🙂"}, {"prompt": "é\u2028x", "answer": "2"}]
    text = "\ufeff" + "\n".join(json.dumps(row, ensure_ascii=False) for row in rows) + "\n"
    dataset = JsonlDataset(write(tmp_path / "u.jsonl", text))
    assert [dataset.raw_row(i) for i in range(2)] == rows


@pytest.mark.parametrize(("line", "reason"), [
    ('{"prompt": "a"', "not JSON"),
    ("not json at all", "not JSON"),
    ('{"prompt": "a"} {"prompt": "b"}', "not JSON"),
    ('["prompt", "a"]', "not a JSON object (a list)"),
    ('"a string"', "not a JSON object (a string)"),
    ("42", "not a JSON object (a number)"),
    ("null", "not a JSON object (null)"),
])
def test_a_line_that_is_not_one_json_object_is_a_bad_row_with_its_line_number(
        tmp_path: Path, line: str, reason: str) -> None:
    path = write(tmp_path / "d.jsonl", f'{{"prompt": "ok"}}\n\n{line}\n{{"prompt": "ok"}}\n')
    dataset = JsonlDataset(path)
    assert dataset.raw_row(0) == {"prompt": "ok"}
    with pytest.raises(BadRowError) as caught:
        dataset.raw_row(1)
    assert (caught.value.path, caught.value.row) == (path, 3)
    assert caught.value.reason.startswith(reason)
    assert str(caught.value).startswith(f"{path}:3: {reason}")
    assert dataset.raw_row(2) == {"prompt": "ok"}


def test_invalid_utf8_in_a_row_is_a_bad_row(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'{"prompt": "ok"}\n{"prompt": "\xff\xfe"}\n')
    with pytest.raises(BadRowError) as caught:
        JsonlDataset(path).raw_row(1)
    assert caught.value.row == 2


def test_a_missing_file_is_a_typed_error_at_open_and_at_check(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere.jsonl"
    for call in (JsonlDataset, open_dataset, check_dataset):
        with pytest.raises(DatasetNotFoundError) as caught:
            call(missing)
        assert caught.value.path == missing
        assert isinstance(caught.value, ValueError)


def test_an_unknown_suffix_is_a_format_error_naming_the_formats_read(tmp_path: Path) -> None:
    # Directories and .parquet files are the datasets library's (tests/test_data_parquet.py).
    with pytest.raises(DatasetFormatError, match="'.csv'.*JSONL.*Parquet.*save_to_disk"):
        open_dataset(write(tmp_path / "d.csv", "a,b\n"))
    with pytest.raises(DatasetFormatError, match="not a file"):
        JsonlDataset(tmp_path)


def test_check_dataset_counts_rows_and_refuses_an_empty_file(tmp_path: Path) -> None:
    assert check_dataset(write(tmp_path / "d.ndjson", '{"a": 1}\n\n{"a": 2}\n')) == 2
    with pytest.raises(EmptyDatasetError, match="no rows"):
        check_dataset(write(tmp_path / "e.jsonl", "\n  \n"))


def test_check_dataset_names_a_field_mapping_that_fits_no_row(tmp_path: Path) -> None:
    path = write(tmp_path / "d.jsonl", '{"question": "1+1", "solution": 2}\n' * 3)
    assert check_dataset(path, fields=FieldMap(prompt="question", answer="solution"), kind="rl") == 3
    with pytest.raises(BadRowError) as caught:
        check_dataset(path, fields=FieldMap(prompt="query"), kind="rl")
    assert caught.value.row == 1
    assert "no 'query' field (fields.prompt)" in caught.value.reason


def test_check_dataset_passes_when_a_later_row_fits(tmp_path: Path) -> None:
    path = write(tmp_path / "d.jsonl", 'oops\n{"text": 5}\n{"text": "words"}\n')
    assert check_dataset(path, fields=FieldMap(prompt="text"), kind="midtrain") == 3


def test_a_dataset_pickles_without_its_open_file(tmp_path: Path) -> None:
    dataset = JsonlDataset(write(tmp_path / "d.jsonl", '{"a": 1}\n{"a": 2}\n'))
    assert dataset.raw_row(0) == {"a": 1}  # opens the file
    copy = pickle.loads(pickle.dumps(dataset))
    dataset.close()
    assert copy.raw_row(1) == {"a": 2}
    assert isinstance(copy, Dataset)
    copy.close()


def test_a_file_that_shrank_after_indexing_is_a_read_error(tmp_path: Path) -> None:
    from rollmesh.data import DatasetReadError

    path = write(tmp_path / "d.jsonl", '{"a": 1}\n{"a": 2}\n')
    dataset = JsonlDataset(path)
    write(path, '{"a": 1}\n')
    with pytest.raises(DatasetReadError, match="shorter"):
        dataset.raw_row(1)
    dataset.close()


def test_the_index_holds_8_bytes_a_row(tmp_path: Path) -> None:
    rows = 200_000
    path = tmp_path / "big.jsonl"
    with path.open("w") as file:
        file.writelines(f'{{"prompt": "{i} + 1", "answer": {i + 1}}}\n' for i in range(rows))
    dataset = JsonlDataset(path)
    assert len(dataset) == rows
    assert dataset.index_nbytes == 8 * rows
    # What the process holds for it, growth slack included: under 9 bytes a row.
    assert sys.getsizeof(dataset.offsets) < 9 * rows
    assert dataset.raw_row(rows - 1) == {"prompt": f"{rows - 1} + 1", "answer": rows}
    assert dataset.row_label(rows - 1) == rows
    dataset.close()
