"""A model as every text path of the product uses it: its directory plus the formats chosen for it.

Knows the config's model section (duck-typed: ``path``, ``tool_parser``, ``reasoning_parser``,
``chat_template_kwargs``) and this package; nothing of engines, Ray or NATS. The rollout loop, the
trainer's warm start and the Serve app each build one ``ChatModel`` from ``model`` config and do
everything through it: render and tokenize the first prompt, start a token-exact trajectory, read
tool calls and reasoning out of a generated turn, and write a turn as the model would (warm-start
demonstrations). Parsers left unset in config are detected from the chat template, and the choice
is logged once.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import structlog

from rollmesh.chat.errors import UnknownParserError
from rollmesh.chat.model_dir import ModelDirectory
from rollmesh.chat.reasoning import REASONING_PARSERS, prompt_opens_reasoning
from rollmesh.chat.template_check import (
    ArgumentsForm,
    end_of_turn_text,
    assistant_message,
    family_of,
    profile_template,
)
from rollmesh.chat.tool_calls import TOOL_PARSERS, ParsedTurn, ToolCall, parse_assistant_turn
from rollmesh.chat.tool_schemas import ToolSet
from rollmesh.chat.turn_append import ChatTrajectory, HistoryRewrite, TemplateJoin
from rollmesh.chat.turn_writer import write_assistant_turn

_log = structlog.get_logger("rollmesh.chat")


@dataclass(frozen=True, eq=False)
class ChatModel:
    """A loaded model directory with its tool and reasoning formats; build it with ``from_config``."""

    directory: ModelDirectory
    tool_parser: str | None
    reasoning_parser: str | None
    family: str | None                 # whose join rules and documented rewrites apply
    arguments_as: ArgumentsForm        # the form of a call's arguments the template renders
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    # Compiled tool declarations by their JSON: compiling a schema's validator costs ~10 ms, which a
    # rollout would otherwise pay at every parsed turn (a task's tools are the same every time).
    _toolsets: dict[str, ToolSet] = field(default_factory=dict, repr=False)

    @classmethod
    def from_config(cls, model_config: Any) -> ChatModel:
        return cls.load(model_config.path, tool_parser=model_config.tool_parser or None,
                        reasoning_parser=model_config.reasoning_parser or None,
                        template_kwargs=dict(model_config.chat_template_kwargs))

    @classmethod
    def load(cls, path: Any, *, tool_parser: str | None = None, reasoning_parser: str | None = None,
             template_kwargs: Mapping[str, Any] | None = None) -> ChatModel:
        directory = ModelDirectory.load(path)
        if tool_parser is not None and tool_parser not in TOOL_PARSERS:
            raise UnknownParserError(kind="tool", name=tool_parser, known=tuple(TOOL_PARSERS))
        if reasoning_parser is not None and reasoning_parser not in REASONING_PARSERS:
            raise UnknownParserError(kind="reasoning", name=reasoning_parser, known=tuple(REASONING_PARSERS))
        detected = profile_template(directory)
        chosen_tool = tool_parser or detected.tool_parser
        chosen_reasoning = reasoning_parser or detected.reasoning_parser
        _log.info("chat_formats", model=str(directory.path), tool_parser=chosen_tool,
                  tool_parser_from="config" if tool_parser else "template",
                  reasoning_parser=chosen_reasoning, reasoning_parser_from="config" if reasoning_parser else "template")
        return cls(directory, chosen_tool, chosen_reasoning, family_of(chosen_tool, chosen_reasoning),
                   detected.arguments_as, dict(template_kwargs or {}))

    # -- tokens ---------------------------------------------------------------------------------

    @property
    def end_of_turn_ids(self) -> frozenset[int]:
        return self.directory.end_of_turn_ids

    @property
    def vocab_size(self) -> int:
        return self.directory.vocab_size

    @property
    def end_of_turn_text(self) -> str:
        """The token a plain turn ends with when the model writes it (its eos)."""
        return end_of_turn_text(self.directory)

    def encode(self, text: str) -> list[int]:
        return self.directory.encode(text)

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        return self.directory.decode(ids, skip_special_tokens=skip_special_tokens)

    def render(self, messages: Sequence[Mapping[str, Any]], *, tools: Sequence[Mapping[str, Any]] | None = None,
               add_generation_prompt: bool) -> str:
        return self.directory.render(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                     template_kwargs=self.template_kwargs)

    # -- conversations ----------------------------------------------------------------------------

    def new_trajectory(self, messages: Sequence[Mapping[str, Any]], *,
                       tools: Sequence[Mapping[str, Any]] | None = None,
                       history_rewrite: HistoryRewrite = "keep_sampled",
                       join: TemplateJoin | None = None) -> ChatTrajectory:
        """A conversation's token-exact trajectory: its first prompt rendered and tokenized once."""
        return ChatTrajectory(self.directory, messages, tools=list(tools) if tools else None,
                              template_kwargs=self.template_kwargs, family=self.family,
                              history_rewrite=history_rewrite, join=join)

    def parse_turn(self, ids: Sequence[int], *, tools: ToolSet | Sequence[Mapping[str, Any]] | None,
                   first_call_index: int = 0, prompt_ids: Sequence[int] = ()) -> ParsedTurn:
        """Content, reasoning and tool calls of a generated turn (``prompt_ids``' tail says whether
        the prompt opened a reasoning block the turn starts in)."""
        opened = prompt_opens_reasoning(self.decode(list(prompt_ids)[-8:])) if prompt_ids else None
        return parse_assistant_turn(self.decode(ids), tool_parser=self.tool_parser,
                                    reasoning_parser=self.reasoning_parser, tools=self.toolset(tools),
                                    first_call_index=first_call_index, starts_in_reasoning=opened)

    def toolset(self, tools: ToolSet | Sequence[Mapping[str, Any]] | None) -> ToolSet:
        """``tools`` compiled (checked, validators built), once per distinct declaration."""
        if isinstance(tools, ToolSet):
            return tools
        key = json.dumps(tools or [], sort_keys=True, default=str)
        toolset = self._toolsets.get(key)
        if toolset is None:
            toolset = self._toolsets[key] = ToolSet.from_openai(tools)
        return toolset

    def assistant_message(self, parsed: ParsedTurn) -> dict[str, Any]:
        """The parsed turn as the OpenAI message this model's template renders."""
        return assistant_message(parsed, self.arguments_as)

    def write_turn(self, *, content: str, calls: Sequence[ToolCall] = (), reasoning: str | None = None,
                   prompt_opened_reasoning: bool = False) -> str:
        """A turn's whole text as this model would generate it, its end of turn included."""
        return write_assistant_turn(tool_parser=self.tool_parser, reasoning_parser=self.reasoning_parser,
                                    content=content, calls=calls, reasoning=reasoning,
                                    prompt_opened_reasoning=prompt_opened_reasoning,
                                    end_of_turn=self.end_of_turn_text)
