"""The inference Serve app over real prefill and decode actors: OpenAI completions and chat
(through the official ``openai`` client too, streaming included), /generate, /v1/models, /health,
sessions' KV reuse on /generate, the minimum weight version, the weight and cache admin endpoints,
and 4xx answers to bad input that leave the replica serving. (Routed experts need an MoE model:
test_serve_moe.py; chat sessions, whose turns must end, a fitted model: test_serve_sessions.py.)
The model is the demo's (a Hugging Face directory): the text routes speak its tokenizer and chat
template, and a request with tools gets its Hermes calls back as OpenAI ``tool_calls``.

One local Ray (reused if the session already started one), one prefill and one decode actor, and
one deployment for the whole module, because Serve takes seconds to start on two shared cores.
"""

from __future__ import annotations

import json
import socket
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
import ray

from support.ray_actors import stop_and_kill
from support.serve_models import start_inference_workers
from rollmesh.mesh_address import MeshAddress
from rollmesh.bus.embedded_server import EmbeddedNatsServer
from rollmesh.chat import ChatModel
from rollmesh.config import InferenceConfig, ModelConfig
from rollmesh.demo.demo_model import DemoModelShape
from rollmesh.messages.base import SamplingParams
from rollmesh.serve_apps import (
    build_inference_app,
    deploy_inference_app,
    shutdown_inference_app,
)
from rollmesh.serve_apps.router_calls import api_error_from_ray

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

MODEL_NAME = "rollmesh-demo"
MAX_SEQ_LEN = DemoModelShape().max_position_embeddings  # the demo model's context
CALC = {"type": "function", "function": {
    "name": "calc", "description": "molar mass of a formula",
    "parameters": {"type": "object", "properties": {"formula": {"type": "string"}},
                   "required": ["formula"]}}}


@dataclass(frozen=True)
class Deployed:
    url: str
    prefill: object
    decode: object
    chat: ChatModel  # the served model's tokenizer and template, as the test reads them


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def local_ray(ray_session: None) -> Iterator[None]:
    """The session's Ray (tests/conftest.py)."""
    yield


@pytest.fixture(scope="module")
def deployed(
    local_ray: None, nats_server: EmbeddedNatsServer, tmp_path_factory: pytest.TempPathFactory,
    demo_model_dir: Path,
) -> Iterator[Deployed]:
    model = ModelConfig(path=str(demo_model_dir))
    namespace = "t" + uuid.uuid4().hex[:10]
    mesh = MeshAddress(
        namespace=namespace, nats_url=nats_server.url,
        run_dir=str(tmp_path_factory.mktemp("serve-run")),
    )
    inference = InferenceConfig(max_batch=8)
    prefill, decode = start_inference_workers(namespace, mesh, model, inference)
    try:
        app = build_inference_app(
            prefill_actor_names=[f"prefill-{namespace}"],
            decode_actor_names=[f"decode-{namespace}"],
            ray_namespace=namespace, model=model, model_name=MODEL_NAME,
        )
        url = deploy_inference_app(app, host="127.0.0.1", port=free_port())
        yield Deployed(url=url, prefill=prefill, decode=decode, chat=ChatModel.from_config(model))
    finally:
        shutdown_inference_app()
        stop_and_kill(decode, prefill)


@pytest.fixture(scope="module")
def client(deployed: Deployed) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=deployed.url, timeout=60) as http:
        yield http


def greedy_generate(client: httpx.Client, input_ids: list[int], **sampling) -> dict:
    body = {"input_ids": input_ids, "return_logprob": True,
            "sampling_params": {"temperature": 0.0, **sampling}}
    response = client.post("/generate", json=body)
    assert response.status_code == 200, response.text
    return response.json()


# -- good requests ----------------------------------------------------------------------------


