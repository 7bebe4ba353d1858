"""Token-exact appending of later turns (rollmesh.chat.turn_append) on real chat templates.

Each generated turn is simulated as the model emits it: text in the family's own format, encoded
once as if it had been sampled. The checks compare with the template's whole render.
"""

from __future__ import annotations

import pytest

from support.chat_models import FAMILIES
from rollmesh.chat import ModelDirectory
from rollmesh.chat.errors import AppendError, AppendOrderError, JoinDerivationError, TruncatedTurnError
from rollmesh.chat.token_check import check_trajectory, special_token_ids
from rollmesh.chat.turn_append import STAND_IN_MARKER, ChatTrajectory, TemplateJoin

pytestmark = pytest.mark.unit

SYSTEM_USER = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris and Tokyo?"}]
WEATHER_PARAMETERS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function",
          "function": {"name": "get_weather", "description": "Get the weather", "parameters": WEATHER_PARAMETERS}}]
# The model's own end of a turn, per family, to simulate what it samples.
END_OF_TURN = {"qwen2_5": "<|im_end|>", "qwen3": "<|im_end|>", "llama3": "<|eot_id|>", "mistral": "</s>",
               "deepseek_v3": "<\uff5cend\u2581of\u2581sentence\uff5c>", "kimi_k2": "<|im_end|>",
               "gpt_oss": "<|return|>"}


class RecordingChat:
    """Counts the messages of every render, to show appending renders no history."""

    def __init__(self, chat: ModelDirectory) -> None:
        self.chat = chat
        self.end_of_turn_ids = chat.end_of_turn_ids
        self.rendered_lengths: list[int] = []

    def render(self, messages, **kwargs) -> str:
        self.rendered_lengths.append(len(messages))
        return self.chat.render(messages, **kwargs)

    def encode(self, text):
        return self.chat.encode(text)

    def decode(self, ids):
        return self.chat.decode(ids)


@pytest.fixture(scope="module")
def chats(chat_model_dirs) -> dict[str, ModelDirectory]:
    return {family: ModelDirectory.load(directory) for family, directory in chat_model_dirs.items()}


def sample(trajectory: ChatTrajectory, text: str, message: dict) -> list[int]:
    """Add a generated turn: ``text`` encoded once, as if sampled, with made-up logprobs."""
    ids = trajectory.chat.encode(text)
    trajectory.add_generated(ids, [-0.5] * len(ids), message)
    return ids


