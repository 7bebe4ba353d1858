"""The fixed conversations ``rollmesh check-template`` runs, as scripts of the model's turns and what
follows each (tool results, user turns).

A model turn says what the model means to write (content, calls, reasoning, whether it writes
arguments as a JSON string); the checker writes it in the family's own format. Which cases apply
depends on what the template can express: tools, reasoning, more than one call per turn. Data
only: knows no tokenizer, template or format.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

Need = Literal["tools", "parallel_calls", "reasoning"]

SYSTEM_PROMPT = "You are a concise weather assistant."
WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer"},
            },
            "required": ["city"],
        },
    },
}
TOOLS: tuple[Mapping[str, Any], ...] = (WEATHER_TOOL,)


@dataclass(frozen=True)
class ModelTurn:
    """One generated turn: what the model writes, before its format is applied."""

    content: str = ""
    calls: tuple[Mapping[str, Any], ...] = ()   # each call's arguments (all call get_weather)
    reasoning: str | None = None
    arguments_as_string: bool = False   # the model writes each call's arguments as a JSON string


@dataclass(frozen=True)
class ToolResults:
    """One result per call of the turn before, in call order, answering each by its id."""

    contents: tuple[str, ...]


@dataclass(frozen=True)
class UserTurn:
    content: str


Step = ModelTurn | ToolResults | UserTurn


@dataclass(frozen=True)
class CheckCase:
    name: str
    what: str
    user: str
    steps: tuple[Step, ...]
    system: bool = True
    needs: frozenset[Need] = field(default_factory=frozenset)
    # The template's reasoning switch (enable_thinking, thinking) where it has one.
    thinking: bool = False


PARIS = {"city": "Paris"}
TOKYO = {"city": "Tokyo"}
ZURICH = {"city": "Z\u00fcrich", "unit": "celsius", "days": 3}
_WEATHER_Q = "What is the weather in Paris?"
_USES_TOOLS: frozenset[Need] = frozenset({"tools"})

CASES: tuple[CheckCase, ...] = (
    CheckCase("system_prompt", "a system prompt, one answer", "Hello!", (ModelTurn("Hi! How can I help?"),)),
    CheckCase("no_system_prompt", "no system prompt, two answers", "Hello!",
              (ModelTurn("Hi! How can I help?"), UserTurn("What is 2 + 2?"), ModelTurn("The answer is 4.")),
              system=False),
    CheckCase("one_tool_call", "one call, its result, an answer", _WEATHER_Q,
              (ModelTurn(calls=(PARIS,)), ToolResults(("sunny, 24 C",)), ModelTurn("It is sunny in Paris.")),
              needs=_USES_TOOLS),
    CheckCase("parallel_tool_calls", "two calls in one turn, two results", "Weather in Paris and Tokyo?",
              (ModelTurn(calls=(PARIS, TOKYO)), ToolResults(("sunny, 24 C", "rain, 18 C")),
               ModelTurn("Paris is sunny; Tokyo has rain.")),
              needs=frozenset({"tools", "parallel_calls"})),
    CheckCase("tool_error", "a call that fails, a corrected call", "What is the weather in Atlantis?",
              (ModelTurn(calls=({"city": "Atlantis"},)), ToolResults(('error: no city named "Atlantis"',)),
               ModelTurn(calls=({"city": "Athens"},)), ToolResults(("sunny, 30 C",)),
               ModelTurn("Atlantis has no weather station; Athens is sunny.")),
              needs=_USES_TOOLS),
    CheckCase("three_turns", "a call, an answer, a user follow-up, an answer", _WEATHER_Q,
              (ModelTurn(calls=(PARIS,)), ToolResults(("sunny, 24 C",)), ModelTurn("It is sunny in Paris."),
               UserTurn("Should I take an umbrella?"), ModelTurn("No, you will not need one.")),
              needs=_USES_TOOLS),
    CheckCase("arguments_object", "arguments written as a JSON object", "Weather in Zurich for 3 days?",
              (ModelTurn(calls=(ZURICH,)), ToolResults(("cold, 4 C",)), ModelTurn("Cold, around 4 C.")),
              needs=_USES_TOOLS),
    CheckCase("arguments_string", "arguments written as a JSON string", "Weather in Zurich for 3 days?",
              (ModelTurn(calls=(ZURICH,), arguments_as_string=True), ToolResults(("cold, 4 C",)),
               ModelTurn("Cold, around 4 C.")),
              needs=_USES_TOOLS),
    CheckCase("content_and_tool_call", "text before a call in the same turn", _WEATHER_Q,
              (ModelTurn("Let me check.", calls=(PARIS,)), ToolResults(("sunny, 24 C",)),
               ModelTurn("It is sunny in Paris.")),
              needs=_USES_TOOLS),
    CheckCase("sequential_tool_calls", "two calls, one per turn", "Weather in Paris, then Tokyo?",
              (ModelTurn(calls=(PARIS,)), ToolResults(("sunny, 24 C",)), ModelTurn(calls=(TOKYO,)),
               ToolResults(("rain, 18 C",)), ModelTurn("Paris is sunny; Tokyo has rain.")),
              needs=_USES_TOOLS),
    CheckCase("reasoning_on", "reasoning before a call and answers, then a user follow-up", _WEATHER_Q,
              (ModelTurn(calls=(PARIS,), reasoning="I need the weather tool."), ToolResults(("sunny, 24 C",)),
               ModelTurn("It is sunny in Paris.", reasoning="The tool says sunny."),
               UserTurn("Should I take an umbrella?"),
               ModelTurn("No, you will not need one.", reasoning="Sunny means no rain.")),
              needs=frozenset({"tools", "reasoning"}), thinking=True),
    CheckCase("reasoning_off", "the same conversation with reasoning switched off", _WEATHER_Q,
              (ModelTurn(calls=(PARIS,)), ToolResults(("sunny, 24 C",)), ModelTurn("It is sunny in Paris."),
               UserTurn("Should I take an umbrella?"), ModelTurn("No, you will not need one.")),
              needs=frozenset({"tools", "reasoning"}), thinking=False),
)