def test_completions_return_text_usage_and_weight_versions(
    client: httpx.Client, deployed: Deployed,
) -> None:
    response = client.post(
        "/v1/completions",
        json={"model": MODEL_NAME, "prompt": "hello", "max_tokens": 5, "temperature": 0},
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["id"].startswith("cmpl-")
    assert body["object"] == "text_completion"
    assert body["model"] == MODEL_NAME
    assert isinstance(body["created"], int)
    (choice,) = body["choices"]
    assert choice["index"] == 0
    assert isinstance(choice["text"], str)
    assert choice["finish_reason"] in ("stop", "length")
    assert choice["logprobs"] is None
    usage = body["usage"]
    assert usage["prompt_tokens"] == len(deployed.chat.encode("hello"))  # the model's tokens, as given
    assert 1 <= usage["completion_tokens"] <= 5
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert choice["weight_versions"] == [0] * usage["completion_tokens"]
    if choice["finish_reason"] == "length":
        assert usage["completion_tokens"] == 5


def test_completions_return_sampled_token_logprobs_when_asked(client: httpx.Client) -> None:
    response = client.post(
        "/v1/completions", json={"prompt": "ab", "max_tokens": 4, "logprobs": 0, "stop": None},
    )
    assert response.status_code == 200, response.text
    (choice,) = response.json()["choices"]
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == len(
        choice["weight_versions"]
    )
    assert all(isinstance(t, str) for t in logprobs["tokens"])
    assert all(lp <= 0.0 for lp in logprobs["token_logprobs"])
    assert logprobs["text_offset"][0] == 0 and len(logprobs["text_offset"]) == len(logprobs["tokens"])


def test_tokenize_gives_the_chat_routes_prompt_ids_and_detokenize_their_text(
    client: httpx.Client, deployed: Deployed,
) -> None:
    messages = [{"role": "user", "content": "molar mass of H2O?"}]
    tokenized = client.post("/tokenize", json={"messages": messages, "tools": [CALC]})
    assert tokenized.status_code == 200, tokenized.text
    answer = tokenized.json()
    rendered = deployed.chat.render(messages, tools=[CALC], add_generation_prompt=True)
    assert answer == {"tokens": deployed.chat.encode(rendered), "count": len(answer["tokens"]),
                      "max_model_len": MAX_SEQ_LEN}
    chat = client.post("/v1/chat/completions", json={
        "messages": messages, "tools": [CALC], "max_tokens": 1})
    assert chat.json()["usage"]["prompt_tokens"] == answer["count"]

    detokenized = client.post("/detokenize", json={"tokens": answer["tokens"]})
    assert detokenized.status_code == 200, detokenized.text
    assert detokenized.json() == {"prompt": rendered}
    text = client.post("/tokenize", json={"prompt": "H2O", "add_special_tokens": False}).json()
    assert text["tokens"] == deployed.chat.encode("H2O")


def test_generate_returns_output_ids_logprobs_and_versions(
    client: httpx.Client, deployed: Deployed,
) -> None:
    prompt = deployed.chat.encode("hi there")
    body = greedy_generate(client, prompt, max_new_tokens=6)
    output_ids = body["output_ids"]
    meta = body["meta_info"]
    assert 1 <= len(output_ids) <= 6
    assert body["text"] == deployed.chat.decode(output_ids)  # every id, specials included
    assert meta["prompt_tokens"] == len(prompt)
    assert meta["completion_tokens"] == len(output_ids)
    assert meta["finish_reason"]["type"] in ("stop", "length")
    assert [entry[1] for entry in meta["output_token_logprobs"]] == output_ids
    assert all(entry[2] is None for entry in meta["output_token_logprobs"])
    assert meta["weight_versions"] == [0] * len(output_ids)
    assert meta["weight_version"] == meta["weight_versions"][-1]
    if meta["finish_reason"]["type"] == "length":
        assert meta["finish_reason"]["length"] == len(output_ids) == 6


def test_generate_leaves_out_logprobs_unless_asked(client: httpx.Client) -> None:
    response = client.post("/generate", json={"input_ids": [65, 66],
                                              "sampling_params": {"max_new_tokens": 2}})
    assert response.status_code == 200, response.text
    assert "output_token_logprobs" not in response.json()["meta_info"]


def test_stop_string_ends_generation_and_is_cut_from_completion_text(
    client: httpx.Client, deployed: Deployed,
) -> None:
    chat = deployed.chat
    prompt = "stop here"
    free_run = greedy_generate(client, chat.encode(prompt), max_new_tokens=12)["output_ids"]
    assert not chat.end_of_turn_ids & set(free_run[:3]), "the model ended its turn at once"
    # Greedy decoding is deterministic, so text the model is known to write can be a stop: that of
    # its 2nd and 3rd tokens. Generation must end with the first token after which the text holds
    # it (the untrained model often repeats one token, so that may come before the 3rd).
    stop = chat.decode(free_run[1:3])
    ends_at = next(n for n in range(1, 4) if stop in chat.decode(free_run[:n]))

    stopped = greedy_generate(client, chat.encode(prompt), max_new_tokens=12, stop=stop)
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert stopped["output_ids"] == free_run[:ends_at]
    assert stopped["text"] == chat.decode(free_run[:ends_at])  # /generate keeps the stop string

    response = client.post("/v1/completions", json={
        "prompt": prompt, "max_tokens": 12, "temperature": 0.0, "stop": [stop]})
    (choice,) = response.json()["choices"]
    assert choice["finish_reason"] == "stop"
    assert choice["text"] == stopped["text"][: stopped["text"].index(stop)]


def test_concurrent_completions_all_succeed(client: httpx.Client) -> None:
    def complete(index: int) -> int:
        return client.post("/v1/completions", json={
            "prompt": f"request {index}", "max_tokens": 4}).status_code

    with ThreadPoolExecutor(max_workers=4) as pool:
        assert list(pool.map(complete, range(4))) == [200] * 4


def test_models_lists_the_served_model(client: httpx.Client) -> None:
    response = client.get("/v1/models")
    assert response.status_code == 200
    body = response.json()
    assert body["object"] == "list"
    assert [card["id"] for card in body["data"]] == [MODEL_NAME]
    assert body["data"][0]["object"] == "model"


def test_health_is_ok(client: httpx.Client) -> None:
    response = client.get("/health")
    assert response.status_code == 200
    assert response.json() == {"status": "ok"}


# -- bad requests -----------------------------------------------------------------------------

TOO_LONG = MAX_SEQ_LEN  # one more than fits (a position is kept for generation)
# Digits are one token each in the demo's tokenizer (Qwen2's pre-tokenizer), so this is TOO_LONG tokens.
TOO_LONG_TEXT = "7" * TOO_LONG
USER_HI = [{"role": "user", "content": "hi"}]

BAD_REQUESTS = [
    # (id, path, JSON body or raw bytes, status, code, param)
    ("completion-malformed-json", "/v1/completions", b'{"prompt": "hi",', 400, "invalid_json",
     None),
    ("generate-malformed-json", "/generate", b"{input_ids: [1]}", 400, "invalid_json", None),
    ("body-not-an-object", "/v1/completions", [1, 2], 400, "invalid_value", None),
    ("prompt-missing", "/v1/completions", {"max_tokens": 2}, 400, "invalid_value", "prompt"),
    ("prompt-not-a-string", "/v1/completions", {"prompt": 12}, 400, "invalid_value", "prompt"),
    ("temperature-a-string", "/v1/completions", {"prompt": "a", "temperature": "hot"}, 400,
     "invalid_value", "temperature"),
    ("temperature-too-high", "/v1/completions", {"prompt": "a", "temperature": 11.0}, 400,
     "invalid_value", "temperature"),
    ("top-p-zero", "/v1/completions", {"prompt": "a", "top_p": 0.0}, 400, "invalid_value",
     "top_p"),
    ("max-tokens-a-string", "/v1/completions", {"prompt": "a", "max_tokens": "4"}, 400,
     "invalid_value", "max_tokens"),
    ("max-tokens-zero", "/v1/completions", {"prompt": "a", "max_tokens": 0}, 400,
     "invalid_value", "max_tokens"),
    ("max-tokens-over-context", "/v1/completions",
     {"prompt": "a", "max_tokens": MAX_SEQ_LEN + 1}, 400, "invalid_value", "max_tokens"),
    ("n-two", "/v1/completions", {"prompt": "a", "n": 2}, 400, "unsupported_value", "n"),
    ("chat-messages-empty", "/v1/chat/completions", {"messages": []}, 400, "invalid_value",
     "messages"),
    ("chat-unknown-role", "/v1/chat/completions",
     {"messages": [{"role": "robot", "content": "hi"}]}, 400, "invalid_value", "messages.0.role"),
    ("chat-max-tokens-zero", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, 400, "invalid_value",
     "max_tokens"),
    ("chat-unknown-model", "/v1/chat/completions",
     {"model": "gpt-5", "messages": [{"role": "user", "content": "hi"}]}, 404,
     "model_not_found", "model"),
    ("logprobs-too-many", "/v1/completions", {"prompt": "a", "logprobs": 10}, 400,
     "invalid_value", "logprobs"),
    ("chat-top-logprobs-too-many", "/v1/chat/completions",
     {"messages": USER_HI, "logprobs": True, "top_logprobs": 21}, 400, "invalid_value",
     "top_logprobs"),
    ("tokenize-prompt-and-messages", "/tokenize", {"prompt": "a", "messages": USER_HI}, 400,
     "invalid_value", "prompt"),
    ("detokenize-unknown-id", "/detokenize", {"tokens": [65, 10**6]}, 400, "invalid_token_id",
     "tokens"),
    ("detokenize-not-ids", "/detokenize", {"tokens": "abc"}, 400, "invalid_value", "tokens"),
    ("empty-stop-string", "/v1/completions", {"prompt": "a", "stop": [""]}, 400,
     "invalid_value", "stop"),
    ("too-many-stop-strings", "/v1/completions", {"prompt": "a", "stop": ["x"] * 17}, 400,
     "invalid_value", "stop"),
    ("prompt-too-long", "/v1/completions", {"prompt": TOO_LONG_TEXT}, 400, "prompt_too_long",
     "prompt"),
    ("unknown-model", "/v1/completions", {"model": "gpt-5", "prompt": "a"}, 404,
     "model_not_found", "model"),
    ("input-ids-missing", "/generate", {"text": "hello"}, 400, "invalid_value", "input_ids"),
    ("input-ids-empty", "/generate", {"input_ids": []}, 400, "invalid_value", "input_ids"),
    ("input-id-outside-vocab", "/generate", {"input_ids": [65, 10**6]}, 400,
     "invalid_token_id", "input_ids"),
    ("input-id-negative", "/generate", {"input_ids": [-1]}, 400, "invalid_token_id",
     "input_ids"),
    ("input-id-a-float", "/generate", {"input_ids": [1.5]}, 400, "invalid_value",
     "input_ids.0"),
    ("input-id-a-bool", "/generate", {"input_ids": [True]}, 400, "invalid_value",
     "input_ids.0"),
    ("input-ids-too-long", "/generate", {"input_ids": [65] * TOO_LONG}, 400, "prompt_too_long",
     "input_ids"),
    ("max-new-tokens-over-context", "/generate",
     {"input_ids": [65], "sampling_params": {"max_new_tokens": MAX_SEQ_LEN + 1}}, 400,
     "invalid_value", "sampling_params.max_new_tokens"),
    ("negative-temperature", "/generate",
     {"input_ids": [65], "sampling_params": {"temperature": -1.0}}, 400, "invalid_value",
     "sampling_params.temperature"),
    ("generate-stream", "/generate", {"input_ids": [65], "stream": True}, 400,
     "unsupported_value", "stream"),
    ("chat-prompt-too-long", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": TOO_LONG_TEXT}]}, 400, "prompt_too_long",
     "messages"),
    ("chat-content-null-without-tool-calls", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": None}]}, 400, "invalid_value",
     "messages.0.content"),
    ("chat-tool-arguments-not-json", "/v1/chat/completions",
     {"messages": [*USER_HI, {"role": "assistant", "content": None, "tool_calls": [
         {"id": "call_0", "type": "function",
          "function": {"name": "calc", "arguments": "{formula: H2O"}}]}], "tools": [CALC]},
     400, "invalid_value", "messages.1.tool_calls.0.function.arguments"),
    ("chat-tool-without-a-name", "/v1/chat/completions",
     {"messages": USER_HI, "tools": [{"type": "function", "function": {"parameters": {}}}]},
     400, "invalid_value", "tools.0"),
    ("chat-tool-parameters-not-a-schema", "/v1/chat/completions",
     {"messages": USER_HI, "tools": [{"type": "function", "function": {
         "name": "calc", "parameters": {"type": "object", "properties": 5}}}]},
     400, "invalid_value", "tools.0"),
    ("generate-two-grammars", "/generate",
     {"input_ids": [65], "sampling_params": {"json_schema": "{}", "ebnf": "root ::= \"a\""}}, 400,
     "invalid_value", "sampling_params.ebnf"),
    ("generate-grammar-that-does-not-compile", "/generate",
     {"input_ids": [65], "sampling_params": {"ebnf": "root ::= nowhere"}}, 400, "invalid_value",
     "sampling_params"),
    ("chat-tool-choice-unknown-tool", "/v1/chat/completions",
     {"messages": USER_HI, "tools": [CALC], "tool_choice": {
         "type": "function", "function": {"name": "nope"}}}, 400, "unknown_tool", "tool_choice"),
    # A schema jsonschema takes and xgrammar cannot compile: refused by the engine, mapped back.
    ("chat-response-format-uncompilable", "/v1/chat/completions",
     {"messages": USER_HI, "response_format": {"type": "json_schema", "json_schema": {
         "name": "x", "schema": {"type": "object", "properties": {"a": {"$ref": "#/$defs/nope"}},
                                 "required": ["a"]}}}},
     400, "invalid_value", "response_format"),
    ("chat-template-kwargs-reserved", "/v1/chat/completions",
     {"messages": USER_HI, "chat_template_kwargs": {"tools": []}}, 400, "invalid_value",
     "chat_template_kwargs"),
    # rollmesh's extension fields
    ("routed-experts-of-a-dense-model", "/generate",
     {"input_ids": [65, 66], "return_routed_experts": True}, 400, "unsupported_value",
     "return_routed_experts"),
    ("routed-experts-start-past-the-prompt", "/generate",
     {"input_ids": [65, 66], "routed_experts_start_len": 3}, 400, "invalid_value",
     "routed_experts_start_len"),
    ("chat-routed-experts-start-negative", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "hi"}], "routed_experts_start_len": -1}, 400,
     "invalid_value", "routed_experts_start_len"),
    ("routed-experts-dtype-unknown", "/generate",
     {"input_ids": [65], "routed_experts_dtype": "float16"}, 400, "invalid_value",
     "routed_experts_dtype"),
    ("min-weight-version-negative", "/v1/completions", {"prompt": "a", "min_weight_version": -1},
     400, "invalid_value", "min_weight_version"),
    ("session-id-empty", "/generate", {"input_ids": [65], "session_id": ""}, 400,
     "invalid_value", "session_id"),
    ("rid-empty", "/generate", {"input_ids": [65], "rid": ""}, 400, "invalid_value", "rid"),
    # the weight admin
    ("update-weights-without-a-path", "/update_weights_from_disk", {"weight_version": 1}, 400,
     "invalid_value", "model_path"),
    ("update-weights-from-a-missing-file", "/update_weights_from_disk",
     {"model_path": "/nonexistent/weights.safetensors", "weight_version": 1}, 400,
     "invalid_weights", "model_path"),
    ("update-weights-version-not-a-number", "/update_weights_from_disk",
     {"model_path": "/nonexistent/weights.safetensors", "weight_version": "one"}, 400,
     "invalid_value", "weight_version"),
]


