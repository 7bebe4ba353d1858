"""The grammars behind ``tool_choice`` "required" / a named function and ``response_format``: what a
chat request may force the engine to generate, as xgrammar structural tags (``GrammarSpec``).

Knows the HTTP shapes, the tool-call formats of ``rollmesh.chat`` (their marker strings) and
xgrammar's structural-tag JSON format (written as plain dicts: importing xgrammar costs a process
over a second, and only the engine that compiles the grammar needs it); not the engine, not Ray or
FastAPI.

A forced call is written in the model's OWN tool-call format, the one its tool parser reads back
(``rollmesh.chat.tool_format_*``, ``harmony``), with the arguments constrained by the tool's JSON
schema:

- ``hermes``: ``<tool_call>\\n{"name": N, "arguments": {...}}\\n</tool_call>``, calls joined by "\\n";
- ``llama3_json``: ``{"name": N, "parameters": {...}}``, calls joined by "; ";
- ``mistral``: ``[TOOL_CALLS][{"name": N, "arguments": {...}, "id": "<9 alphanumerics>"}, ...]``;
- ``deepseek_v3``: the V3.1 form ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>N<｜tool▁sep｜>{...}
  <｜tool▁call▁end｜>...<｜tool▁calls▁end｜>``;
- ``kimi_k2``: ``<|tool_calls_section_begin|><|tool_call_begin|>functions.N:IDX
  <|tool_call_argument_begin|>{...}<|tool_call_end|>...<|tool_calls_section_end|>``;
- ``gpt_oss`` (harmony): ``<|channel|>commentary to=functions.N <|constrain|>json<|message|>{...}``,
  one call (harmony ends the turn at a call's ``<|call|>``, which is the model's end-of-turn id).

"required" is one or more calls to any declared tool (exactly one with ``parallel_tool_calls: false``,
and for harmony); a named function is exactly one call to it. The grammar applies from the first generated token, so a reasoning model does not
think first (as in vLLM). Where a marker is one token of the model's vocabulary (``<tool_call>``,
DeepSeek's and Kimi's markers), the grammar asks for that token itself, never its characters spelled
out, so the ids are those the chat template renders. After the grammar only the token the template
closes an assistant turn with is allowed (harmony: ``<|call|>``; the engine's side:
``rollmesh.engine.guided_decoding``), so the turn ends as the template would render it.

JSON in a grammar is compact-ish (at most one whitespace character in a row) and its strings hold no
raw control characters, which JSON forbids and our parsers refuse, nor the model's added tokens
(xgrammar would let ``<|im_start|>`` into a string as text); xgrammar drops ``minLength`` and
``maxLength`` when it filters strings, so a schema with those keeps them and the filter goes.
Free strings end when the model closes them: an untrained model may write one until ``max_tokens``
(finish reason "length", no call), as with any grammar engine; ``maxLength`` or a ``pattern`` bounds it.

``response_format``: ``{"type": "json_schema", "json_schema": {"name", "schema"}}`` is one JSON value
matching the schema, ``{"type": "json_object"}`` one JSON object, ``{"type": "text"}`` nothing.
``/generate`` takes SGLang's ``json_schema``, ``ebnf`` or ``structural_tag`` sampling param as is.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

import jsonschema

from rollmesh.chat import ChatModel
from rollmesh.chat import harmony
from rollmesh.chat import tool_format_deepseek as deepseek
from rollmesh.chat import tool_format_kimi as kimi
from rollmesh.engine.protocols import GrammarSpec
from rollmesh.serve_apps.errors import InvalidApiRequestError
from rollmesh.serve_apps.http_shapes import GenerateSamplingParams

# Families whose call format we can force; any other tool parser is a 400 for "required"/named.
FORCEABLE_FORMATS = ("hermes", "llama3_json", "mistral", "deepseek_v3", "kimi_k2", "gpt_oss")
_CONTROL_CHARACTERS = [chr(code) for code in range(0x20)]


def tool_choice_grammar(choice: str | dict[str, Any] | None, tools: Sequence[Mapping[str, Any]] | None,
                        chat: ChatModel, *, first_call_index: int = 0,
                        parallel: bool = True) -> GrammarSpec | None:
    """The grammar ``tool_choice`` forces (None for "auto", "none" or no choice); ``tools`` are the
    request's, checked (``chat_messages.template_tools``). Raises InvalidApiRequestError
    (``param="tool_choice"``) for a malformed choice, an unknown tool or a format we cannot force."""
    if choice is None or choice in ("auto", "none"):
        return None
    if choice == "required":
        forced = list(tools or [])
        if not forced:
            raise _choice_error("tool_choice \"required\" needs at least one tool in tools")
        return _calls_grammar(forced, chat, many=parallel, first_call_index=first_call_index)
    if isinstance(choice, dict):
        name = _named_function(choice)
        forced = [tool for tool in tools or [] if tool["function"]["name"] == name]
        if not forced:
            declared = ", ".join(repr(t["function"]["name"]) for t in tools or []) or "none"
            raise _choice_error(f"tool_choice names the function {name!r}, which is not among the "
                                f"request's tools (declared: {declared})", code="unknown_tool")
        return _calls_grammar(forced, chat, many=False, first_call_index=first_call_index)
    raise _choice_error(f"tool_choice must be \"auto\", \"none\", \"required\" or a named function, "
                        f"not {choice!r}")


def response_format_grammar(response_format: Mapping[str, Any] | None,
                            chat: ChatModel) -> GrammarSpec | None:
    """The grammar ``response_format`` asks for (None for "text" or none); raises
    InvalidApiRequestError (``param="response_format"``) for a malformed one or an invalid schema."""
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return _grammar(_turn_end(chat), _json({"type": "object"}, chat))
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, Mapping) else None
        if not isinstance(schema, Mapping):
            raise InvalidApiRequestError(
                "response_format json_schema needs {\"json_schema\": {\"name\": ..., \"schema\": {...}}}",
                code="invalid_value", param="response_format.json_schema")
        try:
            jsonschema.validators.validator_for(schema).check_schema(schema)
        except jsonschema.SchemaError as exc:
            raise InvalidApiRequestError(f"invalid JSON schema in response_format: {exc.message}",
                                         code="invalid_value",
                                         param="response_format.json_schema.schema") from exc
        return _grammar(_turn_end(chat), _json(dict(schema), chat))
    raise InvalidApiRequestError(
        f"response_format type must be \"text\", \"json_object\" or \"json_schema\", not {kind!r}",
        code="invalid_value", param="response_format")


def generate_grammar(params: GenerateSamplingParams) -> GrammarSpec | None:
    """/generate's grammar: SGLang's ``json_schema``, ``ebnf`` or ``structural_tag`` sampling param
    as given (the engine compiles it: one it cannot is a 400 on ``sampling_params``)."""
    given = [(kind, getattr(params, kind)) for kind in ("json_schema", "ebnf", "structural_tag")
             if getattr(params, kind) is not None]
    if len(given) > 1:
        raise InvalidApiRequestError(
            f"at most one grammar per request, got {', '.join(kind for kind, _ in given)}",
            code="invalid_value", param=f"sampling_params.{given[1][0]}")
    return GrammarSpec(*given[0]) if given else None


# -- one family's calls ------------------------------------------------------------------------


def _calls_grammar(tools: list[Mapping[str, Any]], chat: ChatModel, *, many: bool,
                   first_call_index: int) -> GrammarSpec:
    family = chat.tool_parser
    if family not in FORCEABLE_FORMATS:
        raise _choice_error(f"the model's tool-call format {family!r} cannot be forced by a grammar "
                            f"(forceable: {', '.join(FORCEABLE_FORMATS)}); use tool_choice \"auto\"",
                            code="unsupported_value")
    text = _Literals(chat)
    end_ids = _turn_end(chat, "<|call|>" if family == "gpt_oss" else None)
    pieces = [(tool["function"]["name"], _json(tool["function"]["parameters"], chat)) for tool in tools]
    if family == "hermes":
        calls = [text('<tool_call>\n{"name": ' + json.dumps(name) + ', "arguments": ', args, '}\n</tool_call>')
                 for name, args in pieces]
        return _grammar(end_ids, _repeated(calls, "\n" if many else None))
    if family == "llama3_json":
        calls = [text('{"name": ' + json.dumps(name) + ', "parameters": ', args, "}") for name, args in pieces]
        return _grammar(end_ids, _repeated(calls, "; " if many else None))
    if family == "mistral":
        call_id = _regex("[A-Za-z0-9]{9}")
        calls = [text('{"name": ' + json.dumps(name) + ', "arguments": ', args, ', "id": "', call_id, '"}')
                 for name, args in pieces]
        return _grammar(end_ids, text("[TOOL_CALLS][", _repeated(calls, ", " if many else None), "]"))
    if family == "deepseek_v3":
        calls = [text(deepseek.CALL_BEGIN + name + deepseek.SEP, args, deepseek.CALL_END)
                 for name, args in pieces]
        return _grammar(end_ids, text(deepseek.CALLS_BEGIN, _repeated(calls, "" if many else None),
                             deepseek.CALLS_END))
    if family == "kimi_k2":
        # A named call's id is exact (the conversation's next index); several calls number themselves.
        index = str(first_call_index) if not many else _regex("[0-9]{1,3}")
        calls = [text(kimi.CALL_BEGIN + f"functions.{name}:", index, kimi.ARGUMENT_BEGIN, args, kimi.CALL_END)
                 for name, args in pieces]
        return _grammar(end_ids, text(kimi.SECTION_BEGIN, _repeated(calls, "" if many else None),
                                      kimi.SECTION_END))
    # gpt_oss: one call per turn; its end marker <|call|> is an end-of-turn id, after the grammar.
    calls = [text(f"{harmony.CHANNEL}commentary to={harmony.FUNCTIONS_PREFIX}{name} <|constrain|>json"
                  f"{harmony.MESSAGE}", args) for name, args in pieces]
    return _grammar(end_ids, _repeated(calls, None))


def _repeated(calls: list[Any], separator: str | None) -> Any:
    """One of ``calls``; with a separator (maybe ""), one or more of them joined by it."""
    one = calls[0] if len(calls) == 1 else _or(calls)
    if separator is None:
        return one
    again = _sequence([_const(separator), one]) if separator else one
    return _sequence([one, _star(again)])


class _Literals:
    """Builds a sequence from strings and formats; a string is cut at the model's added tokens
    (``<tool_call>``, DeepSeek's markers...), each of which must then be generated as that one
    token, as the chat template's rendering has it."""

    def __init__(self, chat: ChatModel) -> None:
        added = chat.directory.tokenizer.get_added_vocab()
        self._added = added
        names = sorted(added, key=len, reverse=True)
        self._pattern = re.compile("(" + "|".join(map(re.escape, names)) + ")") if names else None

    def __call__(self, *parts: Any) -> Any:
        elements: list[Any] = []
        for part in parts:
            if not isinstance(part, str):
                elements.append(part)
                continue
            pieces = self._pattern.split(part) if self._pattern else [part]
            for piece in pieces:
                if piece in self._added:
                    elements.append(_token(self._added[piece]))
                elif piece:
                    elements.append(_const(piece))
        if not elements:
            return _const("")
        return elements[0] if len(elements) == 1 else _sequence(elements)


def _json(schema: dict[str, Any], chat: ChatModel) -> dict[str, Any]:
    """Arguments (or an answer) by ``schema``; strings hold no raw control characters and none of
    the model's added tokens (``<|im_start|>``, ``</tool_call>``...), unless that would drop the
    schema's string length bounds (see the module docstring)."""
    excludes = [] if _bounds_string_length(schema) else [
        *_CONTROL_CHARACTERS, *chat.directory.tokenizer.get_added_vocab()]
    return {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": 1, "excludes": excludes}


def _const(value: str) -> dict[str, Any]:
    return {"type": "const_string", "value": value}


def _token(token: int) -> dict[str, Any]:
    return {"type": "token", "token": token}


def _regex(pattern: str) -> dict[str, Any]:
    return {"type": "regex", "pattern": pattern}


def _sequence(elements: list[Any]) -> dict[str, Any]:
    return {"type": "sequence", "elements": elements}


def _or(elements: list[Any]) -> dict[str, Any]:
    return {"type": "or", "elements": elements}


def _star(content: Any) -> dict[str, Any]:
    return {"type": "star", "content": content}


def _bounds_string_length(schema: Any) -> bool:
    if isinstance(schema, Mapping):
        return "minLength" in schema or "maxLength" in schema or any(
            _bounds_string_length(value) for value in schema.values())
    if isinstance(schema, list):
        return any(_bounds_string_length(value) for value in schema)
    return False


def _turn_end(chat: ChatModel, marker: str | None = None) -> tuple[int, ...]:
    """The id the template closes an assistant turn with (or ``marker``'s, harmony's <|call|>)."""
    return tuple(chat.encode(marker or chat.end_of_turn_text))


def _grammar(end_ids: tuple[int, ...], fmt: Any) -> GrammarSpec:
    return GrammarSpec("structural_tag", json.dumps({"type": "structural_tag", "format": fmt}), end_ids)


def _named_function(choice: dict[str, Any]) -> str:
    function = choice.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    if choice.get("type") != "function" or not isinstance(name, str) or not name:
        raise _choice_error("a named tool_choice is {\"type\": \"function\", \"function\": {\"name\": ...}}, "
                            f"not {choice!r}")
    return name


def _choice_error(message: str, *, code: str = "invalid_value") -> InvalidApiRequestError:
    return InvalidApiRequestError(message, code=code, param="tool_choice")
