"""Parquet files and ``datasets`` saved to disk, on real files written by pyarrow and datasets:
read through open_dataset and the PromptReader, row numbers, bad rows, memory mapping, the
conversion cache, pickling, and the run-file check."""

from __future__ import annotations

import os
import pickle
import socket
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rollmesh.config import load_config
from rollmesh.data import (
    BadRowError,
    Dataset,
    DatasetFormatError,
    DatasetNotFoundError,
    DatasetReadError,
    EpochOrder,
    ParquetDataset,
    PromptReader,
    SavedDataset,
    check_dataset,
    open_dataset,
)
from rollmesh.run_config import FieldMap
from rollmesh.train.checks import RunFileError, check_stages

pytestmark = pytest.mark.unit

QUESTIONS = {"question": ["1+1?", None, "2+3?", "7-4?"], "solution": [2, 9, 5, 3]}
TOOL_CALL = {"type": "function", "function": {"name": "python", "arguments": '{"code": "1+1"}'}}
CHATS = [
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}],
    [{"role": "user", "content": "1+1 in python?"},
     {"role": "assistant", "content": None, "tool_calls": [TOOL_CALL]},
     {"role": "tool", "content": "2"}, {"role": "assistant", "content": "It is 2."}],
]


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Parquet conversions go under tmp_path, never into the home directory."""
    monkeypatch.setenv("ROLLMESH_DATASETS_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def write_parquet(path: Path, columns: dict[str, list]) -> Path:
    pq.write_table(pa.table(columns), path)
    return path


def read_all(prompts: PromptReader, count: int) -> list:
    rows, position = [], 0
    for _ in range(count):
        position, row, _, index = prompts.read(position)
        rows.append((index, row))
    return rows


def test_a_parquet_file_reads_through_the_field_mapping_and_a_null_prompt_is_a_bad_row(tmp_path):
    path = write_parquet(tmp_path / "d.parquet", QUESTIONS)
    dataset = open_dataset(path)
    assert isinstance(dataset, ParquetDataset) and isinstance(dataset, Dataset)
    assert len(dataset) == 4 and [dataset.row_label(i) for i in range(4)] == [1, 2, 3, 4]
    assert dataset.raw_row(2) == {"question": "2+3?", "solution": 5}
    assert type(dataset.raw_row(2)["solution"]) is int  # a Python int, not numpy's
    reports: list[BadRowError] = []
    prompts = PromptReader(dataset, FieldMap(prompt="question", answer="solution"), "rl",
                           EpochOrder(4, shuffle=False, seed=0), reports.append)
    rows = read_all(prompts, 4)
    assert [(index, row.prompt_text, row.answer) for index, row in rows] == [
        (0, "1+1?", "2"), (2, "2+3?", "5"), (3, "7-4?", "3"), (0, "1+1?", "2")]
    # Parquet gives every row every column: the null question is an absent one, reported with
    # the file and its 1-based row number.
    assert [(error.path, error.row) for error in reports] == [(path, 2)]
    assert "no 'question' field (fields.prompt)" in str(reports[0])
    assert str(reports[0]).startswith(f"{path}:2: ")
    dataset.close()


def test_a_messages_column_of_structs_comes_back_as_the_chat_it_was(tmp_path):
    path = write_parquet(tmp_path / "chat.parquet", {"conversation": CHATS, "source": ["a", "b"]})
    with open_dataset(path) as dataset:
        prompts = PromptReader(dataset, FieldMap(messages="conversation"), "sft",
                               EpochOrder(2, shuffle=False, seed=0))
        rows = [row for _, row in read_all(prompts, 2)]
    # Arrow gave every message every key (a user message's tool_calls: null); the reader drops
    # those nulls, so the messages are the dicts that were written, minus their own nulls.
    assert rows[0].messages == CHATS[0]
    assert rows[1].messages[1] == {"role": "assistant", "tool_calls": [TOOL_CALL]}
    assert rows[1].messages[2:] == CHATS[1][2:]
    assert all(type(message) is dict for message in rows[1].messages)
    assert type(rows[1].raw["conversation"]) is list


def test_a_saved_dataset_is_mapped_where_it_lies_and_read_lazily(tmp_path, cache):
    saved = tmp_path / "saved"
    datasets.Dataset.from_dict(QUESTIONS).save_to_disk(saved)
    assert {"state.json", "dataset_info.json"} <= {p.name for p in saved.iterdir()}
    dataset = open_dataset(saved)
    assert isinstance(dataset, SavedDataset)
    assert check_dataset(saved, fields=FieldMap(prompt="question"), kind="rl") == 4
    # Memory-mapped: the table is backed by the directory's own Arrow file, not a copy in RAM,
    # and no conversion was written to the cache.
    table = dataset._open()
    assert type(table.data).__name__ == "MemoryMappedTable"
    assert [Path(f["filename"]).parent for f in table.cache_files] == [saved]
    assert not cache.exists()
    prompts = PromptReader(dataset, FieldMap(prompt="question", answer="solution"), "rl",
                           EpochOrder(4, shuffle=True, seed=3))
    indices = [index for index, _ in read_all(prompts, 3)]
    assert sorted(indices) == [0, 2, 3] and prompts.bad_rows == 1
    assert dataset.row_label(3) == 4


def test_a_saved_format_does_not_change_rows_they_stay_python_values(tmp_path):
    saved = tmp_path / "numpy"
    ds = datasets.Dataset.from_dict({"prompt": ["a", "b"], "scores": [[1, 2], [3, 4]]})
    ds.set_format("numpy", columns=["scores"])
    ds.save_to_disk(saved)
    row = open_dataset(saved).raw_row(1)
    assert row == {"prompt": "b", "scores": [3, 4]} and type(row["scores"]) is list


def test_a_value_with_no_json_form_is_a_bad_row_naming_its_column(tmp_path):
    image = pytest.importorskip("PIL.Image").new("RGB", (2, 2))
    features = datasets.Features({"prompt": datasets.Value("string"), "img": datasets.Image()})
    datasets.Dataset.from_dict({"prompt": ["a"], "img": [image]}, features=features).save_to_disk(
        tmp_path / "images")
    with pytest.raises(BadRowError, match=r"images:1: 'img' holds a \w+ImageFile, which has no JSON form"):
        open_dataset(tmp_path / "images").raw_row(0)


def test_a_dataset_dict_is_read_by_its_split_directory(tmp_path):
    both = tmp_path / "both"
    split = datasets.Dataset.from_dict({"prompt": ["p"], "answer": ["1"]})
    datasets.DatasetDict({"train": split, "test": split}).save_to_disk(both)
    with pytest.raises(DatasetFormatError) as refused:
        open_dataset(both)
    assert "'train'" in refused.value.reason and str(both / "test") in refused.value.reason
    assert open_dataset(both / "test").raw_row(0) == {"prompt": "p", "answer": "1"}
    single = tmp_path / "single"
    datasets.DatasetDict({"validation": split}).save_to_disk(single)
    dataset = open_dataset(single)
    assert dataset.split == "validation" and len(dataset) == 1 and dataset.path == single


def test_paths_that_are_no_dataset_get_typed_errors(tmp_path):
    for missing in (tmp_path / "none.parquet", tmp_path / "no_dir"):
        with pytest.raises(DatasetNotFoundError):
            open_dataset(missing)
        with pytest.raises(DatasetNotFoundError):
            check_dataset(missing)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DatasetFormatError, match="save_to_disk"):
        open_dataset(tmp_path / "empty")
    shards = tmp_path / "shards"
    shards.mkdir()
    write_parquet(shards / "train-0.parquet", {"prompt": ["a"]})
    with pytest.raises(DatasetFormatError, match="1 Parquet files: give one file"):
        check_dataset(shards)
    (tmp_path / "bad.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(DatasetReadError):
        open_dataset(tmp_path / "bad.parquet")


def test_the_conversion_is_cached_once_and_redone_when_the_file_changes(tmp_path, cache):
    path = write_parquet(tmp_path / "d.parquet", {"prompt": ["a", "b"]})
    first = open_dataset(path)
    (arrow,) = [Path(f["filename"]) for f in first._open().cache_files]
    assert arrow.is_relative_to(cache)
    converted_at = arrow.stat().st_mtime_ns
    again = open_dataset(path)
    assert [Path(f["filename"]) for f in again._open().cache_files] == [arrow]
    assert arrow.stat().st_mtime_ns == converted_at  # mapped, not converted again
    write_parquet(path, {"prompt": ["c", "d", "e"]})
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert [open_dataset(path).raw_row(i)["prompt"] for i in range(3)] == ["c", "d", "e"]
    # A reader opened before the change refuses to read on instead of mixing two files.
    first.close()
    with pytest.raises(DatasetReadError, match="changed since it was opened: 2 rows then, 3 now"):
        first.raw_row(0)


def test_no_network_and_nothing_under_huggingfaces_cache(tmp_path, monkeypatch):
    monkeypatch.delenv("ROLLMESH_DATASETS_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf")

    def refuse(*args, **kwargs):
        raise AssertionError(f"a network call: {args}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    path = write_parquet(tmp_path / "d.parquet", {"prompt": ["a"]})
    assert open_dataset(path).raw_row(0) == {"prompt": "a"}
    assert list((tmp_path / "xdg" / "rollmesh" / "datasets").rglob("*.arrow"))
    assert not (tmp_path / "hf").exists()


def test_a_reader_pickles_without_its_rows(tmp_path):
    rows = {"prompt": [f"question {i} " + "x" * 100 for i in range(2000)]}
    saved = tmp_path / "saved"
    datasets.Dataset.from_dict(rows).save_to_disk(saved)
    for path in (write_parquet(tmp_path / "d.parquet", rows), saved):
        dataset = open_dataset(path)
        prompts = PromptReader(dataset, FieldMap(), "rl", EpochOrder(2000, shuffle=True, seed=1))
        prompts.read(0)
        blob = pickle.dumps(prompts)
        assert len(blob) < 10_000  # the files are mapped again, not shipped (200 KB of rows)
        copy = pickle.loads(blob)
        assert copy.read(1500)[1] == prompts.read(1500)[1]


RUN_FILE = """
[[stages]]
kind = "rl"
data = "d.parquet"
fields = {{prompt = "question", answer = "solution"}}
steps = 2
[[stages.rewards]]
name = "exact_match"

[[stages]]
kind = "sft"
data = "chat.parquet"
fields = {{messages = "{messages}"}}
steps = 1
"""


def test_a_run_file_naming_parquet_data_passes_the_stage_check(tmp_path):
    write_parquet(tmp_path / "d.parquet", QUESTIONS)
    write_parquet(tmp_path / "chat.parquet", {"conversation": CHATS})
    run_file = tmp_path / "run.toml"
    run_file.write_text(RUN_FILE.format(messages="conversation"))
    check_stages(load_config(run_file, environ={}))
    run_file.write_text(RUN_FILE.format(messages="chat"))
    with pytest.raises(RunFileError, match=r"chat.parquet:1: no 'chat' field \(fields.messages\)"):
        check_stages(load_config(run_file, environ={}))