@pytest.mark.parametrize(
    ("path", "body", "status", "code", "param"),
    [pytest.param(*case[1:], id=case[0]) for case in BAD_REQUESTS],
)
def test_bad_input_gets_a_4xx_error_and_the_next_request_succeeds(
    client: httpx.Client, path: str, body: object, status: int, code: str, param: str | None
) -> None:
    if isinstance(body, bytes):
        response = client.post(path, content=body, headers={"content-type": "application/json"})
    else:
        response = client.post(path, json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["message"]
    assert error["code"] == code
    if param is not None:
        assert error["param"] == param

    assert greedy_generate(client, [65, 66], max_new_tokens=1)["output_ids"]


def test_min_weight_version_not_reached_is_a_retryable_503(client: httpx.Client) -> None:
    body = {"input_ids": [65, 66], "sampling_params": {"max_new_tokens": 2}}
    response = client.post("/generate", json={**body, "min_weight_version": 10**6})
    assert response.status_code == 503, response.text
    assert response.headers["retry-after"] == "1"
    error = response.json()["error"]
    assert (error["code"], error["param"]) == ("version_unavailable", "min_weight_version")
    assert "retryable" in error["message"]

    reached = client.post("/generate", json={**body, "min_weight_version": 0})
    assert reached.status_code == 200, reached.text


def test_admin_weights_lists_every_worker_and_its_version(client: httpx.Client) -> None:
    response = client.get("/v1/admin/weights")
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["weight_version"] == 0
    assert [(w["name"].split("-")[0], w["role"], w["current_version"], w["staged_version"])
            for w in body["workers"]] == [("prefill", "prefill", 0, None),
                                          ("decode", "decode", 0, None)]


def test_session_turns_reuse_kv_until_the_cache_is_flushed(
    client: httpx.Client, deployed: Deployed,
) -> None:
    session_id = "agent-" + uuid.uuid4().hex[:8]

    def generate(input_ids: list[int]) -> dict:
        response = client.post("/generate", json={
            "input_ids": input_ids, "session_id": session_id,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": 4}})
        assert response.status_code == 200, response.text
        return response.json()

    encode = deployed.chat.encode
    first_prompt = encode("the first turn of a session")
    first = generate(first_prompt)
    assert first["meta_info"]["cached_tokens"] == 0
    second_prompt = [*first_prompt, *first["output_ids"], *encode(" tool says 4")]
    second = generate(second_prompt)
    assert second["meta_info"]["cached_tokens"] > 0

    flushed = client.post("/flush_cache")
    assert flushed.status_code == 200, flushed.text
    assert flushed.json()["success"] is True
    assert flushed.json()["kv_blocks_freed"] > 0
    third = generate([*second_prompt, *second["output_ids"], *encode(" and 5")])
    assert third["meta_info"]["cached_tokens"] == 0


def test_generate_echoes_sglang_rid_as_the_request_id(client: httpx.Client) -> None:
    rid = "rid-" + uuid.uuid4().hex
    response = client.post("/generate", json={"input_ids": [65, 66], "rid": rid,
                                              "sampling_params": {"max_new_tokens": 1}})
    assert response.status_code == 200, response.text
    assert response.json()["meta_info"]["id"] == rid


def test_generate_streaming_is_refused_with_a_clear_message(client: httpx.Client) -> None:
    response = client.post("/generate", json={"input_ids": [65], "stream": True})
    assert response.status_code == 400
    assert response.json()["error"]["message"] == "streaming is not supported yet"


# -- the official openai client ---------------------------------------------------------------


@pytest.fixture(scope="module")
def openai_client(deployed: Deployed) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{deployed.url}/v1", api_key="unused", timeout=60,
                       max_retries=0) as client:
        yield client


def test_openai_client_gets_a_chat_completion_of_the_templated_prompt(
    openai_client: openai.OpenAI, deployed: Deployed,
) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    completion = openai_client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=5, temperature=0,
    )
    assert completion.id.startswith("chatcmpl-")
    assert completion.object == "chat.completion"
    (choice,) = completion.choices
    assert choice.message.role == "assistant"
    assert isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    rendered = deployed.chat.render(messages, add_generation_prompt=True)
    assert rendered.endswith("<|im_start|>assistant\n")
    assert completion.usage.prompt_tokens == len(deployed.chat.encode(rendered))
    assert 1 <= completion.usage.completion_tokens <= 5
    assert "<|im_end|>" not in choice.message.content  # the end of turn is not text


def test_openai_client_sends_back_a_tool_call_turn_with_content_null(
    openai_client: openai.OpenAI, deployed: Deployed,
) -> None:
    """The client's own message objects for a call and its result go back as the next request:
    an assistant turn with ``content: null`` and JSON-string arguments, rendered as the template
    writes a call (arguments as an object), then the tool result."""
    question = {"role": "user", "content": "molar mass of H2O?"}
    call = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_0", "type": "function",
         "function": {"name": "calc", "arguments": '{"formula": "H2O"}'}}]}
    result = {"role": "tool", "tool_call_id": "call_0", "content": "18.015"}
    request = {"model": MODEL_NAME, "messages": [question, call, result], "tools": [CALC],
               "max_tokens": 6, "temperature": 0}
    completion = openai_client.chat.completions.create(**request)

    rendered = deployed.chat.render([question, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_0", "type": "function",
         "function": {"name": "calc", "arguments": {"formula": "H2O"}}}]}, result],
        tools=[CALC], add_generation_prompt=True)
    assert '<tool_call>\n{"name": "calc", "arguments": {"formula": "H2O"}}\n</tool_call>' in rendered
    assert "Tools: calc(formula)" in rendered
    assert completion.usage.prompt_tokens == len(deployed.chat.encode(rendered))
    (choice,) = completion.choices
    # The untrained model writes what it writes; a call it made would be read as tool_calls.
    if choice.message.tool_calls:
        assert choice.finish_reason == "tool_calls"
        assert all(c.function.name == "calc" for c in choice.message.tool_calls)
    else:
        assert choice.finish_reason in ("stop", "length")
        assert isinstance(choice.message.content, str)

    chunks = list(openai_client.chat.completions.create(**request, stream=True))
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in chunks)
    assert streamed == (choice.message.content or "")
    assert chunks[-1].choices[0].finish_reason == choice.finish_reason


