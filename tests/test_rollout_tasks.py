"""Task plugins, the tool-call syntax and trajectory bookkeeping: plain logic, no bus, no model."""

from __future__ import annotations

import random

import pytest

from rollmesh.rollout.errors import RolloutError
from rollmesh.rollout.molar_mass import (
    HELD_OUT_MODULUS,
    MolarMassTask,
    is_held_out,
    sample_formulas,
    true_molar_mass,
)
from rollmesh.rollout.tasks import (
    DemonstrableTask,
    Task,
    TaskInputError,
    TaskRegistry,
    ToolCall,
    ToolOutput,
    Transcript,
    UnknownTaskError,
    load_task,
)
from rollmesh.rollout.tool_syntax import (
    MAX_ARGUMENT_CHARS,
    format_tool_output,
    parse_tool_call,
    stop_strings,
)
from rollmesh.messages import NO_VERSION, TokenTrace
from rollmesh.rollout.trajectory import Trajectory
from rollmesh.sandbox.tool_paths import tool_script_path

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

TASK = MolarMassTask()
FORMULA = "K2NaN2"
MASS = true_molar_mass(FORMULA)
INPUT = {"formula": FORMULA}


def transcript(*calls: str, final: str = f"A: {MASS}", eos: bool = True) -> Transcript:
    return Transcript([ToolCall("calc", argument) for argument in calls],
                      [ToolOutput(True, MASS) for _ in calls], final, eos)


# --- MolarMassTask -----------------------------------------------------------------------------

def test_true_molar_mass_matches_the_documented_example():
    assert MASS == "129.200"


def test_molar_mass_reward_is_one_for_the_exact_formula_tool_call_exact_answer_and_eos():
    assert TASK.reward(INPUT, transcript(FORMULA)) == 1.0


@pytest.mark.parametrize("episode", [
    pytest.param(transcript(), id="no tool call"),
    pytest.param(transcript("K2NaN"), id="tool called on another formula"),
    pytest.param(transcript(FORMULA, final="A: 129.2"), id="answer not in the exact format"),
    pytest.param(transcript(FORMULA, final=f"A: {MASS} "), id="trailing text"),
    pytest.param(transcript(FORMULA, eos=False), id="no eos"),
    pytest.param(Transcript([ToolCall("other", FORMULA)], [ToolOutput(True, MASS)], f"A: {MASS}", True),
                 id="another tool"),
])
def test_molar_mass_reward_is_zero_without_all_of_tool_call_exact_answer_and_eos(episode):
    assert TASK.reward(INPUT, episode) == 0.0


def test_molar_mass_reward_accepts_a_correct_call_after_a_wrong_one():
    assert TASK.reward(INPUT, transcript("K2", FORMULA)) == 1.0


def test_molar_mass_prompt_names_the_formula():
    assert TASK.build_prompt(INPUT) == f"Q: molar mass of {FORMULA}?\n"


@pytest.mark.parametrize("task_input", [{}, {"formula": ""}, {"formula": 7}, {"formula": "H" * 33}])
def test_molar_mass_rejects_task_input_without_a_short_formula(task_input):
    with pytest.raises(TaskInputError) as raised:
        TASK.build_prompt(task_input)
    assert raised.value.task == "molar_mass"


def test_molar_mass_tool_argv_runs_the_calculator_script_on_the_call_argument():
    argv = TASK.tool_argv(ToolCall("calc", "H2O"), {"formula": "H2O"})
    assert argv[-2:] == [str(tool_script_path("molar_mass")), "H2O"]
    assert "-I" in argv  # isolated mode: the tool imports nothing from the environment


def test_held_out_split_is_stable_and_disjoint_from_training_inputs():
    train = sample_formulas(random.Random(1), 200, held_out=False)
    held_out = sample_formulas(random.Random(2), 50, held_out=True)
    assert not set(train) & set(held_out)
    assert all(is_held_out(formula) for formula in held_out)
    assert not any(is_held_out(formula) for formula in train)
    assert sample_formulas(random.Random(1), 200, held_out=False) == train


def test_held_out_split_is_pinned_across_processes_and_releases():
    # A stable hash of the formula (not Python's salted hash()): changing it would leak an earlier
    # run's held-out formulas into training.
    assert [is_held_out(f) for f in ("NaCl", "CaCl2", "MgO", "H2O", "CO2", "CH4")] == [True] * 3 + [False] * 3


def test_held_out_split_keeps_about_one_formula_in_modulus():
    formulas = {f"{a}{b}" for a in ("H", "C", "N", "O", "S", "K") for b in ("", "2", "3", "4", "Cl", "Na")}
    share = sum(is_held_out(formula) for formula in formulas) / len(formulas)
    assert 0 < share < 3 / HELD_OUT_MODULUS


