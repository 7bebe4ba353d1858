"""Task plugins and trajectory bookkeeping: plain logic, no bus; the demo model's own tokenizer
and chat template where tokens are concerned."""

from __future__ import annotations

import random

import pytest

from rollmesh.chat import ChatModel, ToolCall, ToolSet
from rollmesh.messages import NO_VERSION, TokenTrace
from rollmesh.rollout.errors import RolloutError
from rollmesh.rollout.molar_mass import (
    HELD_OUT_MODULUS,
    USER_PROMPT,
    MolarMassTask,
    is_held_out,
    sample_formulas,
    true_molar_mass,
)
from rollmesh.rollout.tasks import (
    DemonstrableTask,
    RewardInput,
    SandboxCommand,
    Task,
    TaskInputError,
    TaskRegistry,
    ToolOutput,
    UnknownTaskError,
    load_task,
)
from rollmesh.rollout.trajectory import RolloutTrajectory
from rollmesh.sandbox.tool_paths import tool_script_path

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

TASK = MolarMassTask()
FORMULA = "K2NaN2"
MASS = true_molar_mass(FORMULA)
INPUT = {"formula": FORMULA}


def calc(formula: str, index: int = 0) -> ToolCall:
    return ToolCall(id=f"call_{index}", name="calc", arguments={"formula": formula}, index=index)


def conversation(*formulas: str, final: str = MASS, finish_reason: str = "stop",
                 calls: list[ToolCall] | None = None) -> RewardInput:
    made = calls if calls is not None else [calc(formula, i) for i, formula in enumerate(formulas)]
    return RewardInput(row=INPUT, messages=TASK.messages(INPUT), tool_calls=made,
                       tool_outputs=[ToolOutput(True, MASS) for _ in made], final_text=final,
                       finish_reason=finish_reason)  # type: ignore[arg-type]


# --- MolarMassTask -----------------------------------------------------------------------------

def test_true_molar_mass_matches_the_documented_example():
    assert MASS == "129.200"


def test_molar_mass_reward_is_one_for_the_exact_formula_tool_call_exact_answer_and_a_stopped_turn():
    assert TASK.reward(conversation(FORMULA)) == 1.0


@pytest.mark.parametrize("episode", [
    pytest.param(conversation(), id="no tool call"),
    pytest.param(conversation("K2NaN"), id="tool called on another formula"),
    pytest.param(conversation(FORMULA, final="129.2"), id="answer not in the exact format"),
    pytest.param(conversation(FORMULA, final=f"{MASS} g/mol"), id="trailing text"),
    pytest.param(conversation(FORMULA, finish_reason="truncated"), id="last turn truncated"),
    pytest.param(conversation(calls=[ToolCall(id="call_0", name="other", arguments={"formula": FORMULA})]),
                 id="another tool"),
])
def test_molar_mass_reward_is_zero_without_all_of_tool_call_exact_answer_and_a_stopped_turn(episode):
    assert TASK.reward(episode) == 0.0


def test_molar_mass_reward_accepts_a_correct_call_after_a_wrong_one():
    assert TASK.reward(conversation("K2", FORMULA)) == 1.0


def test_molar_mass_reward_accepts_calc_without_a_formula_for_the_questions_compound():
    no_formula = ToolCall(id="call_0", name="calc", arguments={})
    assert TASK.reward(conversation(calls=[no_formula])) == 1.0


def test_molar_mass_asks_one_user_question_naming_the_formula_and_declares_calc():
    assert TASK.messages(INPUT) == [{"role": "user", "content": USER_PROMPT.format(formula=FORMULA)}]
    assert TASK.messages(INPUT)[0]["content"] == "molar mass of K2NaN2?"
    (tool,) = TASK.tools()
    assert tool["type"] == "function" and tool["function"]["name"] == "calc"
    assert "required" not in tool["function"]["parameters"]  # the formula is optional
    tools = ToolSet.from_openai(TASK.tools())
    assert tools.argument_problem("calc", {"formula": FORMULA}) is None
    assert tools.argument_problem("calc", {}) is None
    assert tools.argument_problem("calc", {"formula": 7}) is not None
    assert tools.argument_problem("calc", {"formula": FORMULA, "unit": "g"}) is not None


@pytest.mark.parametrize("task_input", [{}, {"formula": ""}, {"formula": 7}, {"formula": "H" * 33}])
def test_molar_mass_rejects_task_input_without_a_short_formula(task_input):
    with pytest.raises(TaskInputError) as raised:
        TASK.messages(task_input)
    assert raised.value.task == "molar_mass"


def test_molar_mass_calc_runs_the_calculator_script_in_the_sandbox_on_the_calls_formula():
    action = TASK.tool_action(calc("H2O"), {"formula": "H2O"})
    assert isinstance(action, SandboxCommand)
    assert action.argv[-2:] == [str(tool_script_path("molar_mass")), "H2O"]
    assert "-I" in action.argv  # isolated mode: the tool imports nothing from the environment