def test_openai_client_gets_the_logprobs_the_engine_sampled_with(
    openai_client: openai.OpenAI, client: httpx.Client, deployed: Deployed,
) -> None:
    """Chat ``logprobs`` (``top_logprobs: 0``) are those /generate returns for the same prompt
    ids (from /tokenize) at temperature 0: one per generated token, the end of turn included."""
    messages = [{"role": "user", "content": "count"}]
    completion = openai_client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=6, temperature=0, logprobs=True,
        top_logprobs=0)
    content = completion.choices[0].logprobs.content
    prompt_ids = client.post("/tokenize", json={"messages": messages}).json()["tokens"]
    meta = greedy_generate(client, prompt_ids, max_new_tokens=6)
    assert [entry.token for entry in content] == [
        deployed.chat.decode([token_id]) for token_id in meta["output_ids"]]
    assert [entry.logprob for entry in content] == pytest.approx(
        [entry[0] for entry in meta["meta_info"]["output_token_logprobs"]], abs=1e-4)
    assert all(entry.top_logprobs == [] for entry in content)

    legacy = openai_client.completions.create(model=MODEL_NAME, prompt="abc", max_tokens=4,
                                              temperature=0, logprobs=0)
    logprobs = legacy.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == legacy.usage.completion_tokens
    assert all(value <= 0.0 for value in logprobs.token_logprobs)
    with pytest.raises(openai.BadRequestError) as refused:
        openai_client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=1,
                                              logprobs=True, top_logprobs=21)
    assert refused.value.body["param"] == "top_logprobs"


