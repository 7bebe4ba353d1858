"""``rollmesh check-template``'s logic: the fixed conversations (``template_cases``) run through the
rollout path's token-exact appender on a model directory, each classified against a whole render.

Each model turn is written in the family's own generation format (``turn_writer``), encoded once
as if it were sampled, parsed back with the family's parsers into the assistant message, and kept
as sampled by ``ChatTrajectory``; tool results and user turns are appended as the rollout appends
them. Call ids and the arguments' form are made to be what the template accepts. Verdicts:

- ``exact``: the trajectory is the whole render's ids;
- ``expected``: every difference lies in tokens the model generated (re-tokenized or re-rendered
  assistant text), or is a history rewrite the family's rules document (``DOCUMENTED_REWRITES``);
- ``bug``: any other difference in tokens the model did not generate, or rollmesh failing on the
  conversation (its parser not reading what its writer wrote, a join it cannot derive);
- ``unsupported``: the template itself refuses the conversation (it raised while rendering).

Knows the chat package (model directory, parsers, writers, appender, check); not the CLI or rich.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from rollmesh.chat.errors import ChatError, TemplateRenderError
from rollmesh.chat.model_dir import ModelDirectory
from rollmesh.chat.reasoning import detect_reasoning_parser, prompt_opens_reasoning
from rollmesh.chat.template_cases import CASES, SYSTEM_PROMPT, TOOLS, CheckCase, ModelTurn, ToolResults, UserTurn
from rollmesh.chat.token_check import (
    DOCUMENTED_REWRITES,
    MISMATCH_KINDS,
    TokenCheckReport,
    TokenDifference,
    check_trajectory,
    compare_tokens,
    render_conversation_ids,
    special_token_ids,
)
from rollmesh.chat.tool_calls import (
    TOOL_PARSERS,
    ParsedTurn,
    ToolCall,
    detect_tool_parser,
    make_call_id,
    parse_assistant_turn,
)
from rollmesh.chat.turn_append import ChatTrajectory
from rollmesh.chat.turn_writer import ONE_CALL_PER_TURN, write_assistant_turn

Verdict = Literal["exact", "expected", "bug", "unsupported"]
VERDICTS: tuple[Verdict, ...] = ("exact", "expected", "bug", "unsupported")
ArgumentsForm = Literal["object", "string"]

# The template variables that switch reasoning on and off, as the families' templates spell them.
THINKING_SWITCHES = ("enable_thinking", "thinking")
_PROBE_ARGUMENTS = {"city": "Probe"}


@dataclass(frozen=True)
class TemplateProfile:
    """What the checker reads off a model's template: its formats, its family's rules, its needs."""

    tool_parser: str | None
    reasoning_parser: str | None
    family: str | None             # the family whose join rules and documented rewrites apply
    thinking_switch: str | None    # the template variable that turns reasoning on and off
    arguments_as: ArgumentsForm    # the form of a call's arguments the template renders


@dataclass(frozen=True)
class CaseResult:
    case: str
    verdict: Verdict
    tokens: int                                   # the trajectory's tokens, every sample together
    differences: Mapping[str, int] = field(default_factory=lambda: dict.fromkeys(MISMATCH_KINDS, 0))
    note: str = ""                                # the rewrites named, the template's refusal, the bug


@dataclass(frozen=True)
class TemplateCheckReport:
    profile: TemplateProfile
    results: tuple[CaseResult, ...]

    @property
    def bugs(self) -> int:
        return sum(1 for result in self.results if result.verdict == "bug")

    def summary(self, model: str) -> dict[str, Any]:
        """The last line ``rollmesh check-template`` prints: the four counts add up to ``cases``."""
        count = {verdict: sum(1 for r in self.results if r.verdict == verdict) for verdict in VERDICTS}
        return {"model": model, "cases": len(self.results), "exact": count["exact"],
                "expected": count["expected"], "bugs": count["bug"], "unsupported": count["unsupported"]}


def family_of(tool_parser: str | None, reasoning_parser: str | None) -> str | None:
    """The family a template's formats name, for the join rules and documented rewrites."""
    if tool_parser == "hermes":
        return "qwen3" if reasoning_parser == "qwen3" else "qwen2_5"
    return {"llama3_json": "llama3", "mistral": "mistral", "deepseek_v3": "deepseek_v3", "kimi_k2": "kimi_k2",
            "gpt_oss": "gpt_oss"}.get(tool_parser or "", "gpt_oss" if reasoning_parser == "gpt_oss" else None)


