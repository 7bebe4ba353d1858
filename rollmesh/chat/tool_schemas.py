"""The tools a conversation declares (OpenAI function schemas) and checks of call arguments.

``ToolSet.from_openai(tools)`` takes ``[{"type": "function", "function": {"name", "description",
"parameters"}}]`` as passed to the chat template, refuses a declaration that is not one (typed
error), and checks arguments against each tool's JSON schema with ``jsonschema`` (full JSON Schema,
the draft the schema names, 2020-12 by default). Knows JSON Schema, not formats or tokenizers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jsonschema
from jsonschema.protocols import Validator

from rollmesh.chat.errors import InvalidToolDeclarationError


@dataclass(frozen=True)
class ToolSet:
    """Declared tools by name, each with a compiled validator for its parameters."""

    validators: Mapping[str, Validator]

    @classmethod
    def from_openai(cls, tools: Sequence[Mapping[str, Any]] | None) -> ToolSet:
        validators: dict[str, Validator] = {}
        for index, tool in enumerate(tools or ()):
            name, parameters = _declaration(index, tool)
            if name in validators:
                raise InvalidToolDeclarationError(tool_index=index, name=name, reason="declared twice")
            default = jsonschema.Draft202012Validator
            validator_class = jsonschema.validators.validator_for(parameters, default=default)
            try:
                validator_class.check_schema(parameters)
            except jsonschema.SchemaError as exc:
                reason = f"parameters are not a JSON Schema: {exc.message}"
                raise InvalidToolDeclarationError(tool_index=index, name=name, reason=reason) from exc
            validators[name] = validator_class(parameters)
        return cls(validators=validators)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.validators)

    def argument_problem(self, name: str, arguments: Mapping[str, Any]) -> str | None:
        """None when ``arguments`` match the tool's schema, else one line saying what does not."""
        error = jsonschema.exceptions.best_match(self.validators[name].iter_errors(arguments))
        if error is None:
            return None
        where = "/".join(str(part) for part in error.absolute_path)
        return f"{where}: {error.message}" if where else error.message


def _declaration(index: int, tool: Mapping[str, Any]) -> tuple[str, Mapping[str, Any]]:
    is_function = isinstance(tool, Mapping) and tool.get("type") == "function"
    if not is_function or not isinstance(tool.get("function"), Mapping):
        reason = 'expected {"type": "function", "function": {...}}'
        raise InvalidToolDeclarationError(tool_index=index, name=None, reason=reason)
    function = tool["function"]
    name = function.get("name")
    if not isinstance(name, str) or not name:
        reason = "function.name must be a non-empty string"
        raise InvalidToolDeclarationError(tool_index=index, name=None, reason=reason)
    # A function without "parameters" takes none: the OpenAI API's reading.
    parameters = function.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(parameters, Mapping):
        reason = "function.parameters must be a JSON object"
        raise InvalidToolDeclarationError(tool_index=index, name=name, reason=reason)
    return name, parameters