def test_openai_client_gets_top_logprobs_sorted_with_the_greedy_token_first(
    openai_client: openai.OpenAI, deployed: Deployed,
) -> None:
    completion = openai_client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "count"}], max_tokens=5,
        temperature=0, logprobs=True, top_logprobs=3)
    for entry in completion.choices[0].logprobs.content:
        values = [top.logprob for top in entry.top_logprobs]
        assert len(values) == 3 and values == sorted(values, reverse=True)
        assert (entry.top_logprobs[0].token, values[0]) == (entry.token, pytest.approx(entry.logprob))


def test_openai_client_streams_a_chat_completion_with_the_same_text(
    openai_client: openai.OpenAI,
) -> None:
    request = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "count"}],
               "max_tokens": 12, "temperature": 0}
    whole = openai_client.chat.completions.create(**request).choices[0]
    chunks = list(openai_client.chat.completions.create(**request, stream=True))
    assert all(chunk.object == "chat.completion.chunk" for chunk in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in chunks)
    assert streamed == whole.message.content
    assert chunks[-1].choices[0].finish_reason == whole.finish_reason
    assert len({chunk.id for chunk in chunks}) == 1


def test_openai_client_streams_a_completion_with_the_same_text(
    openai_client: openai.OpenAI,
) -> None:
    request = {"model": MODEL_NAME, "prompt": "abc", "max_tokens": 10, "temperature": 0}
    whole = openai_client.completions.create(**request).choices[0]
    chunks = list(openai_client.completions.create(**request, stream=True))
    assert len(chunks) >= 2  # the text, then the finish reason
    assert "".join(chunk.choices[0].text for chunk in chunks) == whole.text
    assert chunks[-1].choices[0].finish_reason == whole.finish_reason


