"""rollmesh.chat: each model's own tokenizer, chat template and tool-call format, token-exact.

Plain logic: imports neither ray nor nats, and knows no actor, bus or Serve app. ``chat_model`` is
a model as the product uses it (its directory and formats, trajectories, turns); ``model_dir``
loads a Hugging Face model directory (fast tokenizer, chat template rendering, end-of-turn ids,
valid token ids); ``tool_calls`` and ``reasoning`` parse tool calls and reasoning out of a
generated turn in the family's own format (one ``tool_format_*`` module per format, ``harmony`` for
gpt-oss); ``turn_append`` grows a conversation's tokens turn by turn, token-exact, and
``token_check`` compares them with a whole render; ``turn_writer`` writes a turn as the family's
model would (to simulate generation) and ``template_check`` runs ``rollmesh check-template``'s
conversations; ``errors`` holds the package's typed errors.
"""

from rollmesh.chat.errors import ChatError, ModelDirectoryError, TemplateRenderError
from rollmesh.chat.chat_model import ChatModel
from rollmesh.chat.errors import InvalidToolDeclarationError, UnknownParserError
from rollmesh.chat.model_dir import KNOWN_END_OF_TURN_TOKENS, ModelDirectory
from rollmesh.chat.reasoning import REASONING_PARSERS, detect_reasoning_parser, prompt_opens_reasoning
from rollmesh.chat.tool_calls import (
    TOOL_PARSERS,
    MalformedToolCall,
    ParsedTurn,
    ToolCall,
    conform_call_id,
    detect_tool_parser,
    make_call_id,
    parse_assistant_turn,
    parse_tool_calls,
)
from rollmesh.chat.tool_schemas import ToolSet
from rollmesh.chat.errors import AppendError, AppendOrderError, JoinDerivationError, TruncatedTurnError
from rollmesh.chat.token_check import MISMATCH_KINDS, TokenCheckReport, TokenDifference, check_trajectory
from rollmesh.chat.template_check import CaseResult, TemplateCheckReport, check_template
from rollmesh.chat.turn_writer import write_assistant_turn
from rollmesh.chat.turn_append import (
    HISTORY_REWRITES,
    JOIN_RULES,
    ChatTemplateTokenizer,
    ChatTrajectory,
    TemplateJoin,
    TokenSample,
)

__all__ = [
    "KNOWN_END_OF_TURN_TOKENS",
    "ChatError",
    "ChatModel",
    "ModelDirectory",
    "ModelDirectoryError",
    "TemplateRenderError",
    # tool calls and reasoning
    "REASONING_PARSERS",
    "TOOL_PARSERS",
    "InvalidToolDeclarationError",
    "MalformedToolCall",
    "ParsedTurn",
    "ToolCall",
    "ToolSet",
    "UnknownParserError",
    "conform_call_id",
    "detect_reasoning_parser",
    "detect_tool_parser",
    "make_call_id",
    "parse_assistant_turn",
    "parse_tool_calls",
    "prompt_opens_reasoning",
    # token-exact appending and its check
    "HISTORY_REWRITES",
    "JOIN_RULES",
    "MISMATCH_KINDS",
    "AppendError",
    "AppendOrderError",
    "ChatTemplateTokenizer",
    "ChatTrajectory",
    "JoinDerivationError",
    "TemplateJoin",
    "TokenCheckReport",
    "TokenDifference",
    "TokenSample",
    "TruncatedTurnError",
    "check_trajectory",
    # simulated turns and rollmesh check-template
    "CaseResult",
    "TemplateCheckReport",
    "check_template",
    "write_assistant_turn",
]
