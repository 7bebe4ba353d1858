"""benchmarks/feeder_resume.py's counting, from ledger files written here: what the real run's
``skipped``, ``repeated`` and its naive-resume baseline are computed by (no mesh, no job)."""

from __future__ import annotations

import importlib.util
import json
import random
import sys
from pathlib import Path

import pytest

from rollmesh.data.order import EpochOrder

pytestmark = pytest.mark.unit

_PATH = Path(__file__).resolve().parent.parent / "benchmarks" / "feeder_resume.py"
_spec = importlib.util.spec_from_file_location("feeder_resume_benchmark", _PATH)
bench = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = bench  # dataclasses look their module up while the class is made
_spec.loader.exec_module(bench)


def write_ledger(path: Path, steps: list[list[str]], torn: str = "") -> Path:
    lines = [json.dumps({"step": number, "weight_version": number, "weights_path": "", "keys": [],
                         "groups": groups}) for number, groups in enumerate(steps, start=1)]
    path.write_text("\n".join(lines) + "\n" + torn)
    return path


def test_skipped_and_repeated_count_dataset_indices_and_ignore_torn_lines_and_other_stages(tmp_path):
    ledger = write_ledger(tmp_path / "ledger.jsonl", [
        ["rl/e0/i0", "rl/e0/i1"],
        ["rl/e0/i1", "sft/e0/i2", "demo-g001"],  # i1 again; another stage's and another client's group
        ["rl/e1/i0", "rl/e0/i3"],  # row 0 read again in the next epoch
    ], torn='{"step": 4, "weight_version": 4, "groups": ["rl/e0/i2"')  # a kill mid-write
    steps = bench.read_ledger_groups(ledger)
    assert [step for step, _ in steps] == [1, 2, 3]
    counted = bench.count_consumption(steps, num_rows=5)
    assert counted == bench.Consumption(consumed=5, distinct=3, skipped=2, repeated=2)  # i2, i4 never


def test_a_clean_epoch_counts_nothing(tmp_path):
    ledger = write_ledger(tmp_path / "ledger.jsonl", [["rl/e0/i3", "rl/e0/i0"], ["rl/e0/i2", "rl/e0/i1"]])
    counted = bench.count_consumption(bench.read_ledger_groups(ledger), num_rows=4)
    assert (counted.skipped, counted.repeated, counted.distinct) == (0, 0, 4)


def test_the_naive_resume_skips_in_flight_positions_below_steps_x_groups_and_repeats_consumed_ones_above():
    order = EpochOrder(10, shuffle=False, seed=0)
    # 2 steps of 2 groups: N = 4. Positions 0, 1, 3, 5 consumed: 2 in flight below N, 5 at or above.
    steps = [(7, ["rl/e0/i1", "rl/e0/i0"]), (8, ["rl/e0/i5", "rl/e0/i3"])]
    naive = bench.naive_resume_errors(steps, {"start_step": 6, "next_position": 7}, order, groups_per_step=2)
    assert naive == bench.NaiveResume(steps=2, naive_position=4, next_position=7, consumed=4,
                                     skipped=1, repeated=1)


def test_the_naive_resume_reads_positions_in_the_shuffled_order():
    order = EpochOrder(10, shuffle=True, seed=3)
    first = [order.at(position)[1] for position in range(4)]
    assert [bench.position_of(order, 0, index) for index in first] == [0, 1, 2, 3]
    in_order = [(1, [f"rl/e0/i{first[0]}", f"rl/e0/i{first[1]}"]), (2, [f"rl/e0/i{first[3]}", f"rl/e0/i{first[2]}"])]
    naive = bench.naive_resume_errors(in_order, {"start_step": 0, "next_position": 6}, order, groups_per_step=2)
    assert (naive.skipped, naive.repeated) == (0, 0)  # completion order within N does not matter
    ahead = [(1, [f"rl/e0/i{first[0]}", f"rl/e0/i{order.at(5)[1]}"])]
    naive = bench.naive_resume_errors(ahead, {"start_step": 0, "next_position": 6}, order, groups_per_step=2)
    assert (naive.skipped, naive.repeated) == (1, 1)


def test_kill_points_are_distinct_ascending_and_inside_the_window():
    points = bench.kill_points(random.Random(5), total_steps=125, kills=2)
    assert points == sorted(set(points)) and len(points) == 2
    assert all(12 <= point <= 100 for point in points)


def test_the_rule_at_every_step_sees_each_ledger_prefix():
    order = EpochOrder(6, shuffle=False, seed=0)
    steps = [(1, ["rl/e0/i0", "rl/e0/i2"]), (2, ["rl/e0/i1", "rl/e0/i3"]), (3, ["rl/e0/i4", "rl/e0/i5"])]
    every = bench.naive_errors_at_every_step(steps, 0, order, groups_per_step=2)
    assert [(n.steps, n.skipped, n.repeated) for n in every] == [(1, 1, 1), (2, 0, 0), (3, 0, 0)]