def test_streamed_completion_is_server_sent_events_ending_in_done(client: httpx.Client) -> None:
    with client.stream("POST", "/v1/completions", json={
            "prompt": "a", "max_tokens": 3, "stream": True}) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in events)
    assert events[-1] == "data: [DONE]"


def test_openai_client_streams_each_decode_steps_tokens_with_their_logprobs(
    openai_client: openai.OpenAI,
) -> None:
    """The logprobs of a streamed answer come with the chunks of their own tokens, so a stream
    of several tokens comes in several chunks (a finished answer cut in pieces would carry them
    all at the end); usage comes last with ``include_usage``."""
    chunks = list(openai_client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "count"}], max_tokens=8,
        temperature=0, logprobs=True, top_logprobs=2, stream=True,
        stream_options={"include_usage": True}))
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.completion_tokens >= 2
    with_tokens = [chunk.choices[0].logprobs.content for chunk in chunks[:-1]
                   if chunk.choices[0].logprobs is not None]
    assert len(with_tokens) >= 2
    assert sum(len(tokens) for tokens in with_tokens) == usage.completion_tokens
    assert all(len(token.top_logprobs) == 2 for tokens in with_tokens for token in tokens)


def test_a_client_that_leaves_a_stream_aborts_its_request(
    client: httpx.Client, deployed: Deployed,
) -> None:
    body = {"prompt": "abc", "max_tokens": 150, "temperature": 0}
    whole = client.post("/v1/completions", json=body).json()
    assert whole["choices"][0]["finish_reason"] == "length"  # greedy runs to the budget
    before = ray.get(deployed.decode.stats.remote(), timeout=30)["decode"].tokens_generated
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        next(line for line in response.iter_lines() if line.startswith("data: "))
    deadline = time.monotonic() + 60
    while ray.get(deployed.decode.load.remote(), timeout=30) and time.monotonic() < deadline:
        time.sleep(0.05)  # polling the worker, not waiting for an outcome
    generated = ray.get(deployed.decode.stats.remote(), timeout=30)["decode"].tokens_generated
    assert generated - before < 150  # aborted before its budget