def profile_template(chat: ModelDirectory) -> TemplateProfile:
    tool_parser = detect_tool_parser(chat.chat_template)
    reasoning_parser = detect_reasoning_parser(chat.chat_template)
    switch = next((name for name in THINKING_SWITCHES if f"{name} is defined" in chat.chat_template
                   or f"{name} is not defined" in chat.chat_template), None)
    return TemplateProfile(tool_parser, reasoning_parser, family_of(tool_parser, reasoning_parser),
                           switch if reasoning_parser else None, _arguments_form(chat, tool_parser))


def _arguments_form(chat: ModelDirectory, tool_parser: str | None) -> ArgumentsForm:
    """Object, unless the template cannot render an object (DeepSeek concatenates text) but can a string."""
    if tool_parser is None:
        return "object"
    style = TOOL_PARSERS[tool_parser].call_id_style
    call = ToolCall(make_call_id(style, 0, name="get_weather"), "get_weather", _PROBE_ARGUMENTS)
    for form in ("object", "string"):
        message = {"role": "assistant", "content": "", "tool_calls": [call.to_openai(arguments_as=form)]}
        try:
            text = chat.render([{"role": "user", "content": "probe"}, message], tools=list(TOOLS),
                               add_generation_prompt=False)
        except TemplateRenderError:
            continue
        if '"city": "Probe"' in text or '"city":"Probe"' in text:
            return form
    return "object"


def applicable_cases(profile: TemplateProfile) -> list[CheckCase]:
    """The cases this template can express: no tools without a tool format, no reasoning without a
    reasoning format, no parallel calls where a call ends the turn (harmony)."""
    def applies(case: CheckCase) -> bool:
        if "tools" in case.needs and profile.tool_parser is None:
            return False
        if "reasoning" in case.needs and profile.reasoning_parser is None:
            return False
        return not ("parallel_calls" in case.needs and profile.tool_parser in ONE_CALL_PER_TURN)
    return [case for case in CASES if applies(case)]


def check_template(chat: ModelDirectory) -> TemplateCheckReport:
    profile = profile_template(chat)
    special_ids = special_token_ids(chat.tokenizer)
    results = tuple(run_case(chat, profile, case, special_ids) for case in applicable_cases(profile))
    return TemplateCheckReport(profile, results)


class _UnreadTurnError(ChatError):
    """The family's parser did not read back the turn its writer wrote: a rollmesh bug."""


def run_case(chat: ModelDirectory, profile: TemplateProfile, case: CheckCase,
             special_ids: frozenset[int]) -> CaseResult:
    try:
        trajectory, prompts = _run_conversation(chat, profile, case)
        reports = check_trajectory(trajectory, special_ids)
        prompt_bugs = [bug for prompt in prompts for bug in _check_prompt(chat, trajectory, prompt, special_ids)]
    except TemplateRenderError as exc:
        said = exc.template_message or exc.reason
        return CaseResult(case.name, "unsupported", 0, note=f"the template refuses it: {_one_line(said)}")
    except (ChatError, _UnreadTurnError) as exc:
        return CaseResult(case.name, "bug", 0, note=f"rollmesh failed: {_one_line(str(exc))}")
    return classify(chat, trajectory, reports, case.name, prompt_bugs)


@dataclass(frozen=True)
class _Prompt:
    """A prompt the model generated from: the first ``tokens`` ids of sample ``sample``, for the
    conversation's first ``messages`` messages."""

    sample: int
    tokens: int
    messages: int


