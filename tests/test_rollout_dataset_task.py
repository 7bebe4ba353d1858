"""The built-in dataset task (``DatasetTask``): a row's messages in, the request's rewards out,
import-path rewards only from the mesh's allow-list. Plain logic; the ``math`` test runs a real
math-verify worker process."""

from __future__ import annotations

import pytest

from rollmesh.chat import ToolCall
from rollmesh.config import RolloutConfig
from rollmesh.rewards.errors import RewardInputError
from rollmesh.rewards.reward_input import RewardInput, RewardScore
from rollmesh.rollout.dataset_task import DatasetTask
from rollmesh.rollout.tasks import Task, TaskInputError, TaskRegistry

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]

ALLOWED = "test_rollout_dataset_task:shouting"
MESSAGES = [{"role": "system", "content": "Answer with a number."}, {"role": "user", "content": "What is 1/4 + 1/4?"}]


def shouting(sample: RewardInput, *, weight_of_caps: float = 1.0) -> float:
    return weight_of_caps if sample.final_text.isupper() else 0.0


def task_input(rewards: list[dict], *, answer: str | None = "1/2", **changes) -> dict:
    return {"messages": MESSAGES, "row": {"q": "What is 1/4 + 1/4?", "a": answer}, "answer": answer,
            "rewards": rewards, **changes}


def finished(task_input: dict, final_text: str) -> RewardInput:
    """What the agent loop hands a task's reward: the task_input as the row."""
    return RewardInput(row=task_input, messages=MESSAGES, final_text=final_text)


def test_the_dataset_task_opens_with_the_rows_messages_and_declares_no_tools():
    task = DatasetTask()
    assert isinstance(task, Task) and task.name == "dataset"
    assert task.messages(task_input([{"name": "exact_match"}])) == MESSAGES
    assert task.tools() == []
    with pytest.raises(TaskInputError, match="no tools"):
        task.tool_action(ToolCall(id="call_0", name="python", arguments={}), task_input([]))


@pytest.mark.parametrize("messages", [None, [], "hello", [{"content": "no role"}], ["text"]])
def test_task_input_without_a_list_of_chat_messages_is_a_task_input_error(messages):
    with pytest.raises(TaskInputError, match="task_input.messages"):
        DatasetTask().messages({"messages": messages})


def test_its_rewards_see_the_dataset_row_and_answer_and_are_weighted():
    task = DatasetTask([ALLOWED])
    given = task_input([{"name": "exact_match", "weight": 0.5}, {"fn": ALLOWED, "args": {"weight_of_caps": 2.0}}],
                       answer="NO")
    score = task.reward(finished(given, " NO "))
    assert score == RewardScore(0.5 * 1.0 + 2.0, {"exact_match": 1.0, "shouting": 2.0})


def test_the_math_builtin_scores_a_dataset_row_by_math_verify():
    given = task_input([{"name": "math"}])
    assert DatasetTask().reward(finished(given, "That is $\\frac{1}{2}$.")).total == 1.0
    assert DatasetTask().reward(finished(given, "0.25")).total == 0.0


def test_a_row_without_an_answer_is_the_rows_fault():
    with pytest.raises(RewardInputError, match="no answer"):
        DatasetTask().reward(finished(task_input([{"name": "exact_match"}], answer=None), "1/2"))


def test_an_import_path_reward_outside_the_allow_list_is_refused_naming_the_config_key():
    with pytest.raises(TaskInputError, match="rollout.reward_functions"):
        DatasetTask().reward(finished(task_input([{"fn": ALLOWED}]), "X"))


def test_the_registry_hands_the_configs_allow_list_to_the_dataset_task():
    registry = TaskRegistry.from_import_paths(RolloutConfig().tasks)
    assert "dataset" in registry.names(), "registered by default"
    registry.allow_reward_functions([ALLOWED])
    assert registry.get("dataset").reward(finished(task_input([{"fn": ALLOWED}]), "LOUD")).total == 1.0


@pytest.mark.parametrize(("rewards", "reason"), [
    (None, "non-empty list"),
    ([], "non-empty list"),
    ([{"weight": 1.0}], "exactly one of name"),
    ([{"name": "exact_match", "fn": ALLOWED}], "exactly one of name"),
    ([{"name": "exact_match", "weight": "heavy"}], "Expected `float`"),
    ([{"name": "bleu"}], "no built-in reward 'bleu'"),
])
def test_a_bad_rewards_entry_is_a_task_input_error(rewards, reason):
    with pytest.raises(TaskInputError, match=reason):
        DatasetTask([ALLOWED]).reward(finished(task_input(rewards), "1/2"))


@pytest.mark.parametrize("changes", [{"row": "a row"}, {"answer": 0.5}])
def test_a_row_or_answer_of_the_wrong_type_is_a_task_input_error(changes):
    with pytest.raises(TaskInputError, match="task_input.row"):
        DatasetTask().reward(finished(task_input([{"name": "exact_match"}], **changes), "1/2"))


def test_each_distinct_rewards_list_is_loaded_once():
    task = DatasetTask([ALLOWED])
    first, second = [{"name": "exact_match"}], [{"fn": ALLOWED}]
    assert task._combined(first) is task._combined([{"name": "exact_match"}])
    assert task._combined(second) is not task._combined(first)
