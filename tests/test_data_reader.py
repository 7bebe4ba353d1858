"""Reading a stage's rows in order over epochs, bad rows reported once per epoch and skipped."""

from __future__ import annotations

from pathlib import Path

import pytest

import rollmesh.data
from rollmesh.data import BadRowError, EmptyDatasetError, EpochOrder, JsonlDataset, PromptReader
from rollmesh.run_config import FieldMap

pytestmark = pytest.mark.unit

# Lines 2 (not JSON), 4 (no 'question') and 6 (a list) are bad; 5 is blank.
LINES = ['{"question": "q0", "answer": 0}', "{oops", '{"question": "q1"}', '{"prompt": "x"}', "",
         '[1]', '{"question": "q2", "answer": "2"}']


def reader(tmp_path: Path, *, shuffle: bool = False, lines: list[str] = LINES,
           reports: list[BadRowError] | None = None) -> PromptReader:
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(lines) + "\n")
    dataset = JsonlDataset(path)
    order = EpochOrder(len(dataset), shuffle=shuffle, seed=5)
    sink = reports.append if reports is not None else None
    return PromptReader(dataset, FieldMap(prompt="question"), "rl", order, sink)


def read_all(prompts: PromptReader, count: int, position: int = 0) -> list[tuple[int, str, int, int]]:
    out = []
    for _ in range(count):
        position, row, epoch, index = prompts.read(position)
        out.append((position, row.prompt_text, epoch, index))
    return out


def test_bad_rows_are_skipped_and_reported_once_per_epoch_with_their_line(tmp_path: Path) -> None:
    reports: list[BadRowError] = []
    prompts = reader(tmp_path, reports=reports)
    got = read_all(prompts, 6)
    assert got == [(1, "q0", 0, 0), (3, "q1", 0, 2), (6, "q2", 0, 5),
                   (7, "q0", 1, 0), (9, "q1", 1, 2), (12, "q2", 1, 5)]
    assert [error.row for error in reports] == [2, 4, 6, 2, 4, 6]
    assert "no 'question' field (fields.prompt)" in reports[1].reason
    assert prompts.bad_rows == 6
    # Reading the same positions again reports nothing new within the epoch.
    assert read_all(prompts, 3, position=6) == got[3:]
    assert prompts.bad_rows == 6


def test_the_same_position_gives_the_same_row_in_a_fresh_reader(tmp_path: Path) -> None:
    lines = [f'{{"question": "q{i}"}}' if i % 3 else "bad" for i in range(30)]
    first = read_all(reader(tmp_path, shuffle=True, lines=lines), 45)
    resumed_at = first[20][0]
    resumed = read_all(reader(tmp_path, shuffle=True, lines=lines), 24, position=resumed_at)
    assert resumed == first[21:]
    # Over two epochs, each good row is read once per epoch.
    assert sorted(text for _, text, epoch, _ in first if epoch == 0) == sorted(
        f"q{i}" for i in range(30) if i % 3)


def test_an_all_bad_file_raises_instead_of_looping(tmp_path: Path) -> None:
    reports: list[BadRowError] = []
    prompts = reader(tmp_path, shuffle=True, lines=["{oops", '{"prompt": "x"}', "", "[1]"],
                     reports=reports)
    with pytest.raises(EmptyDatasetError) as caught:
        prompts.read(2)
    assert caught.value.bad_rows == 3
    assert caught.value.path == tmp_path / "d.jsonl"
    assert {error.row for error in reports} == {1, 2, 4}


def test_an_order_over_another_number_of_rows_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "a"}\n')
    with pytest.raises(ValueError, match="an order over 2 rows"):
        PromptReader(JsonlDataset(path), FieldMap(), "rl", EpochOrder(2, shuffle=False, seed=0))


def test_the_package_exports_its_public_names() -> None:
    assert all(hasattr(rollmesh.data, name) for name in rollmesh.data.__all__)