def _run_conversation(chat: ModelDirectory, profile: TemplateProfile,
                      case: CheckCase) -> tuple[ChatTrajectory, list[_Prompt]]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM_PROMPT}] if case.system else []
    messages.append({"role": "user", "content": case.user})
    kwargs = {profile.thinking_switch: case.thinking} if profile.thinking_switch else {}
    uses_tools = "tools" in case.needs
    trajectory = ChatTrajectory(chat, messages, tools=list(TOOLS) if uses_tools else None, template_kwargs=kwargs,
                                family=profile.family)
    calls_made = 0
    last_calls: list[ToolCall] = []
    prompts: list[_Prompt] = []
    for step in case.steps:
        if isinstance(step, ModelTurn):
            prompts.append(_Prompt(len(trajectory.samples) - 1, len(trajectory.sample.ids), len(trajectory.messages)))
            last_calls = _generate(chat, profile, trajectory, step, calls_made)
            calls_made += len(last_calls)
        elif isinstance(step, ToolResults):
            trajectory.append([{"role": "tool", "tool_call_id": call.id, "content": content}
                               for call, content in zip(last_calls, step.contents, strict=True)])
        elif isinstance(step, UserTurn):
            trajectory.append([{"role": "user", "content": step.content}])
    return trajectory, prompts


def _check_prompt(chat: ModelDirectory, trajectory: ChatTrajectory, prompt: _Prompt,
                  special_ids: frozenset[int]) -> list[str]:
    """A later turn's prompt against the template's render of the conversation so far with the
    generation prompt: a finished conversation's render can hide an appended turn that differs
    from what the template writes for it (Mistral's system prompt rides only with a last user
    message), the render at that turn cannot."""
    join = trajectory.join
    sample = trajectory.samples[prompt.sample]
    ids, mask = sample.ids[: prompt.tokens], sample.loss_mask[: prompt.tokens]
    messages = trajectory.messages[: prompt.messages]
    render_ids = chat.encode(chat.render(messages, tools=join.tools, add_generation_prompt=True,
                                         template_kwargs=join.template_kwargs))
    first = messages[0] if messages else {}
    system_prompt = first.get("content") if first.get("role") == "system" else ""
    report = compare_tokens(ids, mask, render_ids, special_ids, decode=chat.decode,
                            rewrites=DOCUMENTED_REWRITES.get(join.family or "", ()),
                            system_prompt=system_prompt if isinstance(system_prompt, str) else "")
    return [f"prompt of message {prompt.messages}, {bug}" for bug in _unexplained(chat, ids, mask, render_ids, report)]


def _generate(chat: ModelDirectory, profile: TemplateProfile, trajectory: ChatTrajectory, turn: ModelTurn,
              calls_made: int) -> list[ToolCall]:
    """Write the turn in the family's format, encode it once as if sampled, parse it back."""
    style = TOOL_PARSERS[profile.tool_parser].call_id_style if profile.tool_parser else "openai"
    calls = [ToolCall(make_call_id(style, calls_made + offset, name="get_weather"), "get_weather", dict(arguments),
                      index=offset, arguments_were_string=turn.arguments_as_string)
             for offset, arguments in enumerate(turn.calls)]
    opened = prompt_opens_reasoning(chat.decode(trajectory.prompt_ids()[-8:]))
    text = write_assistant_turn(tool_parser=profile.tool_parser, reasoning_parser=profile.reasoning_parser,
                                content=turn.content, calls=calls, reasoning=turn.reasoning,
                                prompt_opened_reasoning=opened, end_of_turn=end_of_turn_text(chat))
    ids = chat.encode(text)
    parsed = parse_assistant_turn(chat.decode(ids), tool_parser=profile.tool_parser,
                                  reasoning_parser=profile.reasoning_parser, tools=list(TOOLS),
                                  first_call_index=calls_made, starts_in_reasoning=opened)
    if parsed.malformed or [(c.name, c.arguments) for c in parsed.tool_calls] != [(c.name, c.arguments) for c in calls]:
        raise _UnreadTurnError(f"the {profile.tool_parser} parser read {parsed.tool_calls} {parsed.malformed} "
                               f"from {text!r}")
    trajectory.add_generated(ids, [0.0] * len(ids), assistant_message(parsed, profile.arguments_as))
    return parsed.tool_calls