def test_a_stream_the_engine_refuses_before_any_token_gets_its_own_status(
    client: httpx.Client,
) -> None:
    response = client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True,
        "min_weight_version": 10**6})
    assert response.status_code == 503, response.text
    assert response.json()["error"]["code"] == "version_unavailable"


def test_openai_client_errors_are_openai_errors(openai_client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as raised:
        openai_client.chat.completions.create(
            model="gpt-5", messages=[{"role": "user", "content": "hi"}])
    assert raised.value.code == "model_not_found"


def test_engine_error_raised_in_an_actor_maps_to_400(deployed: Deployed) -> None:
    too_long = [65] * TOO_LONG
    kv_ref = deployed.prefill.prefill.remote(too_long, "too-long")
    with pytest.raises(Exception) as raised:
        ray.get(deployed.decode.generate.remote(kv_ref, SamplingParams(), "too-long"), timeout=30)
    error = api_error_from_ray(raised.value)
    assert error.status == 400
    assert error.code == "prompt_too_long"


# -- guided decoding (tool_choice, response_format) ---------------------------------------------

# Finite arguments: the demo model's near-flat weights reach the end of the call in a few tokens
# (a free string may run to max_tokens, as with any grammar engine).
WEIGH = {"type": "function", "function": {
    "name": "weigh", "description": "weigh the sample",
    "parameters": {"type": "object", "properties": {"unit": {"enum": ["g", "kg"]},
                                                    "exact": {"type": "boolean"}},
                   "required": ["unit", "exact"]}}}


def test_openai_client_forced_to_call_a_named_function_gets_a_call_matching_its_schema(
    openai_client: openai.OpenAI, deployed: Deployed,
) -> None:
    completion = openai_client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "weigh it"}], tools=[CALC, WEIGH],
        tool_choice={"type": "function", "function": {"name": "weigh"}}, max_tokens=100,
        temperature=0, logprobs=True)
    (choice,) = completion.choices
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "weigh"
    jsonschema.validate(json.loads(call.function.arguments), WEIGH["function"]["parameters"])
    flags = choice.model_extra["constrained"]
    assert len(flags) == completion.usage.completion_tokens and all(flags)
    # <tool_call> was the only token allowed first: the logprob of the masked distribution is 0.
    first = choice.logprobs.content[0]
    assert (first.token, first.logprob) == ("<tool_call>", 0.0)


