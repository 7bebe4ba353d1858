"""Reasoning parsers on turns as the models write them, with the real templates' prompts deciding
whether a turn starts inside reasoning (tests/data/chat_templates, transformers' Jinja renderer)."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers.utils.chat_template_utils import render_jinja_template

from rollmesh.chat.errors import UnknownParserError
from rollmesh.chat.reasoning import detect_reasoning_parser, prompt_opens_reasoning, split_reasoning
from rollmesh.chat.tool_calls import parse_assistant_turn

pytestmark = pytest.mark.unit

TEMPLATES = Path(__file__).parent / "data" / "chat_templates"
USER = [{"role": "user", "content": "What is 2 + 2?"}]


def template(family: str) -> str:
    return (TEMPLATES / f"{family}.jinja").read_text()


def generation_prompt(family: str, **template_kwargs) -> str:
    rendered, _ = render_jinja_template(
        [USER], chat_template=template(family), add_generation_prompt=True, **template_kwargs
    )
    return rendered[0]


def test_qwen3_thinking_turn_splits_reasoning_from_content():
    # Qwen3 with enable_thinking: the prompt ends at "<|im_start|>assistant\n", the model opens <think>.
    prompt = generation_prompt("qwen3", enable_thinking=True)
    assert prompt.endswith("<|im_start|>assistant\n") and not prompt_opens_reasoning(prompt)

    parsed = parse_assistant_turn(
        "<think>\nTwo plus two is four.\n</think>\n\nThe answer is 4.<|im_end|>",
        tool_parser="hermes",
        reasoning_parser="qwen3",
        starts_in_reasoning=prompt_opens_reasoning(prompt),
    )

    assert (parsed.reasoning, parsed.content) == ("Two plus two is four.", "The answer is 4.")


def test_qwen3_thinking_off_turn_is_all_content():
    # enable_thinking=False: the template writes an empty think block into the prompt itself.
    prompt = generation_prompt("qwen3", enable_thinking=False)
    assert prompt.endswith("<think>\n\n</think>\n\n") and not prompt_opens_reasoning(prompt)

    parsed = parse_assistant_turn("The answer is 4.<|im_end|>", tool_parser="hermes", reasoning_parser="qwen3")

    assert (parsed.reasoning, parsed.content) == (None, "The answer is 4.")


def test_turn_that_starts_inside_reasoning_shows_only_the_closing_tag():
    # DeepSeek-R1 and Qwen3-thinking-2507 templates put "<think>\n" in the prompt.
    split = split_reasoning("I need to think about this...\n</think>\n\nThe answer is 42.", "qwen3")
    assert (split.reasoning, split.rest.strip()) == ("I need to think about this...", "The answer is 42.")


def test_deepseek_v3_1_prompt_says_whether_the_turn_starts_inside_reasoning():
    bos = {"bos_token": "<｜begin▁of▁sentence｜>"}
    thinking = generation_prompt("deepseek_v3", thinking=True, **bos)
    not_thinking = generation_prompt("deepseek_v3", thinking=False, **bos)
    assert thinking.endswith("<｜Assistant｜><think>") and prompt_opens_reasoning(thinking)
    assert not_thinking.endswith("<｜Assistant｜></think>") and not prompt_opens_reasoning(not_thinking)

    on = parse_assistant_turn(
        "2 + 2 = 4.</think>The answer is 4.<｜end▁of▁sentence｜>",
        tool_parser="deepseek_v3",
        reasoning_parser="deepseek_r1",
        starts_in_reasoning=prompt_opens_reasoning(thinking),
    )
    off = parse_assistant_turn(
        "The answer is 4.<｜end▁of▁sentence｜>",
        tool_parser="deepseek_v3",
        reasoning_parser="deepseek_r1",
        starts_in_reasoning=prompt_opens_reasoning(not_thinking),
    )

    assert (on.reasoning, on.content) == ("2 + 2 = 4.", "The answer is 4.")
    assert (off.reasoning, off.content) == (None, "The answer is 4.")


def test_deepseek_r1_takes_an_untagged_turn_as_reasoning_by_default():
    split = split_reasoning("Let me count.</think>4", "deepseek_r1")
    assert (split.reasoning, split.rest) == ("Let me count.", "4")


@pytest.mark.parametrize(
    ("text", "starts_in_reasoning"),
    [("<think>\nStill counting, one, two", None), ("Still counting, one, two", True)],
)
def test_turn_cut_inside_reasoning_is_all_reasoning_and_no_content(text, starts_in_reasoning):
    parsed = parse_assistant_turn(
        text, tool_parser="hermes", reasoning_parser="qwen3", starts_in_reasoning=starts_in_reasoning
    )
    assert (parsed.reasoning, parsed.content, parsed.tool_calls) == ("Still counting, one, two", "", [])


def test_harmony_analysis_is_reasoning_and_final_is_content():
    # The generation prompt ends with "<|start|>assistant"; the turn then writes its channels.
    assert generation_prompt("gpt_oss").endswith("<|start|>assistant")
    text = (
        "<|channel|>analysis<|message|>Simple arithmetic.<|end|>"
        "<|start|>assistant<|channel|>analysis<|message|>Answer 4.<|end|>"
        "<|start|>assistant<|channel|>final<|message|>2 + 2 = 4.<|return|>"
    )
    parsed = parse_assistant_turn(text, tool_parser=None, reasoning_parser="gpt_oss")

    assert (parsed.reasoning, parsed.content) == ("Simple arithmetic.\nAnswer 4.", "2 + 2 = 4.")


def test_harmony_turn_without_analysis_has_no_reasoning():
    text = "<|channel|>final<|message|>4<|return|>"
    parsed = parse_assistant_turn(text, tool_parser="gpt_oss", reasoning_parser="gpt_oss")
    assert (parsed.reasoning, parsed.content) == (None, "4")


def test_unknown_reasoning_parser_is_a_typed_error():
    with pytest.raises(UnknownParserError) as unknown:
        split_reasoning("x", "o1")
    assert (unknown.value.kind, unknown.value.name) == ("reasoning", "o1")
    assert set(unknown.value.known) == {"qwen3", "deepseek_r1", "gpt_oss"}


@pytest.mark.parametrize(
    ("family", "expected"),
    [
        ("qwen2_5", None),
        ("qwen3", "qwen3"),
        ("llama3", None),
        ("mistral", None),
        ("deepseek_v3", "deepseek_r1"),
        ("kimi_k2", None),
        ("gpt_oss", "gpt_oss"),
    ],
)
def test_reasoning_parser_is_detected_from_the_real_template(family, expected):
    assert detect_reasoning_parser(template(family)) == expected
