"""OpenAI chat completions in the served model's own chat template and tool-call format, and the
Server-Sent Events of streamed answers.

Knows the HTTP shapes, ``rollmesh.chat`` and ``generation_requests``' checks; not Ray, not
FastAPI. A request's messages (``chat_messages`` puts them in the form the template takes) are
rendered once by the model's own template, with the request's ``tools`` and its
``chat_template_kwargs`` over the model's configured ones, and the rendered text is encoded once.
The answer is read out of the generated ids with the model's tool and reasoning parsers: the text
without the call markup as ``content``, OpenAI ``tool_calls`` (finish reason ``"tool_calls"``) when
the request declared tools, ``reasoning_content`` for a model with a reasoning parser. A call that
does not parse or match its tool's schema stays in ``content`` as the model wrote it, so nothing
generated is lost. Generation ends at the model's end-of-turn ids (the engine's stop); a stop
string cuts ``content`` before it, as OpenAI does.

``tool_choice``: "auto" (the default) or "none" (the tools are left out of the prompt and nothing is
read as a call); "required" and a named function, and ``response_format`` (``json_schema``,
``json_object``), are enforced by guided decoding: ``tool_choice`` writes the grammar, the engine
masks by it, and the choice's ``constrained`` says which tokens the grammar restricted.

``logprobs`` and ``top_logprobs``: ``openai_logprobs``. Streaming (``"stream": true``) sends the
tokens as the decode loop produces them: ``stream_events``.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from rollmesh.chat import ChatModel, ParsedTurn, TemplateRenderError
from rollmesh.engine.protocols import GenerationResult, GrammarSpec
from rollmesh.messages.base import SamplingParams
from rollmesh.serve_apps.chat_messages import calls_in, template_messages, template_tools
from rollmesh.serve_apps.errors import InvalidApiRequestError
from rollmesh.serve_apps.tool_choice import response_format_grammar, tool_choice_grammar
from rollmesh.serve_apps.generate_extensions import encode_routed_experts
from rollmesh.serve_apps.generation_requests import (
    ServedModel,
    check_max_tokens,
    check_model,
    check_prompt_length,
    cut_at_stop,
    openai_finish_reason,
    openai_sampling_params,
    openai_usage,
)
from rollmesh.serve_apps.http_shapes import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    ResponseFunction,
    ResponseToolCall,
    RoutedExpertsDtype,
)
from rollmesh.serve_apps.openai_logprobs import chat_logprobs, check_chat_logprobs

# apply_chat_template's own arguments, which a request's chat_template_kwargs may not set.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {"conversation", "messages", "tools", "add_generation_prompt", "tokenize", "chat_template"})


@dataclass(frozen=True)
class ChatPrompt:
    """A chat request made ready for the engine, and what reading its answer needs."""

    input_ids: list[int]
    sampling: SamplingParams
    # The served model with this request's template kwargs, and its tool parser only when the
    # request declared tools (calls are read only then).
    chat: ChatModel
    tools: list[dict[str, Any]] | None
    first_call_index: int  # calls already in the conversation: new calls' ids come after theirs
    with_logprobs: bool = False  # the request's ``logprobs``
    # What tool_choice ("required", a named function) or response_format forces (tool_choice.py).
    grammar: GrammarSpec | None = None
    top_logprobs: int = 0  # alternatives per token the engine is asked for (with logprobs)


def chat_inputs(request: ChatCompletionRequest, served: ServedModel) -> ChatPrompt:
    """The prompt rendered by the model's template and encoded once, and sampling params; raises
    InvalidApiRequestError naming the parameter (a template's refusal: ``param="messages"``)."""
    settings = chat_settings(request, served)
    input_ids = settings.chat.encode(render_messages(settings.chat, request.messages, settings.tools,
                                                     served=served, add_generation_prompt=True))
    check_prompt_length(len(input_ids), served, param="messages")
    return dataclasses.replace(settings, input_ids=input_ids)


def chat_settings(request: ChatCompletionRequest, served: ServedModel) -> ChatPrompt:
    """Everything of a chat request but its prompt (``input_ids`` left empty), checked: what a
    session's later turn (``chat_sessions``), whose prompt is its trajectory, needs too."""
    check_model(request.model, served)
    if not request.messages:
        raise InvalidApiRequestError("messages is empty", code="invalid_value", param="messages")
    if request.n != 1:
        raise InvalidApiRequestError(
            f"n must be 1 (got {request.n}): one choice per request is supported",
            code="unsupported_value", param="n",
        )
    param = "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
    max_tokens = request.max_completion_tokens or request.max_tokens
    if max_tokens is None:  # OpenAI's default is "what fits"; the context decides
        max_tokens = served.max_seq_len
    check_max_tokens(max_tokens, served, param=param)
    check_chat_logprobs(request)
    tools = None if _tool_choice(request) == "none" else template_tools(request.tools)
    if tools and served.chat.tool_parser is None:
        raise InvalidApiRequestError(
            f"the model {served.name!r} has no tool-call format (its chat template shows none and "
            "model.tool_parser is unset)", code="unsupported_value", param="tools")
    chat = request_chat(served.chat, request.chat_template_kwargs, with_tools=bool(tools))
    grammar = _request_grammar(request, tools, chat, first_call_index=calls_in(request.messages))
    sampling = openai_sampling_params(
        temperature=request.temperature, top_p=request.top_p, max_new_tokens=max_tokens,
        stop=request.stop, names={"max_new_tokens": param},
    )
    return ChatPrompt([], sampling, chat, tools, calls_in(request.messages), grammar=grammar,
                      with_logprobs=request.logprobs,
                      top_logprobs=(request.top_logprobs or 0) if request.logprobs else 0)


def _request_grammar(request: ChatCompletionRequest, tools: list[dict[str, Any]] | None,
                     chat: ChatModel, *, first_call_index: int) -> GrammarSpec | None:
    by_tools = tool_choice_grammar(request.tool_choice, tools, chat, first_call_index=first_call_index,
                                   parallel=request.parallel_tool_calls is not False)
    by_format = response_format_grammar(request.response_format, chat)
    if by_tools is not None and by_format is not None:
        raise InvalidApiRequestError(
            "tool_choice forces a tool call and response_format a JSON answer: ask for one of them",
            code="invalid_value", param="response_format")
    return by_tools or by_format


def _tool_choice(request: ChatCompletionRequest) -> str:
    choice = request.tool_choice
    if choice is None or choice == "auto" or choice == "none":
        return choice or "auto"
    if choice == "required" or isinstance(choice, dict):
        return "forced"  # checked, and made a grammar, by tool_choice_grammar
    raise InvalidApiRequestError(
        f"tool_choice must be \"auto\", \"none\", \"required\" or a named function, not {choice!r}",
        code="invalid_value", param="tool_choice")


def render_messages(chat: ChatModel, messages: list[ChatMessage], tools: list[dict] | None, *,
                    served: ServedModel, add_generation_prompt: bool) -> str:
    """The request's messages rendered by the model's template (``chat``: ``request_chat``'s); its
    refusal is a 400 on ``messages``."""
    # The model's own call-id style (the served model's parser's, which ``chat`` lacks without
    # tools), also for a history with calls and no tools declared now.
    rendered = template_messages(messages, served.chat)
    try:
        return chat.render(rendered, tools=tools, add_generation_prompt=add_generation_prompt)
    except TemplateRenderError as exc:
        said = exc.template_message or exc.reason
        raise InvalidApiRequestError(f"the model's chat template refused the messages: {said}",
                                     code="invalid_messages", param="messages") from exc


def request_chat(chat: ChatModel, kwargs: dict[str, Any] | None, *, with_tools: bool) -> ChatModel:
    """The served model with a request's template kwargs over its own, reading calls only when the
    request declared tools."""
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(kwargs or ()))
    if reserved:
        raise InvalidApiRequestError(
            f"chat_template_kwargs may not set {', '.join(reserved)}: they are the request's own "
            "fields", code="invalid_value", param="chat_template_kwargs")
    return dataclasses.replace(chat, template_kwargs={**chat.template_kwargs, **(kwargs or {})},
                               tool_parser=chat.tool_parser if with_tools else None)


