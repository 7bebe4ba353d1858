"""vLLM's ``POST /tokenize`` and ``POST /detokenize`` in the served model's own tokenizer and chat
template, so a client can count or build the exact ids the chat and completion routes send.

Knows the HTTP shapes, ``chat_requests``' rendering and the served model's tokenizer; not Ray, not
FastAPI. The shapes are vLLM's (vllm/entrypoints/serve/tokenize/protocol.py:
TokenizeCompletionRequest, TokenizeChatRequest, TokenizeResponse, DetokenizeRequest,
DetokenizeResponse), its two tokenize requests taken as one body with exactly one of ``prompt`` and
``messages``:

- ``{"prompt": str, "add_special_tokens": bool}``: the text encoded as it stands, with the
  tokenizer's special tokens (a BOS) added unless ``add_special_tokens`` is false (vLLM's default
  is true). ``/v1/completions`` encodes its prompt without them.
- ``{"messages": [...], "add_generation_prompt": bool, "tools": [...], "chat_template_kwargs":
  {...}}``: the messages rendered by the model's chat template as ``/v1/chat/completions`` renders
  them (the same checks and call-id rewrites), then encoded, with no special tokens added unless
  ``add_special_tokens`` is true (vLLM's default is false). With ``add_generation_prompt`` true
  (the default) the ids are exactly the chat route's prompt for the same messages and tools.

The answer is ``{"tokens": [...], "count": N, "max_model_len": N}``; ``/detokenize`` answers
``{"prompt": str}``, the ids decoded with special tokens kept (as vLLM's). vLLM's
``continue_final_message``, ``return_token_strs`` and ``chat_template`` are not offered: a field
we do not know is ignored, as on every route. Bad input is an InvalidApiRequestError (400).
"""

from __future__ import annotations

from rollmesh.serve_apps.chat_messages import template_tools
from rollmesh.serve_apps.chat_requests import render_messages, request_chat
from rollmesh.serve_apps.errors import InvalidApiRequestError
from rollmesh.serve_apps.generation_requests import ServedModel, check_model
from rollmesh.serve_apps.http_shapes import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)


def tokenize(request: TokenizeRequest, served: ServedModel) -> TokenizeResponse:
    """The ids of the request's prompt or rendered messages; raises InvalidApiRequestError."""
    check_model(request.model, served)
    if (request.prompt is None) == (request.messages is None):
        raise InvalidApiRequestError(
            "give exactly one of prompt (text) and messages (a chat)",
            code="invalid_value", param="prompt" if request.prompt is not None else "messages")
    if request.prompt is not None:
        text = request.prompt
        add_special_tokens = request.add_special_tokens is not False
    else:
        if not request.messages:
            raise InvalidApiRequestError("messages is empty", code="invalid_value",
                                         param="messages")
        tools = template_tools(request.tools)
        chat = request_chat(served.chat, request.chat_template_kwargs, with_tools=bool(tools))
        text = render_messages(chat, request.messages, tools, served=served,
                               add_generation_prompt=request.add_generation_prompt)
        add_special_tokens = request.add_special_tokens is True
    tokenizer = served.chat.directory.tokenizer
    ids = list(tokenizer.encode(text, add_special_tokens=add_special_tokens))
    return TokenizeResponse(count=len(ids), max_model_len=served.max_seq_len, tokens=ids)


def detokenize(request: DetokenizeRequest, served: ServedModel) -> DetokenizeResponse:
    """The text of the request's ids, special tokens kept; an id the tokenizer does not have
    (padded embedding rows included) is a 400 naming its position."""
    check_model(request.model, served)
    limit = served.chat.vocab_size
    for position, token_id in enumerate(request.tokens):
        if not 0 <= token_id < limit:
            raise InvalidApiRequestError(
                f"tokens[{position}] = {token_id} is not a token of the model's tokenizer "
                f"[0, {limit})", code="invalid_token_id", param="tokens")
    return DetokenizeResponse(prompt=served.chat.decode(request.tokens))