def tool_call(call_id: str, city: str, *, as_string: bool = False) -> dict:
    arguments = f'{{"city": "{city}"}}' if as_string else {"city": city}
    return {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": arguments}}


def test_qwen_end_of_turn_newline_is_appended_unmasked(chats):
    chat = chats["qwen2_5"]
    trajectory = ChatTrajectory(chat, SYSTEM_USER, family="qwen2_5")
    prompt = trajectory.prompt_ids()
    assert prompt == chat.encode(chat.render(SYSTEM_USER, add_generation_prompt=True))
    generated = sample(trajectory, "Sunny in both.<|im_end|>", {"role": "assistant", "content": "Sunny in both."})
    appended = trajectory.append([{"role": "user", "content": "Thanks!"}])

    assert trajectory.join.join_text == "\n"
    assert appended[: len(chat.encode("\n"))] == chat.encode("\n")
    assert chat.decode(appended) == "\n<|im_start|>user\nThanks!<|im_end|>\n<|im_start|>assistant\n"
    tokens = trajectory.sample
    assert tokens.ids == prompt + generated + appended
    assert tokens.loss_mask == [0] * len(prompt) + [1] * len(generated) + [0] * len(appended)
    assert tokens.logprobs[len(prompt):len(prompt) + len(generated)] == [-0.5] * len(generated)
    assert tokens.logprobs[-len(appended):] == [None] * len(appended)
    [report] = check_trajectory(trajectory, special_token_ids(chat.tokenizer))
    assert report.exact, report.differences


@pytest.mark.parametrize("thinking", [True, False])
def test_generation_prompt_on_later_turns(chats, thinking):
    chat = chats["qwen3"]
    kwargs = {"enable_thinking": thinking}
    trajectory = ChatTrajectory(chat, SYSTEM_USER, tools=TOOLS, template_kwargs=kwargs, family="qwen3")
    generation_prompt = "<|im_start|>assistant\n" + ("" if thinking else "<think>\n\n</think>\n\n")
    assert chat.decode(trajectory.prompt_ids()).endswith(generation_prompt)
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    thought = "<think>\nI need the weather.\n</think>\n\n" if thinking else ""
    sample(trajectory, f"{thought}{call}<|im_end|>",
           {"role": "assistant", "content": "", "reasoning_content": "I need the weather." if thinking else "",
            "tool_calls": [tool_call("c1", "Paris")]})
    appended = trajectory.append([{"role": "tool", "tool_call_id": "c1", "content": "sunny, 24 C"}])

    assert chat.decode(appended).endswith("</tool_response><|im_end|>\n" + generation_prompt)
    # The next prompt is what a whole render of the conversation would be (thinking: Qwen3 keeps
    # reasoning after the last user query, so the render is still an extension here).
    whole = chat.render(trajectory.messages, tools=TOOLS, add_generation_prompt=True, template_kwargs=kwargs)
    if thinking:
        assert trajectory.prompt_ids() == chat.encode(whole)
    else:
        # Without thinking the generation prompt's empty <think> block is dropped from the earlier
        # turn by the template: the documented rewrite, in tokens the model did not generate.
        [report] = check_trajectory(trajectory, special_token_ids(chat.tokenizer))
        assert [(d.kind, d.rewrite) for d in report.differences] == [("non_assistant", "drops earlier reasoning")]
        assert report.bugs == 0


@pytest.mark.parametrize("family", ["qwen2_5", "qwen3"])
def test_parallel_tool_results_are_appended_as_one_user_turn(chats, family):
    chat = chats[family]
    trajectory = ChatTrajectory(chat, SYSTEM_USER, tools=TOOLS, family=family)
    calls = [tool_call("c1", "Paris"), tool_call("c2", "Tokyo")]
    text = "\n".join(f'<tool_call>\n{{"name": "get_weather", "arguments": {{"city": "{c}"}}}}\n</tool_call>'
                     for c in ("Paris", "Tokyo"))
    thought = "<think>\nTwo cities.\n</think>\n\n" if family == "qwen3" else ""
    message = {"role": "assistant", "content": "", "tool_calls": calls}
    if family == "qwen3":
        message["reasoning_content"] = "Two cities."
    sample(trajectory, f"{thought}{text}<|im_end|>", message)
    results = [{"role": "tool", "tool_call_id": "c1", "content": "sunny"},
               {"role": "tool", "tool_call_id": "c2", "content": "rain"}]
    appended = chat.decode(trajectory.append(results))

    assert appended.count("<|im_start|>user") == 1
    assert appended == ("\n<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\nrain\n"
                        "</tool_response><|im_end|>\n<|im_start|>assistant\n")
    [report] = check_trajectory(trajectory, special_token_ids(chat.tokenizer))
    assert report.exact, report.differences
    # One result at a time would render two user turns: the second append is refused.
    with pytest.raises(AppendOrderError):
        trajectory.append(results[1:])


@pytest.mark.parametrize("family", ["qwen2_5", "qwen3"])
def test_arguments_given_as_a_string(chats, family):
    chat = chats[family]
    thought = "<think>\nCall it.\n</think>\n\n" if family == "qwen3" else ""
    text = thought + '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>'
    result = [{"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    trajectories = {}
    for as_string in (False, True):
        trajectory = ChatTrajectory(chat, SYSTEM_USER, tools=TOOLS, family=family)
        message = {"role": "assistant", "content": "", "tool_calls": [tool_call("c1", "Paris", as_string=as_string)]}
        if family == "qwen3":
            message["reasoning_content"] = "Call it."
        sample(trajectory, text, message)
        trajectory.append(result)
        trajectories[as_string] = trajectory
    # The appended tokens never depend on how the arguments are held.
    assert trajectories[True].sample.ids == trajectories[False].sample.ids
    by_object = check_trajectory(trajectories[False], special_token_ids(chat.tokenizer))[0]
    by_string = check_trajectory(trajectories[True], special_token_ids(chat.tokenizer))[0]
    assert by_object.exact, by_object.differences
    if family == "qwen3":
        assert by_string.exact   # Qwen3's template writes a string as it is
    else:
        # Qwen2.5's template JSON-encodes a string again: the whole render differs inside the
        # generated call, never in text the model did not generate.
        assert by_string.counts["assistant"] >= 1
        assert by_string.counts["non_assistant"] == 0 and by_string.counts["special"] == 0


def test_logprobs_must_match_the_generated_ids(chats):
    trajectory = ChatTrajectory(chats["qwen2_5"], SYSTEM_USER)
    with pytest.raises(AppendError, match="3 generated ids but 2 logprobs"):
        trajectory.add_generated([1, 2, 3], [-0.1, -0.2], {"role": "assistant", "content": "x"})


def test_length_truncated_turn_refuses_appending(chats):
    chat = chats["qwen2_5"]
    trajectory = ChatTrajectory(chat, SYSTEM_USER)
    ids = sample(trajectory, "The weather in Paris is", {"role": "assistant", "content": "The weather in Paris is"})
    with pytest.raises(TruncatedTurnError) as raised:
        trajectory.append([{"role": "user", "content": "go on"}])
    assert raised.value.turn == 1 and raised.value.last_id == ids[-1]
    assert trajectory.sample.ids[-len(ids):] == ids   # nothing was appended


def test_qwen3_history_rewrite_keep_sampled(chats):
    chat = chats["qwen3"]
    trajectory = ChatTrajectory(chat, SYSTEM_USER, family="qwen3", history_rewrite="keep_sampled")
    first = sample(trajectory, "<think>\nBoth are easy.\n</think>\n\nSunny.<|im_end|>",
                   {"role": "assistant", "content": "Sunny.", "reasoning_content": "Both are easy."})
    trajectory.append([{"role": "user", "content": "And Rome?"}])
    second = sample(trajectory, "<think>\nRome too.\n</think>\n\nAlso sunny.<|im_end|>",
                    {"role": "assistant", "content": "Also sunny.", "reasoning_content": "Rome too."})

    assert len(trajectory.samples) == 1
    tokens = trajectory.sample.ids
    assert _contains(tokens, first) and tokens[-len(second):] == second   # kept as sampled, reasoning and all
    [report] = check_trajectory(trajectory, special_token_ids(chat.tokenizer))
    # The whole render drops the first turn's reasoning: one documented rewrite in generated text.
    assert [(d.kind, d.rewrite) for d in report.differences] == [("assistant", "drops earlier reasoning")]
    assert report.bugs == 0


def test_qwen3_history_rewrite_split_starts_a_new_sample(chats):
    chat = chats["qwen3"]
    trajectory = ChatTrajectory(chat, SYSTEM_USER, family="qwen3", history_rewrite="split")
    sample(trajectory, "<think>\nBoth are easy.\n</think>\n\nSunny.<|im_end|>",
           {"role": "assistant", "content": "Sunny.", "reasoning_content": "Both are easy."})
    first_sample = list(trajectory.sample.ids)
    prompt = trajectory.append([{"role": "user", "content": "And Rome?"}])

    assert len(trajectory.samples) == 2
    assert trajectory.samples[0].ids == first_sample   # the first sample is kept as it was
    whole = chat.render(trajectory.messages, add_generation_prompt=True)
    assert "Both are easy" not in whole and prompt == chat.encode(whole) == trajectory.prompt_ids()
    assert trajectory.sample.loss_mask == [0] * len(prompt)
    sample(trajectory, "<think>\nRome too.\n</think>\n\nAlso sunny.<|im_end|>",
           {"role": "assistant", "content": "Also sunny.", "reasoning_content": "Rome too."})
    assert all(report.exact for report in check_trajectory(trajectory, special_token_ids(chat.tokenizer)))


def test_split_keeps_one_sample_while_the_render_extends(chats):
    chat = chats["qwen2_5"]
    trajectory = ChatTrajectory(chat, SYSTEM_USER, history_rewrite="split")
    for turn in range(3):
        sample(trajectory, f"Turn {turn}.<|im_end|>", {"role": "assistant", "content": f"Turn {turn}."})
        trajectory.append([{"role": "user", "content": "More."}])
    assert len(trajectory.samples) == 1
    assert trajectory.prompt_ids() == chat.encode(chat.render(trajectory.messages, add_generation_prompt=True))


def test_retokenization_merge_is_kept_as_sampled(chats):
    chat = chats["qwen2_5"]
    trajectory = ChatTrajectory(chat, SYSTEM_USER)
    canonical = chat.encode("The answer is 4.")
    merged = chat.encode(" 4")
    assert len(merged) == 1   # " 4" is one id in the canonical encoding...
    split = chat.encode(" ") + chat.encode("4")   # ...and the model sampled it as two
    at = canonical.index(merged[0])
    sampled = canonical[:at] + split + canonical[at + 1:] + chat.encode("<|im_end|>")
    assert chat.decode(sampled) == "The answer is 4.<|im_end|>"
    start = len(trajectory.sample.ids)
    trajectory.add_generated(sampled, [-1.0] * len(sampled), {"role": "assistant", "content": "The answer is 4."})
    trajectory.append([{"role": "user", "content": "Sure?"}])

    assert trajectory.sample.ids[start:start + len(sampled)] == sampled
    [report] = check_trajectory(trajectory, special_token_ids(chat.tokenizer))
    [difference] = report.differences
    assert difference.kind == "assistant"
    assert (difference.trace_start, difference.trace_end) == (start + at, start + at + 2)
    assert report.counts == {"special": 0, "non_assistant": 0, "assistant": 1}


def test_appending_renders_no_history(chats):
    chat = RecordingChat(chats["qwen3"])
    trajectory = ChatTrajectory(chat, SYSTEM_USER, family="qwen3")
    chat.rendered_lengths.clear()
    for turn in range(6):
        sample(trajectory, f"<think>\nt{turn}\n</think>\n\nok<|im_end|>", {"role": "assistant", "content": "ok"})
        trajectory.append([{"role": "user", "content": f"next {turn}"}])
    # Each append renders the system message, the stand-in user and assistant, and the one new message.
    assert chat.rendered_lengths == [4] * 6
    assert len(trajectory.messages) == 2 + 12


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_joins_exactly_after_a_plain_turn(chats, family):
    chat = chats[family]
    kwargs = FAMILIES[family].template_kwargs
    trajectory = ChatTrajectory(chat, SYSTEM_USER[1:], template_kwargs=kwargs, family=family)
    opener = "<|channel|>final<|message|>" if family == "gpt_oss" else ""
    thought = {"qwen3": "<think>\n\n</think>\n\n"}.get(family, "")
    for turn, answer in enumerate(["Sunny.", "Rain."]):
        sample(trajectory, f"{opener}{thought}{answer}{END_OF_TURN[family]}", {"role": "assistant", "content": answer})
        if turn == 0:
            trajectory.append([{"role": "user", "content": "And Rome?"}])
    [report] = check_trajectory(trajectory, special_token_ids(chat.tokenizer))
    assert report.bugs == 0, report.differences
    assert STAND_IN_MARKER not in chat.decode(trajectory.sample.ids)
    if family == "gpt_oss":
        assert [d.rewrite for d in report.differences] == ["<|return|> rendered as <|end|>"]
    elif family == "qwen3":
        assert [d.rewrite for d in report.differences] == ["drops earlier reasoning"]
    else:
        assert report.exact, report.differences


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_joins_exactly_after_a_tool_call(chats, family):
    """Llama 3 and Mistral write no content beside a call, DeepSeek wants arguments as a string,
    Mistral 9-character call ids: the stand-in carries the call and the marker in its arguments."""
    chat = chats[family]
    kwargs = FAMILIES[family].template_kwargs
    arguments = '{"city": "Paris"}' if family == "deepseek_v3" else {"city": "Paris"}
    call = {"id": "abcDEF123", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
    turn = {"role": "assistant", "content": "", "tool_calls": [call]}
    result = {"role": "tool", "tool_call_id": "abcDEF123", "name": "get_weather", "content": "sunny"}
    question = SYSTEM_USER[1:]
    # The sampled turn is the template's own writing of the call, up to its end of turn: what is
    # under test here is the join after it, not the family's call syntax.
    prompt = chat.render(question, tools=TOOLS, add_generation_prompt=True, template_kwargs=kwargs)
    whole = chat.render([*question, turn, result], tools=TOOLS, add_generation_prompt=True, template_kwargs=kwargs)
    assert whole.startswith(prompt)
    rest = whole[len(prompt):]
    ends = [rest.find(text) + len(text) for text in map(chat.decode, ([i] for i in chat.end_of_turn_ids))
            if text in rest]
    trajectory = ChatTrajectory(chat, question, tools=TOOLS, template_kwargs=kwargs, family=family)
    sample(trajectory, rest[:min(ends)], turn)
    trajectory.append([result])

    assert trajectory.prompt_ids() == chat.encode(whole)
    [report] = check_trajectory(trajectory, special_token_ids(chat.tokenizer))
    assert report.exact, report.differences


def test_gpt_oss_needs_its_join_rule(chats):
    # Its template ends an earlier final answer with <|end|>, which is not an end-of-turn id.
    kwargs = FAMILIES["gpt_oss"].template_kwargs
    later = [{"role": "user", "content": "And Rome?"}]
    with pytest.raises(JoinDerivationError):
        TemplateJoin(chats["gpt_oss"], template_kwargs=kwargs).appended_text(later)
    appended = TemplateJoin(chats["gpt_oss"], template_kwargs=kwargs, family="gpt_oss").appended_text(later)
    assert appended == "<|start|>user<|message|>And Rome?<|end|><|start|>assistant"


def _contains(haystack: list[int], needle: list[int]) -> bool:
    return any(haystack[i:i + len(needle)] == needle for i in range(len(haystack) - len(needle) + 1))


def test_an_appended_user_turn_carries_the_system_prompt_where_the_template_writes_it(chats):
    # Mistral's template writes the system prompt into the last user message only: the new user
    # turn is appended as a render of the conversation so far would write it.
    chat = chats["mistral"]
    trajectory = ChatTrajectory(chat, SYSTEM_USER, family="mistral")
    sample(trajectory, "Sunny in both.</s>", {"role": "assistant", "content": "Sunny in both."})
    appended = chat.decode(trajectory.append([{"role": "user", "content": "And Rome?"}]))

    assert appended == "[INST]Be brief.\n\nAnd Rome?[/INST]"
    whole = chat.render(trajectory.messages, add_generation_prompt=True)
    assert whole.endswith(appended) and "Be brief." not in whole[: -len(appended)]


def test_tokens_sampled_under_a_grammar_train_with_mask_0_and_still_count_as_generated(chats):
    chat = chats["qwen2_5"]
    trajectory = ChatTrajectory(chat, SYSTEM_USER, family="qwen2_5")
    prompt_len = len(trajectory.prompt_ids())
    ids = chat.encode('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>')
    flags = [True] * (len(ids) - 2) + [False, True]
    trajectory.add_generated(ids, [-0.5] * len(ids), {"role": "assistant", "content": "", "tool_calls": [
        tool_call("call_0", "Paris")]}, constrained=flags)
    trajectory.append([{"role": "tool", "tool_call_id": "call_0", "content": "sunny"}])
    sample = trajectory.sample
    training = sample.training_mask()
    assert training[prompt_len:prompt_len + len(ids)] == [0 if flag else 1 for flag in flags]
    assert sample.loss_mask[prompt_len:prompt_len + len(ids)] == [1] * len(ids)  # what the model wrote
    assert training[prompt_len + len(ids):] == sample.loss_mask[prompt_len + len(ids):]
    [report] = check_trajectory(trajectory, special_token_ids(chat.tokenizer))
    assert not report.counts.get("non_assistant"), report.differences
    assert trajectory.fork().sample.training_mask() == training
    with pytest.raises(AppendError, match="constrained flags"):
        trajectory.add_generated([1, 2], [-0.1, -0.1], {"role": "assistant", "content": ""}, constrained=[True])


def test_a_rollouts_token_trace_gives_grammar_tokens_loss_mask_0(chat_model_dirs):
    from rollmesh.chat import ChatModel
    from rollmesh.rollout.trajectory import RolloutTrajectory

    model = ChatModel.load(chat_model_dirs["qwen2_5"])
    trajectory = RolloutTrajectory.start(model, SYSTEM_USER, tools=None)
    prompt_len = len(trajectory.chat.sample.ids)
    ids = model.encode('{"unit": "g"}<|im_end|>')
    trajectory.add_generated(ids, [-0.5] * len(ids), [3] * len(ids),
                             {"role": "assistant", "content": '{"unit": "g"}'}, constrained=[True] * len(ids))
    trace = trajectory.trace()
    assert trace.loss_mask[prompt_len:] == [0] * len(ids)
    assert list(trace.logprobs[prompt_len:]) == [-0.5] * len(ids)  # the masked distribution's, kept
