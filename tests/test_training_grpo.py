"""GRPO's data side and what feeds it: group advantages, batches, admission by version lag,
warm-start data in the demo model's own tokens, and the plain-torch backend on the demo model. The
losses: test_training_losses.py."""

from __future__ import annotations

import random
import re
from pathlib import Path

import pytest
import torch

from rollmesh.chat import ChatModel, ToolCall, check_trajectory
from rollmesh.config import ModelConfig, TrainerConfig
from rollmesh.rollout.molar_mass import MolarMassTask, is_held_out
from rollmesh.training.admission import Group, GroupBuffer, GroupMember, version_lag
from rollmesh.training.grpo import PolicyBatch, PolicySample, group_advantages
from rollmesh.training.losses import token_logprobs
from rollmesh.training.torch_backend import TorchTrainerBackend
from rollmesh.training.warm_start import ConversationError, conversation_sequence, demonstration_batch

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

PAD_ID = 0  # any valid embedding row pads (torch_backend.training_pad_id)


@pytest.fixture(scope="module")
def chat(demo_model_dir: Path) -> ChatModel:
    return ChatModel.load(demo_model_dir)


# --- group advantages --------------------------------------------------------------------------

@pytest.mark.parametrize("rewards", [[1.0, 0.0], [1.0, 0.0, 0.0, 0.0], [0.2, 0.9, 0.4, 0.4, 1.7]])
def test_group_advantages_are_zero_mean_unit_std(rewards):
    advantages = group_advantages(rewards)
    values = torch.tensor(advantages, dtype=torch.float64)
    assert float(values.mean()) == pytest.approx(0.0, abs=1e-9)
    assert float(values.std(unbiased=False)) == pytest.approx(1.0, abs=1e-5)
    # Order is kept: a better reward gets a larger advantage.
    order = range(len(rewards))
    assert sorted(order, key=rewards.__getitem__) == sorted(order, key=advantages.__getitem__)


def test_group_advantages_of_two_rewards_are_plus_and_minus_one():
    assert group_advantages([1.0, 0.0]) == pytest.approx([1.0, -1.0], abs=1e-5)


@pytest.mark.parametrize("rewards", [[1.0, 1.0, 1.0], [0.0, 0.0], [0.5], []])
def test_group_advantages_are_none_when_nothing_can_be_learned(rewards):
    assert group_advantages(rewards) is None


# --- batches -----------------------------------------------------------------------------------

def test_collate_right_pads_and_shifts_targets_mask_and_behaviour_logprobs_by_one():
    short = PolicySample([1, 2, 3], [0, 1, 1], [0.0, -0.1, -0.2], 1.0)
    long = PolicySample([4, 5, 6, 7, 8], [0, 0, 1, 1, 1], [0.0, 0.0, -0.3, -0.4, -0.5], -1.0)
    batch = PolicyBatch.collate([short, long], pad_id=PAD_ID)

    assert batch.inputs.tolist() == [[1, 2, 3, PAD_ID], [4, 5, 6, 7]]
    assert batch.targets.tolist() == [[2, 3, PAD_ID, PAD_ID], [5, 6, 7, 8]]
    assert batch.mask.tolist() == [[1, 1, 0, 0], [0, 1, 1, 1]]
    torch.testing.assert_close(batch.behaviour_logprobs,
                               torch.tensor([[-0.1, -0.2, 0.0, 0.0], [0.0, -0.3, -0.4, -0.5]]))
    assert batch.advantages.tolist() == [1.0, -1.0]


# --- admission ---------------------------------------------------------------------------------

def test_version_lag_counts_from_the_oldest_generated_token_and_ignores_forced_ones():
    assert version_lag([-1, -1, 3, 4, 5], current_version=6) == 3
    assert version_lag([-1, -1], current_version=6) == 0


def sample(reward_tag: int) -> PolicySample:
    return PolicySample([reward_tag, 1, 2], [0, 1, 1], [0.0, -0.1, -0.2], 0.0)


def test_failed_member_is_masked_out_of_the_group_statistics():
    group = Group("g", [GroupMember("a", 1.0, sample(1)), GroupMember("b", 0.0, sample(2)),
                        GroupMember("failed", 0.0, None)])
    trained = group.trainable_samples()
    assert [s.tokens[0] for s in trained] == [1, 2]
    assert [s.advantage for s in trained] == pytest.approx([1.0, -1.0], abs=1e-5)
    assert group.rewards() == [1.0, 0.0]


def test_group_with_all_equal_rewards_contributes_no_samples():
    group = Group("g", [GroupMember(str(i), 1.0, sample(i)) for i in range(4)])
    assert group.trainable_samples() == []
    assert group.rewards() == [1.0] * 4