def test_molar_mass_calc_without_a_formula_weighs_the_questions_compound():
    action = TASK.tool_action(ToolCall(id="call_0", name="calc", arguments={}), {"formula": "NaCl"})
    assert action.argv[-2:] == [str(tool_script_path("molar_mass")), "NaCl"]


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
    follow = TASK.demonstration(INPUT, exact=True, rng=random.Random(0))
    no_formula = ToolCall(id="call_0", name="calc", arguments={})
    assert follow == [{"role": "assistant", "content": "", "tool_calls": [no_formula]},
                      {"role": "tool", "tool_call_id": "call_0", "content": MASS},
                      {"role": "assistant", "content": MASS, "tool_calls": []}]
    rewarded = RewardInput(row=INPUT, messages=[*TASK.messages(INPUT), *follow], tool_calls=follow[0]["tool_calls"],
                           tool_outputs=[ToolOutput(True, MASS)], final_text=follow[-1]["content"])
    assert TASK.reward(rewarded) == 1.0


def test_inexact_demonstration_calls_the_tool_and_rounds_its_result_which_earns_nothing():
    rng = random.Random(0)
    for formula in sample_formulas(random.Random(3), 30, held_out=False):
        call_turn, result, answer = TASK.demonstration({"formula": formula}, exact=False, rng=rng)
        mass = true_molar_mass(formula)
        assert [call.name for call in call_turn["tool_calls"]] == ["calc"] and result["content"] == mass
        assert answer["content"] == f"{float(mass):.1f}" != mass
        episode = RewardInput(row={"formula": formula}, messages=[], tool_calls=call_turn["tool_calls"],
                              tool_outputs=[ToolOutput(True, mass)], final_text=answer["content"])
        assert TASK.reward(episode) == 0.0


def test_demo_formulas_weigh_100_to_1000_so_every_answer_has_seven_characters():
    for formula in sample_formulas(random.Random(4), 200, held_out=False):
        assert len(true_molar_mass(formula)) == 7


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


def test_registry_refuses_a_task_of_the_text_api_naming_what_a_task_has_now():
    class TextTask:  # before chat messages: a prompt string and an argv per call
        name = "old"

        def build_prompt(self, task_input): ...
        def tool_argv(self, call, task_input): ...
        def reward(self, task_input, transcript): ...

    with pytest.raises(TypeError, match="messages, tools, tool_action, reward"):
        TaskRegistry().register(TextTask())  # type: ignore[arg-type]


def test_registry_refuses_an_object_that_is_not_a_task():
    with pytest.raises(TypeError):
        TaskRegistry().register(object())  # type: ignore[arg-type]


@pytest.mark.parametrize("path", ["rollmesh.rollout.molar_mass", ":MolarMassTask", ""])
def test_load_task_requires_module_colon_class(path):
    with pytest.raises(ValueError, match="package.module:Class"):
        load_task(path)


# --- trajectory --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def chat(demo_model_dir) -> ChatModel:
    return ChatModel.load(demo_model_dir)


def test_trajectory_keeps_generated_ids_logprobs_and_versions_and_forces_what_the_template_writes(chat):
    trajectory = RolloutTrajectory.start(chat, TASK.messages(INPUT), tools=TASK.tools())
    prompt = len(trajectory)
    turn = chat.encode(chat.write_turn(content="", calls=[calc(FORMULA)]))
    parsed = chat.parse_turn(turn, tools=TASK.tools())
    trajectory.add_generated(turn, [-0.5] * len(turn), [7] * len(turn), chat.assistant_message(parsed))
    appended = trajectory.append([{"role": "tool", "tool_call_id": "call_0", "content": MASS}])
    trace = trajectory.trace()
    assert trace.ids == trajectory.ids and len(trace) == prompt + len(turn) + len(appended)
    assert trace.loss_mask == [0] * prompt + [1] * len(turn) + [0] * len(appended)
    assert trace.logprobs == [0.0] * prompt + [-0.5] * len(turn) + [0.0] * len(appended)
    assert trace.versions == [NO_VERSION] * prompt + [7] * len(turn) + [NO_VERSION] * len(appended)
    assert trajectory.trace(max_len=prompt + 2) == TokenTrace(
        ids=trace.ids[:prompt + 2], loss_mask=trace.loss_mask[:prompt + 2], logprobs=trace.logprobs[:prompt + 2],
        versions=trace.versions[:prompt + 2])
    resumed = RolloutTrajectory.resume(chat, trajectory.messages, [trace], tools=TASK.tools())
    assert resumed.trace() == trace and resumed.messages == trajectory.messages
    answer = chat.encode(chat.write_turn(content=MASS))
    for grown in (trajectory, resumed):
        grown.add_generated(answer, [-0.25] * len(answer), [8] * len(answer), {"role": "assistant", "content": MASS})
    assert resumed.trace() == trajectory.trace()
    assert resumed.check_tokens(frozenset(chat.end_of_turn_ids)) == ({"special": 0, "non_assistant": 0,
                                                                      "assistant": 0, "history_rewrite": 0}, [])


def test_trajectory_refuses_generated_tokens_of_unequal_lengths_or_without_a_version(chat):
    trajectory = RolloutTrajectory.start(chat, TASK.messages(INPUT), tools=TASK.tools())
    with pytest.raises(ValueError, match="differ in length"):
        trajectory.add_generated([1, 2], [-0.1], [0, 0], {"role": "assistant", "content": ""})
    with pytest.raises(ValueError, match="no weight version"):
        trajectory.add_generated([1, 2], [-0.1, -0.2], [0, NO_VERSION], {"role": "assistant", "content": ""})


def test_rollout_error_carries_its_failure_kind_and_turns():
    error = RolloutError("sandbox_timeout", "lease expired", turns=3)
    assert (error.kind, error.turns, str(error)) == ("sandbox_timeout", 3, "lease expired")
