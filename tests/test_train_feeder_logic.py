"""The training job's plain logic: prompt ids, the durable cursor, the feeder's window, the prompt
sources and the run-file checks (no NATS, no Ray)."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from rollmesh.config import RollmeshConfig, TrainerConfig
from rollmesh.run_config import EvalConfig, StageConfig
from rollmesh.train.checks import RunFileError, check_stages
from rollmesh.train.feeder_cursor import FeederCursor, read_cursor, write_cursor
from rollmesh.train.job import TrainerSettingsError, check_trainer_settings
from rollmesh.train.feeder_window import FeederWindow, StagePlan, stage_steps
from rollmesh.training.prompt_ids import PromptRef, parse_group_id
from rollmesh.train.prompt_source import prompt_source

pytestmark = pytest.mark.unit


def rl_stage(data: Path, **fields) -> StageConfig:
    return msgspec.convert({"kind": "rl", "data": str(data), "steps": 2,
                            "rewards": [{"name": "exact_match"}], **fields}, StageConfig)


def write_rows(path: Path, rows: list[object]) -> Path:
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))
    return path


def test_a_group_id_names_stage_epoch_and_row_and_parses_back():
    ref = PromptRef("rl-2", 3, 41)
    assert ref.group_id == "rl-2/e3/i41"
    assert parse_group_id(ref.group_id) == ref
    assert ref.rollout_id("run7", 1) == "run7-rl-2-e3-i41-1"
    assert parse_group_id("demo-g001") is None  # another client's group


def test_the_cursor_round_trips_and_a_fresh_run_has_none(tmp_path):
    assert read_cursor(tmp_path) is None
    cursor = FeederCursor(stage_index=1, stage="rl", start_step=4, next_position=9, outstanding=["rl/e0/i3"])
    write_cursor(tmp_path, cursor)
    assert read_cursor(tmp_path) == cursor


def plan(steps: int = 3, groups_per_step: int = 2, ahead: int = 2) -> StagePlan:
    return StagePlan(name="rl", stage_index=0, steps=steps, groups_per_step=groups_per_step, max_groups_ahead=ahead)


def test_the_window_keeps_groups_per_step_plus_max_ahead_outstanding_and_never_more_than_the_stage_needs():
    window = FeederWindow(plan(steps=3, groups_per_step=2, ahead=2), FeederCursor(stage="rl", start_step=10))
    assert window.wanted(10) == 4  # 2 + 2 ahead, of the 6 the stage needs
    for position in range(4):
        window.published(f"rl/e0/i{position}", position + 1)
    assert window.wanted(10) == 0
    window.consumed(["rl/e0/i0", "rl/e0/i1"])  # step 11
    assert window.wanted(11) == 2  # 4 still needed, 2 outstanding
    window.published("rl/e0/i4", 5)
    window.published("rl/e0/i5", 6)
    window.consumed(["rl/e0/i2", "rl/e0/i3"])  # step 12: 2 needed, 2 outstanding
    assert window.wanted(12) == 0 and not window.finished(12)
    window.consumed(["rl/e0/i4", "rl/e0/i5"])
    assert window.finished(13) and window.wanted(13) == 0 and window.cursor.outstanding == []


def test_a_dropped_group_frees_its_place_once_and_is_counted():
    window = FeederWindow(plan(steps=1, groups_per_step=2, ahead=0), FeederCursor(stage="rl", start_step=0))
    window.published("rl/e0/i0", 1)
    window.published("rl/e0/i1", 2)
    assert window.wanted(0) == 0
    window.dropped("rl/e0/i1")
    window.dropped("rl/e0/i1")  # announced again by a restarted trainer: still one replacement
    assert window.wanted(0) == 1 and window.cursor.dropped == 1


def test_stage_steps_cover_every_row_of_every_epoch_in_whole_steps():
    assert stage_steps(steps=7, epochs=0, num_rows=100, groups_per_step=4) == 7
    assert stage_steps(steps=0, epochs=1, num_rows=500, groups_per_step=4) == 125
    assert stage_steps(steps=0, epochs=2, num_rows=5, groups_per_step=4) == 3  # 10 rows, rounded up


def test_a_dataset_stage_makes_the_dataset_tasks_input_and_reports_bad_rows(tmp_path):
    data = write_rows(tmp_path / "d.jsonl", [{"question": "1+1?", "solution": 2}, "not json",
                                            {"messages": [{"role": "system", "content": "own"},
                                                          {"role": "user", "content": "2+2?"}], "solution": "4"}])
    stage = rl_stage(data, shuffle=False, system_prompt="Be brief.",
                     fields={"prompt": "question", "answer": "solution"})
    bad: list[Exception] = []
    source = prompt_source(stage, "rl", on_bad_row=bad.append)
    position, ref, task_input = source.at(0)
    assert (position, ref.group_id, source.task) == (1, "rl/e0/i0", "dataset")
    assert task_input["messages"] == [{"role": "system", "content": "Be brief."},
                                      {"role": "user", "content": "1+1?"}]
    assert task_input["answer"] == "2" and task_input["rewards"] == [{"name": "exact_match", "fn": "", "weight": 1.0, "args": {}}]
    position, ref, task_input = source.at(position)  # the bad line is skipped and reported
    assert (position, ref.index) == (3, 2) and len(bad) == 1 and ":2:" in str(bad[0])
    assert [m["role"] for m in task_input["messages"]] == ["system", "user"]  # its own system kept, not two
    assert source.at(position)[1] == PromptRef("rl", 1, 0)  # the next epoch
    source.close()


def test_a_task_plugin_stage_without_data_samples_the_same_input_for_the_same_position():
    stage = msgspec.convert({"kind": "rl", "task": "rollmesh.rollout.molar_mass:MolarMassTask", "steps": 1},
                            StageConfig)
    first, again = prompt_source(stage, "rl"), prompt_source(stage, "rl")
    assert first.at(5) == again.at(5) and first.at(5) != first.at(6)
    assert first.task == "molar_mass"


def config_with(*stages: StageConfig, trainer: TrainerConfig = TrainerConfig()) -> RollmeshConfig:
    return msgspec.structs.replace(RollmeshConfig(), stages=list(stages), trainer=trainer)


@pytest.mark.parametrize(("change", "message"), [
    ({"data": "missing.jsonl"}, "missing.jsonl: no such file"),
    ({"fields": {"prompt": "nope", "messages": "nope2"}}, "nope"),
    ({"rewards": [{"fn": "no_such_module_x:f"}]}, "no_such_module_x"),
    ({"kind": "sft"}, "no 'messages' field"),
])
def test_a_bad_run_file_is_refused_before_anything_starts(tmp_path, change, message):
    data = write_rows(tmp_path / "d.jsonl", [{"prompt": "1+1?", "answer": "2"}])
    fields = {"kind": "rl", "data": str(data), "steps": 2, "rewards": [{"name": "exact_match"}], **change}
    if "data" in change:
        fields["data"] = str(tmp_path / change["data"])
    if change.get("kind") == "sft":
        fields.pop("rewards")
    with pytest.raises(RunFileError, match=message):
        check_stages(config_with(msgspec.convert(fields, StageConfig)))


def test_an_attached_trainer_running_other_settings_is_refused_naming_them():
    wanted = TrainerConfig(groups_per_step=2, n_samples_per_prompt=2)
    check_trainer_settings("rl", msgspec.to_builtins(wanted), wanted)
    running = msgspec.to_builtins(TrainerConfig(groups_per_step=2, n_samples_per_prompt=3, lr=1e-5))
    with pytest.raises(TrainerSettingsError) as refused:
        check_trainer_settings("rl", running, wanted)
    assert refused.value.fields == ["lr", "n_samples_per_prompt"] and "trainer.lr" in str(refused.value)


def test_a_mixture_interleaves_its_datasets_by_weight_and_replays_to_a_position_out_of_turn(tmp_path):
    easy = write_rows(tmp_path / "easy.jsonl", [{"prompt": f"easy {i}", "answer": str(i)} for i in range(5)])
    hard = write_rows(tmp_path / "hard.jsonl", [{"question": f"hard {i}", "answer": str(i)} for i in range(3)])
    stage = msgspec.convert({"kind": "rl", "steps": 2, "rewards": [{"name": "exact_match"}], "shuffle": False,
                             "mixture": [{"data": str(easy), "weight": 3.0},
                                         {"data": str(hard), "weight": 1.0, "fields": {"prompt": "question"}}]},
                            StageConfig)
    source = prompt_source(stage, "rl")
    refs, position = [], 0
    for _ in range(12):
        position, ref, task_input = source.at(position)
        refs.append(ref.group_id)
    # 3 easy for each hard, each source in its own order over its own epochs.
    assert [group.split("/")[0] for group in refs] == ["rl.easy", "rl.easy", "rl.hard", "rl.easy"] * 3
    assert refs[:4] == ["rl.easy/e0/i0", "rl.easy/e0/i1", "rl.hard/e0/i0", "rl.easy/e0/i2"]
    assert "rl.easy/e1/i0" in refs  # 9 easy prompts from 5 rows: the second epoch began
    assert [group for group in refs if group.startswith("rl.hard")] == [f"rl.hard/e0/i{i}" for i in range(3)]
    index = int(refs[-1].rsplit("/i", 1)[1])
    assert task_input["messages"] == [{"role": "user", "content": f"easy {index}"}]  # its own field mapping
    # A resumed feeder asks for a position out of turn: the same prompt as in the first pass.
    again = prompt_source(stage, "rl")
    assert again.at(7)[1].group_id == refs[7] and again.at(2)[1].group_id == refs[2]
    check_stages(config_with(stage))


def test_an_eval_whose_data_or_reward_cannot_load_is_refused_before_anything_starts(tmp_path):
    data = write_rows(tmp_path / "d.jsonl", [{"prompt": "1+1?", "answer": "2"}])
    missing = msgspec.convert({"name": "held", "data": str(tmp_path / "gone.jsonl"), "rewards": [{"name": "math"}]},
                              EvalConfig)
    with pytest.raises(RunFileError, match="eval held.*gone.jsonl: no such file"):
        check_stages(msgspec.structs.replace(config_with(rl_stage(data)), eval=[missing]))
    bad_reward = msgspec.convert({"data": str(data), "rewards": [{"fn": "no_such_module_y:f"}]}, EvalConfig)
    with pytest.raises(RunFileError, match="no_such_module_y"):
        check_stages(msgspec.structs.replace(config_with(rl_stage(data)), eval=[bad_reward]))


async def test_eval_every_counts_only_the_named_stages_steps_and_a_step_is_evaluated_once(tmp_path):
    from rollmesh.tracking import Trackers
    from rollmesh.train.eval_schedule import EvalSchedule
    from rollmesh.train.evaluation import EvalResult

    ran: list[int] = []

    class Recorded:
        def __init__(self, name: str) -> None:
            self.name = name

        async def run(self, step: int) -> EvalResult:
            ran.append(step)
            return EvalResult(self.name, step, {"mean@1": 0.5}, [], tmp_path / f"{step}.jsonl")

    data = write_rows(tmp_path / "d.jsonl", [{"prompt": "1+1?", "answer": "2"}])
    config = msgspec.convert({"data": str(data), "rewards": [{"name": "math"}], "eval_every": 2,
                              "stages": ["rl"]}, EvalConfig)
    schedule = EvalSchedule([config], make=lambda cfg, name: Recorded(name), run_dir=tmp_path,
                            trackers=Trackers([]), report=lambda line: None)
    schedule.before_training(0)
    for step in range(1, 5):
        schedule.after_step(step, "warm_start")  # a supervised stage: not counted
    for step in range(5, 9):
        schedule.after_step(step, "rl")
    await schedule.after_training(8)  # step 8 was evaluated already: not twice
    assert sorted(ran) == [0, 6, 8]
    assert schedule.mean_rewards() == [(0, 0.5), (6, 0.5), (8, 0.5)]
