"""Classifying the differences between a trajectory and a whole render (rollmesh.chat.token_check),
on plain id lists: which kind each difference is, where it is, and what a documented rewrite explains."""

from __future__ import annotations

import pytest

import random

from rollmesh.chat.token_check import DOCUMENTED_REWRITES, aligned_opcodes, compare_tokens

pytestmark = pytest.mark.unit

EOT = 99          # a special token
NEWLINE = 10
TEXT = {1: "The", 2: " answer", 3: " 4", 4: " ", 5: "4", 6: ".", 7: " is", NEWLINE: "\n", EOT: "<|im_end|>",
        20: "<think>", 21: "</think>", 22: "\n\n", 23: "hmm", 30: "<|return|>", 31: "<|end|>"}


def decode(ids) -> str:
    return "".join(TEXT[i] for i in ids)


def test_identical_ids_have_no_differences():
    report = compare_tokens([1, 2, 3, EOT], [0, 1, 1, 1], [1, 2, 3, EOT], {EOT})
    assert report.exact and report.counts == {"special": 0, "non_assistant": 0, "assistant": 0}


def test_each_kind_and_its_positions():
    #        prompt                generated         appended
    trace = [1, 2, 11, 12, NEWLINE, 4, 5, 6, EOT, NEWLINE, 13, 14, 15]
    mask = [0, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0]
    # The render has " is" for " answer" in the prompt, " 4" for the sampled " " + "4", no "\n" after EOT.
    render = [1, 7, 11, 12, NEWLINE, 3, 6, EOT, 13, 14, 15]
    report = compare_tokens(trace, mask, render, {EOT})
    kinds = [(d.kind, d.trace_start, d.trace_end) for d in report.differences]
    assert kinds == [("non_assistant", 1, 2), ("assistant", 5, 7), ("non_assistant", 9, 10)]
    assert report.counts == {"special": 0, "non_assistant": 2, "assistant": 1}
    assert report.bugs == 2


def test_a_special_token_difference_is_special_wherever_it_is():
    report = compare_tokens([1, 2, 3, EOT], [0, 1, 1, 1], [1, 2, 3], {EOT})
    assert [(d.kind, d.trace_start, d.trace_end) for d in report.differences] == [("special", 3, 4)]
    report = compare_tokens([1, 2, 3], [0, 1, 1], [1, 2, EOT, 3], {EOT})
    assert [d.kind for d in report.differences] == ["special"]


def test_an_insertion_is_assistant_only_between_generated_ids():
    inside = compare_tokens([1, 2, 3, EOT], [0, 1, 1, 1], [1, 2, 6, 3, EOT], {EOT})
    at_edge = compare_tokens([1, 2, 3, EOT], [0, 1, 1, 1], [1, 6, 2, 3, EOT], {EOT})
    assert [d.kind for d in inside.differences] == ["assistant"]
    assert [d.kind for d in at_edge.differences] == ["non_assistant"]


def test_a_deletion_among_repeated_ids_slides_into_generated_text():
    # "\n" + [generated "\n" "hmm"] + "\n": the render lacks one "\n" + "hmm"; the matcher may put
    # the deletion on the prompt's "\n", an equally good place; it belongs to generated text.
    trace = [1, NEWLINE, NEWLINE, 23, EOT]
    mask = [0, 0, 1, 1, 1]
    report = compare_tokens(trace, mask, [1, NEWLINE, EOT], {EOT})
    [difference] = report.differences
    assert difference.kind == "assistant" and (difference.trace_start, difference.trace_end) == (2, 4)


def test_documented_rewrites_are_named_and_are_not_bugs():
    # Qwen3 drops an earlier reasoning block, here one the generation prompt wrote (mask 0).
    trace = [1, 20, 22, 21, 22, 2, EOT]
    mask = [0, 0, 0, 0, 0, 1, 1]
    report = compare_tokens(trace, mask, [1, 2, EOT], {EOT}, decode=decode, rewrites=DOCUMENTED_REWRITES["qwen3"])
    [difference] = report.differences
    assert (difference.kind, difference.rewrite) == ("non_assistant", "drops earlier reasoning")
    assert report.bugs == 0
    # The same difference without the family's rule is a bug.
    assert compare_tokens(trace, mask, [1, 2, EOT], {EOT}, decode=decode).bugs == 1
    # A dropped block with anything else in it is not the documented rewrite.
    other = compare_tokens([1, 20, 23, 21, 2, 2, EOT], [0, 1, 1, 1, 0, 1, 1], [1, 2, EOT], {EOT},
                           decode=decode, rewrites=DOCUMENTED_REWRITES["qwen3"])
    assert [d.rewrite for d in other.differences] == [""]
    # Qwen3 writes an empty reasoning block into the last turn when the model wrote none.
    added = compare_tokens([1, 2, EOT], [0, 1, 1], [1, 20, 22, 21, 22, 2, EOT], {EOT}, decode=decode,
                           rewrites=DOCUMENTED_REWRITES["qwen3"])
    assert [(d.kind, d.rewrite) for d in added.differences] == [("non_assistant", "writes an empty reasoning block")]
    # gpt-oss writes <|end|> where the model sampled <|return|>.
    swapped = compare_tokens([1, 30, 2], [1, 1, 0], [1, 31, 2], {30, 31}, decode=decode,
                             rewrites=DOCUMENTED_REWRITES["gpt_oss"])
    assert [(d.kind, d.rewrite) for d in swapped.differences] == [("special", "<|return|> rendered as <|end|>")]