def end_of_turn_text(chat: ModelDirectory) -> str:
    """The token the model ends a plain turn with: its eos when that ends a turn, else the first
    end-of-turn id ("" when it has none: every turn is then cut, which the appender refuses)."""
    eos = chat.tokenizer.eos_token
    if eos and chat.tokenizer.convert_tokens_to_ids(eos) in chat.end_of_turn_ids:
        return eos
    return chat.decode(sorted(chat.end_of_turn_ids)[:1])


def assistant_message(parsed: ParsedTurn, arguments_as: ArgumentsForm) -> dict[str, Any]:
    """The parsed turn as the OpenAI message the template renders. Reasoning goes under both names
    templates read (Qwen3's ``reasoning_content``, gpt-oss's ``thinking``); ``tool_calls`` only when
    there are calls, since Llama 3's and gpt-oss's templates test for the key itself."""
    message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
    if parsed.reasoning is not None:
        message["reasoning_content"] = message["thinking"] = parsed.reasoning
    if parsed.tool_calls:
        message["tool_calls"] = [call.to_openai(arguments_as=arguments_as) for call in parsed.tool_calls]
    return message


def classify(chat: ModelDirectory, trajectory: ChatTrajectory, reports: Sequence[TokenCheckReport],
             case: str, prompt_bugs: Sequence[str] = ()) -> CaseResult:
    """The verdict from the final check of each sample (whose differences are counted) and the
    unexplained differences found in the prompts of later turns."""
    counts = dict.fromkeys(MISMATCH_KINDS, 0)
    rewrites: list[str] = []
    bugs: list[str] = []
    for sample, report in zip(trajectory.samples, reports, strict=True):
        for kind, number in report.counts.items():
            counts[kind] += number
        rewrites.extend(difference.rewrite for difference in report.differences if difference.rewrite)
        if any(_is_bug(sample.loss_mask, difference) for difference in report.differences):
            render_ids = render_conversation_ids(chat, trajectory.messages[: sample.message_count], trajectory.join)
            bugs.extend(_unexplained(chat, sample.ids, sample.loss_mask, render_ids, report))
    bugs.extend(prompt_bugs)
    tokens = sum(len(sample.ids) for sample in trajectory.samples)
    if bugs:
        return CaseResult(case, "bug", tokens, counts, _one_line("; ".join(bugs)))
    if not any(counts.values()):
        return CaseResult(case, "exact", tokens, counts)
    note = ", ".join(dict.fromkeys(rewrites)) or "re-rendered assistant text"
    return CaseResult(case, "expected", tokens, counts, note)


def _is_bug(loss_mask: Sequence[int], difference: TokenDifference) -> bool:
    return not difference.rewrite and not _only_generated(loss_mask, difference.trace_start, difference.trace_end)


def _unexplained(chat: ModelDirectory, ids: Sequence[int], loss_mask: Sequence[int], render_ids: Sequence[int],
                 report: TokenCheckReport) -> list[str]:
    """Each bug-class difference, both sides as text."""
    return [f"token {d.trace_start}: trajectory {chat.decode(ids[d.trace_start:d.trace_end])!r}, "
            f"render {chat.decode(render_ids[d.render_start:d.render_end])!r}"
            for d in report.differences if _is_bug(loss_mask, d)]


def _only_generated(loss_mask: Sequence[int], start: int, end: int) -> bool:
    """Whether trajectory positions [start, end) are generated tokens; an insertion counts when the
    ids on both sides of it were generated."""
    if start < end:
        return all(loss_mask[start:end])
    return 0 < start < len(loss_mask) and bool(loss_mask[start - 1]) and bool(loss_mask[start])


def _one_line(text: str, limit: int = 160) -> str:
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 1] + "\u2026"
