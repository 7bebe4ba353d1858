"""vLLM's /tokenize and /detokenize as plain logic, in the served model's own tokenizer and chat
template: a chat tokenized is exactly the chat route's prompt, ``add_generation_prompt`` and
``add_special_tokens`` mean what they mean in vLLM (a Llama 3 tokenizer shows the BOS), ids decode
back with special tokens kept, and bad input is an OpenAI-shaped 400. No Ray, no HTTP (the routes:
test_serve_app.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from rollmesh.chat import ChatModel
from rollmesh.serve_apps import InvalidApiRequestError, ServedModel
from rollmesh.serve_apps.chat_requests import chat_inputs
from rollmesh.serve_apps.errors import ModelNotFoundError
from rollmesh.serve_apps.http_shapes import (
    ChatCompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from rollmesh.serve_apps.tokenize_requests import detokenize, tokenize
from support.serve_models import CALC, QUESTION, demo_served_model

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


@pytest.fixture(scope="module")
def served(demo_model_dir: Path) -> ServedModel:
    return demo_served_model(demo_model_dir)


@pytest.fixture(scope="module")
def llama(chat_model_dirs: dict[str, Path]) -> ServedModel:
    chat = ChatModel.load(chat_model_dirs["llama3"], template_kwargs={"date_string": "26 Jul 2024"})
    return ServedModel(name="llama", max_seq_len=4096, vocab_size=chat.vocab_size, chat=chat)


def tokenize_body(**fields: object) -> TokenizeRequest:
    return TokenizeRequest.model_validate(fields)


def test_a_chat_tokenized_is_the_chat_routes_prompt_and_its_count(served: ServedModel) -> None:
    answer = tokenize(tokenize_body(messages=[QUESTION], tools=[CALC]), served)
    prompt = chat_inputs(ChatCompletionRequest.model_validate(
        {"messages": [QUESTION], "tools": [CALC]}), served)
    assert answer.tokens == prompt.input_ids
    assert answer.count == len(answer.tokens)
    assert answer.max_model_len == 256
    assert "Tools: calc(formula)" in served.chat.decode(answer.tokens)


def test_without_the_generation_prompt_the_chat_ends_at_its_last_message(
    served: ServedModel,
) -> None:
    with_prompt = tokenize(tokenize_body(messages=[QUESTION]), served).tokens
    without = tokenize(tokenize_body(messages=[QUESTION], add_generation_prompt=False), served)
    assert served.chat.decode(without.tokens).endswith("molar mass of H2O?<|im_end|>\n")
    assert with_prompt[:len(without.tokens)] == without.tokens
    assert served.chat.decode(with_prompt[len(without.tokens):]) == "<|im_start|>assistant\n"


def test_a_prompt_gets_the_tokenizers_bos_unless_add_special_tokens_is_false(
    llama: ServedModel,
) -> None:
    bos = llama.chat.directory.tokenizer.convert_tokens_to_ids("<|begin_of_text|>")
    plain = llama.chat.encode("hello")
    assert tokenize(tokenize_body(prompt="hello"), llama).tokens == [bos, *plain]
    assert tokenize(tokenize_body(prompt="hello", add_special_tokens=False), llama).tokens == plain


def test_messages_get_no_special_tokens_beyond_the_templates_unless_asked(
    llama: ServedModel,
) -> None:
    bos = llama.chat.directory.tokenizer.convert_tokens_to_ids("<|begin_of_text|>")
    rendered = llama.chat.render([QUESTION], add_generation_prompt=True)
    assert rendered.startswith("<|begin_of_text|>")  # the template writes its own
    ids = tokenize(tokenize_body(messages=[QUESTION]), llama).tokens
    assert ids == llama.chat.encode(rendered) and ids.count(bos) == 1
    doubled = tokenize(tokenize_body(messages=[QUESTION], add_special_tokens=True), llama).tokens
    assert doubled == [bos, *ids]


def test_detokenize_gives_the_text_back_with_special_tokens(served: ServedModel) -> None:
    ids = tokenize(tokenize_body(messages=[QUESTION]), served).tokens
    text = detokenize(DetokenizeRequest(tokens=ids), served).prompt
    assert text == served.chat.render([QUESTION], add_generation_prompt=True)
    assert detokenize(DetokenizeRequest(tokens=[]), served).prompt == ""


@pytest.mark.parametrize(("fields", "param", "code"), [
    ({"prompt": "hi", "messages": [QUESTION]}, "prompt", "invalid_value"),
    ({}, "messages", "invalid_value"),
    ({"messages": []}, "messages", "invalid_value"),
    ({"messages": [{"role": "user", "content": None}]}, "messages.0.content", "invalid_value"),
    ({"messages": [QUESTION], "tools": [{"type": "function", "function": {}}]}, "tools.0",
     "invalid_value"),
    ({"messages": [QUESTION], "chat_template_kwargs": {"tools": []}}, "chat_template_kwargs",
     "invalid_value"),
])
def test_bad_tokenize_requests_name_their_parameter(
    served: ServedModel, fields: dict, param: str, code: str,
) -> None:
    with pytest.raises(InvalidApiRequestError) as raised:
        tokenize(tokenize_body(**fields), served)
    assert (raised.value.status, raised.value.param, raised.value.code) == (400, param, code)


def test_a_template_refusal_is_a_400_on_messages(chat_model_dirs: dict[str, Path]) -> None:
    chat = ChatModel.load(chat_model_dirs["mistral"])
    mistral = ServedModel(name="m", max_seq_len=4096, vocab_size=chat.vocab_size, chat=chat)
    one, two = {"role": "user", "content": "one"}, {"role": "user", "content": "two"}
    with pytest.raises(InvalidApiRequestError) as raised:
        tokenize(tokenize_body(messages=[one, two]), mistral)
    assert (raised.value.param, raised.value.code) == ("messages", "invalid_messages")
    assert "conversation roles must alternate" in raised.value.message


@pytest.mark.parametrize("bad", [-1, "vocab"])
def test_detokenize_refuses_an_id_the_tokenizer_lacks(served: ServedModel, bad: object) -> None:
    token_id = served.chat.vocab_size if bad == "vocab" else bad
    with pytest.raises(InvalidApiRequestError) as raised:
        detokenize(DetokenizeRequest(tokens=[65, token_id]), served)
    assert (raised.value.param, raised.value.code) == ("tokens", "invalid_token_id")
    assert "tokens[1]" in raised.value.message


def test_another_models_name_is_a_404(served: ServedModel) -> None:
    with pytest.raises(ModelNotFoundError):
        tokenize(tokenize_body(model="gpt-5", prompt="hi"), served)
    with pytest.raises(ModelNotFoundError):
        detokenize(DetokenizeRequest(model="gpt-5", tokens=[65]), served)