def test_a_loss_mask_of_another_length_is_refused():
    with pytest.raises(ValueError, match="loss-mask"):
        compare_tokens([1, 2], [0], [1, 2], set())


def test_aligned_opcodes_turn_the_trajectory_into_the_render():
    rng = random.Random(7)
    for _ in range(50):
        a = [rng.choice([EOT, 1, 2, 3, 4, 5, NEWLINE]) for _ in range(rng.randint(0, 300))]
        b = list(a)
        for _ in range(rng.randint(0, 6)):   # a few insertions, deletions and replacements
            at = rng.randint(0, len(b))
            b[at:at + rng.randint(0, 3)] = [rng.choice([EOT, 6, 7, 1]) for _ in range(rng.randint(0, 3))]
        opcodes = aligned_opcodes(a, b, frozenset({EOT}))
        rebuilt = []
        for tag, i1, i2, j1, j2 in opcodes:
            assert (tag == "equal") == (a[i1:i2] == b[j1:j2] and i2 - i1 == j2 - j1)
            rebuilt += b[j1:j2]
        assert rebuilt == b
        assert [(i1, i2) for _, i1, i2, _, _ in opcodes] == _contiguous(len(a), opcodes)


def _contiguous(length, opcodes):
    """The trace spans the opcodes should cover: back to back from 0 to ``length``."""
    spans, at = [], 0
    for _, i1, i2, _, _ in opcodes:
        spans.append((at, at + (i2 - i1)))
        at += i2 - i1
    assert at == length
    return spans


# Rewrites of the other families (rollmesh check-template's verdicts rest on them).
FAMILY_TEXT = {**TEXT, 40: "[AVAILABLE_TOOLS]", 41: "[/AVAILABLE_TOOLS]", 42: "[INST]", 43: "[/INST]",
               44: "Be brief.", 45: " to=functions.get_weather", 46: "<|channel|>", 47: "<|start|>assistant",
               48: " to=rm -rf"}


def decode_family(ids) -> str:
    return "".join(FAMILY_TEXT[i] for i in ids)


def test_mistral_tools_and_system_prompt_that_left_earlier_user_messages_are_documented():
    rewrites = DOCUMENTED_REWRITES["mistral"]
    # [AVAILABLE_TOOLS]..[/AVAILABLE_TOOLS][INST]Be brief.\n\nThe[/INST] answer</s> vs a render
    # without the tools block and the system prompt in that (no longer last) user message.
    trace = [40, 2, 41, 42, 44, 22, 1, 43, 2, EOT]
    mask = [0, 0, 0, 0, 0, 0, 0, 0, 1, 1]
    render = [42, 1, 43, 2, EOT]
    report = compare_tokens(trace, mask, render, {EOT, 40, 41, 42, 43}, decode=decode_family, rewrites=rewrites,
                            system_prompt="Be brief.")
    assert [d.rewrite for d in report.differences] == ["tools ride with the last user message",
                                                       "system prompt rides with the last user message"]
    assert report.bugs == 0
    # Other text dropped there, or no system prompt to drop, is not the rewrite.
    other = compare_tokens(trace, mask, render, {EOT, 40, 41, 42, 43}, decode=decode_family, rewrites=rewrites,
                           system_prompt="Be kind.")
    assert other.bugs == 1


def test_gpt_oss_call_recipient_rendered_after_the_role_is_documented():
    # <|start|>assistant | <|channel|> ... (generated) vs <|start|>assistant to=functions.get_weather<|channel|> ...
    trace, mask = [47, 46, 2, EOT], [0, 1, 1, 1]
    report = compare_tokens(trace, mask, [47, 45, 46, 2, EOT], {EOT, 46, 47}, decode=decode_family,
                            rewrites=DOCUMENTED_REWRITES["gpt_oss"])
    assert [(d.kind, d.rewrite) for d in report.differences] == [("non_assistant", "call recipient rendered after the role")]
    assert report.bugs == 0
    # Any other inserted text is no recipient.
    other = compare_tokens(trace, mask, [47, 48, 46, 2, EOT], {EOT, 46, 47}, decode=decode_family,
                           rewrites=DOCUMENTED_REWRITES["gpt_oss"])
    assert other.bugs == 1


def test_deepseek_reasoning_after_the_prompts_think_is_documented():
    # <think> (the generation prompt's) + generated "hmm</think> answer" vs the render's "</think> answer".
    trace, mask = [20, 23, 21, 2, EOT], [0, 1, 1, 1, 1]
    report = compare_tokens(trace, mask, [21, 2, EOT], {EOT}, decode=decode_family,
                            rewrites=DOCUMENTED_REWRITES["deepseek_v3"])
    assert [d.rewrite for d in report.differences] == ["drops reasoning after the prompt's <think>"]
    assert report.bugs == 0
    # Without the family's rules the same difference is a bug.
    assert compare_tokens(trace, mask, [21, 2, EOT], {EOT}, decode=decode_family).bugs == 1