def test_sampled_task_inputs_follow_the_split():
    inputs = TASK.sample_task_inputs(random.Random(0), 20, held_out=True)
    assert len(inputs) == 20 and all(is_held_out(task_input["formula"]) for task_input in inputs)


def test_demonstration_with_the_tool_is_a_rewarded_episode():
    segments = TASK.demonstration(INPUT, uses_tool=True, rng=random.Random(0))
    assert segments == [(TASK.build_prompt(INPUT), False), (f"<calc>{FORMULA}</calc>", True),
                        (f"<result>{MASS}</result>\n", False), (f"A: {MASS}", True)]


def test_demonstration_without_the_tool_contains_no_calc_and_only_the_answer_is_trained():
    rng = random.Random(0)
    for formula in sample_formulas(random.Random(3), 30, held_out=False):
        segments = TASK.demonstration({"formula": formula}, uses_tool=False, rng=rng)
        assert not any("<calc>" in text for text, _ in segments)
        assert [trained for _, trained in segments] == [False, True]
        assert segments[1][0].startswith("A: ")


def test_molar_mass_task_satisfies_both_task_protocols():
    assert isinstance(TASK, Task) and isinstance(TASK, DemonstrableTask)


# --- TaskRegistry ------------------------------------------------------------------------------

def test_registry_loads_tasks_by_import_path_and_names_them():
    registry = TaskRegistry.from_import_paths(["rollmesh.rollout.molar_mass:MolarMassTask"])
    assert registry.names() == ["molar_mass"]
    assert isinstance(registry.get("molar_mass"), MolarMassTask)


def test_registry_unknown_task_error_lists_the_registered_ones():
    with pytest.raises(UnknownTaskError, match="molar_mass") as raised:
        TaskRegistry([TASK]).get("chess")
    assert raised.value.task == "chess"


def test_registry_refuses_an_object_that_is_not_a_task():
    with pytest.raises(TypeError):
        TaskRegistry().register(object())  # type: ignore[arg-type]


@pytest.mark.parametrize("path", ["rollmesh.rollout.molar_mass", ":MolarMassTask", ""])
def test_load_task_requires_module_colon_class(path):
    with pytest.raises(ValueError, match="package.module:Class"):
        load_task(path)


# --- tool syntax -------------------------------------------------------------------------------

def test_tool_call_is_parsed_from_text_ending_with_the_closing_tag():
    assert parse_tool_call("let me compute <calc>H2O</calc>", frozenset({"calc"})) == ToolCall("calc", "H2O")


@pytest.mark.parametrize("text", [
    "<calc>H2O</calc> and more",  # the call must end the text (generation stops at the tag)
    "<calc>H2O</calx>",
    "<sh>ls</sh>",  # not one of the task's tools
    "A: 18.015",
    "<calc>" + "H" * (MAX_ARGUMENT_CHARS + 1) + "</calc>",
])
def test_text_without_a_final_call_to_a_known_tool_is_not_a_tool_call(text):
    assert parse_tool_call(text, frozenset({"calc"})) is None


def test_stop_strings_are_the_closing_tags_and_output_is_wrapped_in_result():
    assert stop_strings(frozenset({"calc", "bash"})) == ["</bash>", "</calc>"]
    assert format_tool_output("18.015") == "<result>18.015</result>\n"


# --- trajectory --------------------------------------------------------------------------------

def test_trajectory_marks_forced_tokens_and_keeps_generated_logprobs_and_versions():
    trajectory = Trajectory()
    trajectory.append_forced([1, 2])
    trajectory.append_generated([3, 4], [-0.5, -1.5], [7, 8])
    assert trajectory.trace() == TokenTrace(ids=[1, 2, 3, 4], loss_mask=[0, 0, 1, 1],
                                            logprobs=[0.0, 0.0, -0.5, -1.5], versions=[NO_VERSION, NO_VERSION, 7, 8])
    assert trajectory.generated_versions() == [7, 8]
    assert len(trajectory) == 4
    assert Trajectory.from_trace(trajectory.trace()) == trajectory


def test_trajectory_refuses_generated_tokens_of_unequal_lengths_or_without_a_version():
    with pytest.raises(ValueError, match="differ in length"):
        Trajectory().append_generated([1, 2], [-0.1], [0, 0])
    with pytest.raises(ValueError, match="no weight version"):
        Trajectory().append_generated([1, 2], [-0.1, -0.2], [0, NO_VERSION])


def test_rollout_error_carries_its_failure_kind_and_turns():
    error = RolloutError("sandbox_timeout", "lease expired", turns=3)
    assert (error.kind, error.turns, str(error)) == ("sandbox_timeout", 3, "lease expired")
