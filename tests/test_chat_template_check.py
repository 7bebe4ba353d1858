"""rollmesh check-template: the fixed conversations run through the token-exact appender on every
family's real template (tests/support/chat_models.py), each case's verdict pinned; a template that rewrites
history in a way no family rule documents is a bug; the command's output and exit codes."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest

from support.chat_models import FAMILIES
from rollmesh.chat import ModelDirectory
from rollmesh.chat.template_cases import CASES
from rollmesh.chat.template_check import VERDICTS, check_template, profile_template, run_case
from rollmesh.chat.token_check import special_token_ids
from rollmesh.cli import main

pytestmark = [pytest.mark.unit, pytest.mark.timeout(300)]

ALL_EXACT = dict.fromkeys(case.name for case in CASES if "reasoning" not in case.needs)
# Every case's verdict for every family template in the tests; a case absent does not apply.
VERDICTS_BY_FAMILY: dict[str, dict[str, str]] = {
    "qwen2_5": {**dict.fromkeys(ALL_EXACT, "exact"), "arguments_string": "expected"},
    # Reasoning off (enable_thinking=False): the generation prompt's empty <think> block leaves
    # earlier turns; reasoning on: earlier reasoning is dropped after a new user query.
    "qwen3": {**dict.fromkeys(ALL_EXACT, "expected"), "system_prompt": "exact",
              "reasoning_on": "expected", "reasoning_off": "expected"},
    # The template raises on more than one call per message; it drops content beside a call.
    "llama3": {**dict.fromkeys(ALL_EXACT, "exact"), "parallel_tool_calls": "unsupported",
               "arguments_string": "expected", "content_and_tool_call": "expected"},
    # The system prompt rides with the last user message only (and the tools before it).
    "mistral": {**dict.fromkeys(ALL_EXACT, "expected"), "no_system_prompt": "exact"},
    "deepseek_v3": {**dict.fromkeys(ALL_EXACT, "exact"), "arguments_string": "expected",
                    "reasoning_on": "expected", "reasoning_off": "exact"},
    # The template renders call ids per message (functions.NAME:0), the model counts per rollout.
    "kimi_k2": {**dict.fromkeys(ALL_EXACT, "exact"), "arguments_string": "expected", "tool_error": "expected",
                "sequential_tool_calls": "expected"},
    # Harmony: one call per turn (no parallel case); the recipient is rendered after the role.
    "gpt_oss": {**{name: "expected" for name in ALL_EXACT if name != "parallel_tool_calls"},
                "system_prompt": "exact", "reasoning_on": "expected", "reasoning_off": "expected"},
}


@pytest.fixture(scope="module")
def chats(chat_model_dirs) -> dict[str, ModelDirectory]:
    return {family: ModelDirectory.load(directory) for family, directory in chat_model_dirs.items()}


@pytest.fixture(scope="module")
def reports(chats):
    return {family: check_template(chat) for family, chat in chats.items()}


def test_the_fixed_set_covers_the_named_conversations():
    names = {case.name for case in CASES}
    assert len(CASES) >= 10
    assert {"one_tool_call", "parallel_tool_calls", "tool_error", "three_turns", "reasoning_on", "reasoning_off",
            "arguments_string", "arguments_object", "system_prompt", "no_system_prompt"} <= names
    assert any(case.system for case in CASES) and any(not case.system for case in CASES)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_case_has_its_pinned_verdict(reports, family):
    report = reports[family]
    assert {result.case: result.verdict for result in report.results} == VERDICTS_BY_FAMILY[family]
    assert report.bugs == 0
    summary = report.summary(family)
    assert summary["cases"] == len(VERDICTS_BY_FAMILY[family])
    assert sum(summary[key] for key in ("exact", "expected", "bugs", "unsupported")) == summary["cases"]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_expected_verdicts_say_why_and_exact_ones_have_no_differences(reports, family):
    for result in reports[family].results:
        if result.verdict == "exact":
            assert not any(result.differences.values()) and result.tokens > 0
        elif result.verdict == "expected":
            assert any(result.differences.values()) and result.note


def test_cases_that_do_not_apply_are_neither_run_nor_counted(reports):
    assert not {"reasoning_on", "reasoning_off"} & {r.case for r in reports["qwen2_5"].results}
    assert "parallel_tool_calls" not in {r.case for r in reports["gpt_oss"].results}
    assert reports["qwen2_5"].summary("m")["cases"] == 10 and reports["qwen3"].summary("m")["cases"] == 12


def test_unsupported_names_the_templates_refusal(reports):
    [parallel] = [r for r in reports["llama3"].results if r.case == "parallel_tool_calls"]
    assert parallel.verdict == "unsupported"
    assert "only supports single tool-calls" in parallel.note


def test_the_conversation_is_made_acceptable_where_rollmesh_can(chats):
    # DeepSeek's template concatenates arguments as text: rollmesh hands it a string ...
    profile = profile_template(chats["deepseek_v3"])
    assert profile.arguments_as == "string"
    assert {profile_template(chats[f]).arguments_as for f in FAMILIES if f != "deepseek_v3"} == {"object"}
    one_call = next(case for case in CASES if case.name == "one_tool_call")
    special = special_token_ids(chats["deepseek_v3"].tokenizer)
    assert run_case(chats["deepseek_v3"], profile, one_call, special).verdict == "exact"
    # ... where an object would be refused by the template.
    as_object = dataclasses.replace(profile, arguments_as="object")
    assert run_case(chats["deepseek_v3"], as_object, one_call, special).verdict == "unsupported"


def test_the_reasoning_switch_and_formats_are_read_from_the_template(chats):
    qwen3, deepseek, gpt_oss = (profile_template(chats[f]) for f in ("qwen3", "deepseek_v3", "gpt_oss"))
    assert (qwen3.tool_parser, qwen3.reasoning_parser, qwen3.thinking_switch) == ("hermes", "qwen3", "enable_thinking")
    assert (deepseek.reasoning_parser, deepseek.thinking_switch) == ("deepseek_r1", "thinking")
    assert (gpt_oss.family, gpt_oss.thinking_switch) == ("gpt_oss", None)
    assert profile_template(chats["qwen2_5"]).family == "qwen2_5"


def _qwen2_5_dropping_earlier_tool_results(source: Path, target: Path) -> Path:
    """The qwen2_5 directory with a template that renders a tool result's content only while it is
    one of the last two messages: a history rewrite no family rule documents."""
    shutil.copytree(source, target)
    config_path = target / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    original = "{{- '\\n<tool_response>\\n' }}\n        {{- message.content }}"
    assert original in config["chat_template"]
    dropping = "{{- '\\n<tool_response>\\n' }}\n        {%- if loop.revindex0 < 2 %}{{- message.content }}{%- endif %}"
    config["chat_template"] = config["chat_template"].replace(original, dropping)
    config_path.write_text(json.dumps(config))
    return target


def test_an_undocumented_history_rewrite_is_a_bug(chat_model_dirs, tmp_path, capsys):
    model = _qwen2_5_dropping_earlier_tool_results(chat_model_dirs["qwen2_5"], tmp_path / "qwen2_5-dropping")
    report = check_template(ModelDirectory.load(model))
    verdicts = {result.case: result.verdict for result in report.results}
    # The conversations with a tool result three messages or more from the end are bugs, never
    # expected; the others keep their verdicts.
    dropped = {"parallel_tool_calls", "tool_error", "three_turns", "sequential_tool_calls"}
    assert verdicts == {case: "bug" if case in dropped else verdict
                        for case, verdict in VERDICTS_BY_FAMILY["qwen2_5"].items()}
    [bug] = [r for r in report.results if r.case == "tool_error"]
    assert "error: no city named" in bug.note   # the dropped result, named

    assert main(["check-template", str(model)]) == 1
    lines = capsys.readouterr().out.strip().splitlines()
    assert json.loads(lines[-1]) == report.summary(str(model))
    assert json.loads(lines[-1])["bugs"] == len(dropped)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_check_template_command_passes_on_every_family(chat_model_dirs, family, capsys):
    model_dir = str(chat_model_dirs[family]) + "/"   # named as given, trailing slash and all
    assert main(["check-template", model_dir]) == 0
    out = capsys.readouterr().out
    lines = out.strip().splitlines()
    summary = json.loads(lines[-1])
    verdicts = VERDICTS_BY_FAMILY[family]
    assert summary == {"model": model_dir, "cases": len(verdicts),
                       "exact": sum(v == "exact" for v in verdicts.values()),
                       "expected": sum(v == "expected" for v in verdicts.values()),
                       "bugs": 0, "unsupported": sum(v == "unsupported" for v in verdicts.values())}
    # The table: one row per case with its verdict, then the JSON line last.
    for case, verdict in verdicts.items():
        assert any(case in line and verdict in line for line in lines[:-1]), (case, verdict)
    assert set(VERDICTS) >= set(verdicts.values())


@pytest.mark.parametrize("make", ["missing", "empty", "no_template"])
def test_a_directory_that_is_not_a_readable_model_exits_2_without_json(chat_model_dirs, tmp_path, capsys, make):
    target = tmp_path / "model"
    if make == "empty":
        target.mkdir()
    elif make == "no_template":
        shutil.copytree(chat_model_dirs["qwen2_5"], target)
        config = json.loads((target / "tokenizer_config.json").read_text())
        del config["chat_template"]
        (target / "tokenizer_config.json").write_text(json.dumps(config))
    assert main(["check-template", str(target)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    [line] = captured.err.strip().splitlines()
    assert line.startswith("rollmesh: error: not a readable model") and str(target) in line


def test_a_later_prompt_the_template_would_not_write_is_a_bug(chats, monkeypatch):
    # Mistral's render of a finished conversation has its system prompt nowhere, so only the prompt
    # of the turn after a new user message shows an appender that leaves the system prompt out of it.
    import rollmesh.chat.template_check as template_check
    from rollmesh.chat.turn_append import ChatTrajectory, TemplateJoin

    class JoinWithoutSystem(ChatTrajectory):
        def __init__(self, chat, messages, **kwargs):
            join = TemplateJoin(chat, tools=kwargs.get("tools"), template_kwargs=kwargs.get("template_kwargs"),
                                family=kwargs.get("family"))
            super().__init__(chat, messages, join=join, **kwargs)

    monkeypatch.setattr(template_check, "ChatTrajectory", JoinWithoutSystem)
    chat = chats["mistral"]
    three_turns = next(case for case in CASES if case.name == "three_turns")
    result = run_case(chat, profile_template(chat), three_turns, special_token_ids(chat.tokenizer))
    assert result.verdict == "bug"
    assert "prompt of message" in result.note and "You are a concise weather assistant." in result.note