def test_openai_client_with_tool_choice_required_gets_calls_that_parse(
    openai_client: openai.OpenAI,
) -> None:
    completion = openai_client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "weigh it"}], tools=[WEIGH],
        tool_choice="required", parallel_tool_calls=False, max_tokens=100, temperature=1.0)
    (choice,) = completion.choices
    (call,) = choice.message.tool_calls
    assert call.function.name == "weigh" and choice.finish_reason == "tool_calls"
    jsonschema.validate(json.loads(call.function.arguments), WEIGH["function"]["parameters"])


def test_response_format_json_schema_gives_json_matching_the_schema(client: httpx.Client) -> None:
    schema = WEIGH["function"]["parameters"]
    response = client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "weigh it"}], "max_tokens": 100, "temperature": 1.0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "weight", "schema": schema}}})
    assert response.status_code == 200, response.text
    (choice,) = response.json()["choices"]
    jsonschema.validate(json.loads(choice["message"]["content"]), schema)
    assert choice["finish_reason"] == "stop" and all(choice["constrained"])
    free = client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}).json()
    assert free["choices"][0]["constrained"] is None  # no grammar, no flags


def test_generate_takes_sglangs_grammar_params_and_flags_the_constrained_tokens(
    client: httpx.Client, deployed: Deployed,
) -> None:
    prompt = deployed.chat.encode("<|im_start|>user\nyes or no?<|im_end|>\n<|im_start|>assistant\n")
    body = greedy_generate(client, prompt, max_new_tokens=20, ebnf='root ::= "yes" | "no"')
    ids = body["output_ids"]
    assert deployed.chat.decode(ids[:-1]) in ("yes", "no")
    assert ids[-1] in deployed.chat.end_of_turn_ids
    flags = body["meta_info"]["constrained"]
    assert len(flags) == len(ids) and flags[-1]  # after "yes"/"no" only the end of turn is left
    assert "constrained" not in greedy_generate(client, prompt, max_new_tokens=2)["meta_info"]


def test_a_streamed_forced_call_comes_as_a_tool_call_delta_with_the_flags_on_the_last_chunk(
    openai_client: openai.OpenAI,
) -> None:
    request = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "weigh it"}],
               "tools": [WEIGH], "tool_choice": {"type": "function", "function": {"name": "weigh"}},
               "max_tokens": 100, "temperature": 0}
    whole = openai_client.chat.completions.create(**request)
    chunks = list(openai_client.chat.completions.create(**request, stream=True))
    calls = [call for chunk in chunks for call in chunk.choices[0].delta.tool_calls or []]
    assert [call.function.arguments for call in calls] == [
        whole.choices[0].message.tool_calls[0].function.arguments]
    last = chunks[-1].choices[0]
    assert last.finish_reason == "tool_calls"
    assert last.model_extra["constrained"] == whole.choices[0].model_extra["constrained"]