def parse_answer(result: GenerationResult, prompt: ChatPrompt) -> ParsedTurn:
    """The generated turn read by the model's parsers; content cut before a stop string that
    ended it, and a malformed call left in content as written."""
    parsed = prompt.chat.parse_turn(result.token_ids, tools=prompt.tools,
                                    first_call_index=prompt.first_call_index,
                                    prompt_ids=prompt.input_ids)
    content = "\n".join(part for part in (parsed.content, *(m.raw for m in parsed.malformed)) if part)
    if result.finish_reason == "stop":
        content = cut_at_stop(content, prompt.sampling)
    return dataclasses.replace(parsed, content=content, malformed=[])


def chat_response(
    result: GenerationResult,
    prompt: ChatPrompt,
    *,
    request_id: str,
    created: int,
    served: ServedModel,
    routed_experts_dtype: RoutedExpertsDtype = "compact",
) -> ChatCompletionResponse:
    parsed = parse_answer(result, prompt)
    calls = [response_call(call) for call in parsed.tool_calls] or None
    return ChatCompletionResponse(
        id=request_id,
        created=created,
        model=served.name,
        choices=[
            ChatChoice(
                index=0,
                # OpenAI's content is null beside calls when the model wrote no text.
                message=AssistantMessage(content=parsed.content or (None if calls else ""),
                                         tool_calls=calls, reasoning_content=parsed.reasoning),
                finish_reason="tool_calls" if calls else openai_finish_reason(result),
                logprobs=chat_logprobs(result, prompt.chat) if prompt.with_logprobs else None,
                weight_versions=list(result.versions),
                constrained=list(result.constrained) if prompt.grammar is not None else None,
                rollmesh=encode_routed_experts(result, routed_experts_dtype),
            )
        ],
        usage=openai_usage(result),
    )


def response_call(call: Any) -> ResponseToolCall:
    """A parsed call as OpenAI returns it: arguments as JSON text."""
    return ResponseToolCall(id=call.id, function=ResponseFunction(
        name=call.name, arguments=json.dumps(call.arguments, ensure_ascii=False)))