def test_group_buffer_releases_a_group_once_group_size_members_arrived_failed_ones_included():
    buffer = GroupBuffer(group_size=2)
    assert buffer.add("g1", GroupMember("a", 1.0, sample(1))) is None
    assert buffer.add("g2", GroupMember("c", 1.0, sample(3))) is None
    ready = buffer.add("g1", GroupMember("b", 0.0, None))
    assert ready is not None and [m.rollout_id for m in ready.members] == ["a", "b"]
    assert buffer.open_groups() == 1
    assert buffer.take(5) == [ready] and buffer.take(5) == []


# --- warm-start data ---------------------------------------------------------------------------

def test_demonstration_batch_is_training_split_episodes_each_ending_in_a_trained_end_of_turn(chat):
    batch = demonstration_batch(MolarMassTask(), chat, random.Random(0), size=12, exact_fraction=0.5)

    assert len(batch) == 12
    exact = 0
    for tokens, mask in batch:
        assert len(tokens) == len(mask)
        assert (chat.decode(tokens[:1]), mask[0]) == ("<|im_start|>", 0)
        assert tokens[-1] in chat.end_of_turn_ids and mask[-1] == 1
        text = chat.decode(tokens)
        formula = re.search(r"molar mass of (\S+)\?", text).group(1)
        assert not is_held_out(formula)
        trained = chat.decode([t for t, m in zip(tokens, mask) if m])
        # The prompt, the tool's result and the template's joins are forced, never trained.
        assert "molar mass" not in trained and "<tool_response>" not in trained and "<|im_start|>" not in trained
        assert "<tool_call>" in text
        exact += re.search(r"assistant\n\d{3}\.\d{3}<\|im_end\|>", text) is not None
    assert 0 < exact < 12


@pytest.mark.parametrize(("exact_fraction", "expected"), [(0.0, 0), (1.0, 8)])
def test_demonstration_batch_exact_fraction_sets_the_share_answering_exactly(chat, exact_fraction, expected):
    batch = demonstration_batch(MolarMassTask(), chat, random.Random(0), size=8, exact_fraction=exact_fraction)
    assert sum(re.search(r"assistant\n\d{3}\.\d{3}<\|im_end\|>", chat.decode(tokens)) is not None
               for tokens, _ in batch) == expected


def test_a_conversation_becomes_the_templates_render_with_loss_on_the_assistants_turns(chat):
    task = MolarMassTask()
    call = ToolCall(id="demo-call", name="calc", arguments={"formula": "H2O"})
    messages = [*task.messages({"formula": "H2O"}), {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "demo-call", "content": "18.015"},
                {"role": "assistant", "content": "18.015"}]
    tokens, mask = conversation_sequence(chat, messages, tools=task.tools())

    rendered = [*messages[:1], {"role": "assistant", "content": "", "tool_calls": [call.to_openai()]}, *messages[2:]]
    # The whole render ends with the template's join after the last turn, which is not trained.
    assert chat.decode(tokens) + "\n" == chat.render(rendered, tools=task.tools(), add_generation_prompt=False)
    turns = chat.write_turn(content="", calls=[call]) + chat.write_turn(content="18.015")
    assert chat.decode([t for t, m in zip(tokens, mask) if m]) == turns
    # Each turn is its own written text encoded once, as a sampled turn is.
    assert [t for t, m in zip(tokens, mask) if m] == (chat.encode(chat.write_turn(content="", calls=[call]))
                                                       + chat.encode(chat.write_turn(content="18.015")))


@pytest.mark.parametrize(("messages", "reason"), [
    ([{"role": "user", "content": "molar mass of H2O?"}], "no assistant turn"),
    ([{"role": "user", "content": "molar mass of H2O?"},
      {"role": "assistant", "content": "", "tool_calls": [ToolCall(id="c", name="calc", arguments={"formula": "H2O"})]},
      {"role": "tool", "tool_call_id": "c", "content": "18.015"}], "must end with an assistant turn"),
    ([{"role": "user", "content": "molar mass of H2O?"},
      {"role": "assistant", "content": "", "tool_calls": [ToolCall(id="c", name="weigh", arguments={"x": "H2O"})]}],
     "parses back"),
])
def test_a_conversation_that_cannot_be_trained_as_written_is_a_conversation_error(chat, messages, reason):
    with pytest.raises(ConversationError, match=reason):
        conversation_sequence(chat, messages, tools=MolarMassTask().tools())


# --- the plain-torch backend -------------------------------------------------------------------

@pytest.fixture
def backend(demo_model_dir: Path) -> TorchTrainerBackend:
    torch.set_num_threads(1)
    return TorchTrainerBackend(ModelConfig(path=str(demo_model_dir)), TrainerConfig(lr=1e-2, ppo_epochs=1, seed=0))


def trained_logprob(backend: TorchTrainerBackend, tokens: list[int], mask: list[int]) -> float:
    batch = PolicyBatch.collate([PolicySample(tokens, mask, [0.0] * len(tokens), 0.0)], pad_id=PAD_ID)
    with torch.no_grad():
        logprobs = token_logprobs(backend.model(batch.inputs), batch.targets)
    return float((logprobs * batch.mask).sum())


def on_policy(backend: TorchTrainerBackend, tokens: list[int], mask: list[int], advantage: float) -> PolicySample:
    """A sample whose behaviour logprobs are the backend's own, as if it had generated the tokens."""
    batch = PolicyBatch.collate([PolicySample(tokens, mask, [0.0] * len(tokens), 0.0)], pad_id=PAD_ID)
    with torch.no_grad():
        logprobs = token_logprobs(backend.model(batch.inputs), batch.targets)[0].tolist()
    return PolicySample(tokens, mask, [0.0, *logprobs], advantage)


def test_policy_step_raises_the_likelihood_of_positive_advantage_tokens_and_lowers_negative_ones(backend):
    good, bad = [1, 10, 20, 30, 40], [1, 11, 21, 31, 41]
    mask = [0, 1, 1, 1, 1]
    before = trained_logprob(backend, good, mask), trained_logprob(backend, bad, mask)
    for _ in range(3):
        stats = backend.policy_step([on_policy(backend, good, mask, 1.0), on_policy(backend, bad, mask, -1.0)])
    after = trained_logprob(backend, good, mask), trained_logprob(backend, bad, mask)

    assert after[0] > before[0] and after[1] < before[1]
    assert set(stats) >= {"loss", "grad_norm", "clip_fraction", "mean_ratio"}


def test_on_policy_samples_have_importance_ratio_one(backend):
    stats = backend.policy_step([on_policy(backend, [1, 2, 3, 4], [0, 1, 1, 1], 1.0),
                                 on_policy(backend, [1, 5, 6], [0, 1, 1], -1.0)])
    assert stats["mean_ratio"] == pytest.approx(1.0, abs=1e-5)
    assert stats["clip_fraction"] == 0.0


def test_sft_steps_lower_the_loss_on_the_trained_positions(backend, chat):
    end = min(chat.end_of_turn_ids)
    sequences = [([1, 5, 6, 7, 8, end], [0, 0, 1, 1, 1, 1]), ([1, 9, 8, 7, end], [0, 1, 1, 1, 1])]
    losses = [backend.sft_step(sequences, lr=1e-2) for _ in range(5)]
    assert losses[-1] < losses[0]


def test_backend_state_dict_is_a_copy_of_the_model_weights(backend):
    state = backend.state_dict()
    name, tensor = next(iter(state.items()))
    tensor.add_(1.0)
    assert not torch.equal(backend.model.state_dict()[name], tensor)
    assert set(state) == set(backend.model.state_dict())


# --- warm-start data on every family's template ------------------------------------------------

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.mark.parametrize("family", ["qwen2_5", "qwen3", "llama3", "mistral", "deepseek_v3", "kimi_k2", "gpt_oss"])
def test_a_tool_conversation_trains_only_generated_text_whatever_the_family(chat_model_dirs, family):
    """The supervised sequence of a call, its result and an answer, in each family's own format:
    every difference from a whole render of the conversation is in the assistant's own tokens
    (re-tokenization) or a history rewrite the family documents, never in text the model did not
    generate (check-template's rule for a bug)."""
    from support.chat_models import FAMILIES

    from rollmesh.chat.token_check import special_token_ids
    from rollmesh.training.warm_start import conversation_trajectory

    chat = ChatModel.load(chat_model_dirs[family], template_kwargs=FAMILIES[family].template_kwargs)
    messages = [{"role": "user", "content": "What is the weather in Paris?"},
                {"role": "assistant", "content": "",
                 "tool_calls": [ToolCall(id="weather-1", name="get_weather", arguments={"city": "Paris"})]},
                {"role": "tool", "tool_call_id": "weather-1", "content": "sunny, 21 C"},
                {"role": "assistant", "content": "It is sunny in Paris."}]
    trajectory = conversation_trajectory(chat, messages, tools=[WEATHER_TOOL])

    (report,) = check_trajectory(trajectory, special_token_ids(chat.directory.tokenizer))
    ids, mask = trajectory.sample.ids, trajectory.sample.loss_mask

    def generated(start: int, end: int) -> bool:  # an insertion: generated on both sides
        return all(mask[start:end]) if start < end else 0 < start < len(mask) and mask[start - 1] and mask[start]

    bugs = [d for d in report.differences if not d.rewrite and not generated(d.trace_start, d.trace_end)]
    assert bugs == [], report
    tool_message = trajectory.messages[2]
    assert tool_message["tool_call_id"] == trajectory.messages[1]["tool_calls"][0]["id"]  # answers the parsed call
    assert "sunny, 21 C" not in chat.decode([t for t, m in zip(ids, mask) if m])
    assert mask[-1] == 1 and ids[-1] in chat.end_of_turn_ids
