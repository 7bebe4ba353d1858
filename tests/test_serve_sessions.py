"""Chat sessions through a deployed Serve app, driven by the official ``openai`` client as an outside
agent harness drives it: a three-turn tool-calling conversation with ``extra_body={"session_id"}``,
then ``GET /v1/sessions/{id}/trajectory`` checked token-exact; a diverging history (400), an
unknown session (404), a truncated turn (400 on the next), the API key on the session routes.

The model is a copy of the demo's directory (ChatML, Hermes calls) whose weights are fitted here to
one conversation (plain torch, loss on its assistant tokens as ``warm_start.conversation_sequence``
tokenizes it), so greedy decoding calls the tool twice and answers. The same module's deployment
(one prefill and one decode actor, one Serve app, an API key) serves every test here.
"""

from __future__ import annotations

import shutil
import socket
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
import torch

from support.ray_actors import stop_and_kill
from rollmesh.mesh_address import MeshAddress
from rollmesh.bus.embedded_server import EmbeddedNatsServer
from rollmesh.chat import ChatModel, TokenSample, ToolCall, check_trajectory
from rollmesh.chat.token_check import special_token_ids
from rollmesh.config import InferenceConfig, ModelConfig
from rollmesh.messages.token_trace import NO_VERSION, TokenTrace
from rollmesh.serve_apps import build_inference_app, deploy_inference_app, shutdown_inference_app
from rollmesh.serve_apps.chat_messages import template_messages
from rollmesh.serve_apps.http_shapes import ChatMessage
from rollmesh.training.warm_start import conversation_sequence
from support.fitted_models import fit_to_samples
from support.serve_models import CALC, start_inference_workers

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

MODEL_NAME = "fitted-demo"
API_KEY = "sk-sessions-" + uuid.uuid4().hex[:8]
QUESTION = {"role": "user", "content": "molar mass of H2O and NaCl?"}
RESULTS = ("18.015", "58.44")
ANSWER = "18.015 and 58.44"
FIT_MAX_STEPS = 600
MAX_TOKENS = 48


def conversation() -> list[dict]:
    """The fitted conversation: two calc calls, their results, the answer."""
    calls = [ToolCall(id=f"call_{n}", name="calc", arguments={"formula": formula})
             for n, formula in enumerate(("H2O", "NaCl"))]
    return [QUESTION,
            {"role": "assistant", "content": "", "tool_calls": [calls[0]]},
            {"role": "tool", "tool_call_id": "call_0", "content": RESULTS[0]},
            {"role": "assistant", "content": "", "tool_calls": [calls[1]]},
            {"role": "tool", "tool_call_id": "call_1", "content": RESULTS[1]},
            {"role": "assistant", "content": ANSWER, "tool_calls": []}]


@dataclass(frozen=True)
class Deployed:
    url: str
    chat: ChatModel
    fitted_ids: list[int]   # the conversation as a rollout would have tokenized it
    fitted_mask: list[int]


@pytest.fixture(scope="module")
def deployed(ray_session: None, nats_server: EmbeddedNatsServer, demo_model_dir: Path,
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployed]:
    model_dir = tmp_path_factory.mktemp("sessions") / MODEL_NAME
    shutil.copytree(demo_model_dir, model_dir)
    chat = ChatModel.load(model_dir)
    ids, mask = conversation_sequence(chat, conversation(), tools=[CALC])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a model this small trains faster on one thread than on two contended
    try:
        fit_to_samples(model_dir, [(ids, mask)], chat.vocab_size, max_steps=FIT_MAX_STEPS)
    finally:
        torch.set_num_threads(threads)

    model = ModelConfig(path=str(model_dir))
    namespace = "s" + uuid.uuid4().hex[:10]
    mesh = MeshAddress(namespace=namespace, nats_url=nats_server.url,
                       run_dir=str(tmp_path_factory.mktemp("sessions-run")))
    inference = InferenceConfig(max_batch=4)
    prefill, decode = start_inference_workers(namespace, mesh, model, inference)
    try:
        app = build_inference_app(
            prefill_actor_names=[f"prefill-{namespace}"], decode_actor_names=[f"decode-{namespace}"],
            ray_namespace=namespace, model=model, model_name=MODEL_NAME, api_key=API_KEY)
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        url = deploy_inference_app(app, host="127.0.0.1", port=port)
        yield Deployed(url=url, chat=chat, fitted_ids=ids, fitted_mask=mask)
    finally:
        shutdown_inference_app()
        stop_and_kill(decode, prefill)


@pytest.fixture(scope="module")
def client(deployed: Deployed) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{deployed.url}/v1", api_key=API_KEY, timeout=60, max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def http(deployed: Deployed) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=deployed.url, timeout=60,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as c:
        yield c


def harness_turn(client: openai.OpenAI, messages: list, session_id: str, **fields: object):
    """What an outside harness does each turn: send the whole conversation, keep the answer."""
    completion = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, tools=[CALC], temperature=0, max_tokens=MAX_TOKENS,
        extra_body={"session_id": session_id}, **fields)
    messages.append(completion.choices[0].message)  # the client's own object, echoed back as is
    return completion


def test_a_harness_driven_tool_session_is_token_exact(
    client: openai.OpenAI, http: httpx.Client, deployed: Deployed,
) -> None:
    session_id = "harness-" + uuid.uuid4().hex[:8]
    messages: list = [QUESTION]
    completions = []
    for result in RESULTS:
        completion = harness_turn(client, messages, session_id)
        (call,) = completion.choices[0].message.tool_calls
        assert completion.choices[0].finish_reason == "tool_calls"
        messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
        completions.append(completion)
    completions.append(harness_turn(client, messages, session_id))
    assert completions[-1].choices[0].message.content == ANSWER
    # Later turns reuse the engine's KV of the session: the prompt is the trajectory, extended.
    assert all(c.usage.prompt_tokens_details.cached_tokens > 0 for c in completions[1:])

    answer = http.get(f"/v1/sessions/{session_id}/trajectory")
    assert answer.status_code == 200, answer.text
    body = answer.json()
    trace = TokenTrace(**body["token_trace"])
    assert (body["turns"], body["finish_reason"]) == (3, "stop")
    # Token-exact: the very ids a rollout of this conversation would hold (the model was fitted
    # to them), the loss mask 1 on the generated tokens only.
    assert trace.ids == deployed.fitted_ids
    assert trace.loss_mask == deployed.fitted_mask
    generated = [p for p, mask in enumerate(trace.loss_mask) if mask]
    sampled = [(c.usage.prompt_tokens, c.usage.completion_tokens) for c in completions]
    assert generated == [p for start, count in sampled for p in range(start, start + count)]
    # Each generated id is what the engine returned, with its logprob and weight version.
    for completion, (start, count) in zip(completions, sampled):
        assert trace.versions[start:start + count] == completion.choices[0].weight_versions
    assert all(trace.versions[p] == NO_VERSION and trace.logprobs[p] == 0.0
               for p in range(len(trace)) if not trace.loss_mask[p])
    assert body["tokenization_bugs"] == [] and body["tokenization_mismatches"]["non_assistant"] == 0

    # rollmesh.chat's own check of the answer, as a client would run it.
    held = template_messages([ChatMessage.model_validate(m) for m in body["messages"]], deployed.chat)
    trajectory = deployed.chat.new_trajectory(held[:1], tools=[CALC])
    trajectory.messages = held
    trajectory.samples = [TokenSample(trace.ids, trace.loss_mask,
                                      [p if m else None for p, m in zip(trace.logprobs, trace.loss_mask)],
                                      len(held))]
    (report,) = check_trajectory(trajectory, special_token_ids(deployed.chat.directory.tokenizer))
    assert report.bugs == 0 and report.exact

    assert http.delete(f"/v1/sessions/{session_id}").json() == {
        "id": session_id, "object": "chat.session.deleted", "deleted": True}
    assert http.get(f"/v1/sessions/{session_id}/trajectory").status_code == 404


def test_a_diverging_history_is_a_400_and_the_session_goes_on(client: openai.OpenAI) -> None:
    session_id = "diverge-" + uuid.uuid4().hex[:8]
    messages: list = [QUESTION]
    call = harness_turn(client, messages, session_id).choices[0].message.tool_calls[0]
    result = {"role": "tool", "tool_call_id": call.id, "content": RESULTS[0]}
    edited = [{"role": "user", "content": "molar mass of CO2?"}, messages[1], result]
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL_NAME, messages=edited, tools=[CALC], max_tokens=4,
                                       extra_body={"session_id": session_id})
    assert (refused.value.code, refused.value.param) == ("session_history_mismatch", "messages.0")
    messages.append(result)
    assert harness_turn(client, messages, session_id).choices[0].message.tool_calls  # unharmed


def test_a_truncated_turn_ends_the_session_and_an_unknown_one_is_404(
    client: openai.OpenAI, http: httpx.Client,
) -> None:
    session_id = "cut-" + uuid.uuid4().hex[:8]
    messages: list = [QUESTION]
    assert harness_turn(client, messages, session_id, max_completion_tokens=3).choices[0].finish_reason == "length"
    messages.append({"role": "user", "content": "go on"})
    with pytest.raises(openai.BadRequestError) as refused:
        harness_turn(client, messages, session_id)
    assert refused.value.code == "session_truncated"
    assert http.get(f"/v1/sessions/{session_id}/trajectory").json()["finish_reason"] == "truncated"

    missing = http.get("/v1/sessions/nobody/trajectory")
    assert (missing.status_code, missing.json()["error"]["code"]) == (404, "session_not_found")
    assert http.delete("/v1/sessions/nobody").status_code == 404


def test_the_session_routes_need_the_api_key(deployed: Deployed) -> None:
    with httpx.Client(base_url=deployed.url, timeout=30) as anonymous:
        assert anonymous.get("/v1/sessions/any/trajectory").status_code == 401
        assert anonymous.delete("/v1/sessions/any").status_code == 401


def test_a_harness_that_sets_only_its_base_url_gets_a_session(deployed: Deployed, http: httpx.Client) -> None:
    session_id = "base-url-" + uuid.uuid4().hex[:8]
    with openai.OpenAI(base_url=f"{deployed.url}/v1/sessions/{session_id}", api_key=API_KEY, timeout=60,
                       max_retries=0) as session_client:
        completion = session_client.chat.completions.create(
            model=MODEL_NAME, messages=[QUESTION], tools=[CALC], temperature=0, max_tokens=MAX_TOKENS)
    assert completion.choices[0].message.tool_calls[0].function.name == "calc"
    body = http.get(f"/v1/sessions/{session_id}/trajectory").json()
    assert body["turns"] == 1
    assert body["token_trace"]["ids"][body["prompt_len"]:] == deployed.fitted_ids[
        body["prompt_len"]:body["prompt_len"] + completion.usage.completion_tokens]


def test_a_streamed_session_turn_is_kept_like_a_whole_one(client: openai.OpenAI, http: httpx.Client) -> None:
    session_id = "stream-" + uuid.uuid4().hex[:8]
    chunks = list(client.chat.completions.create(
        model=MODEL_NAME, messages=[QUESTION], tools=[CALC], temperature=0, max_tokens=MAX_TOKENS,
        stream=True, logprobs=True, stream_options={"include_usage": True},
        extra_body={"session_id": session_id}))
    calls = [call for chunk in chunks if chunk.choices for call in (chunk.choices[0].delta.tool_calls or [])]
    assert [call.function.name for call in calls] == ["calc"]
    # Each token's logprob came on its piece's chunk as the engine sampled it.
    streamed = [entry.logprob for chunk in chunks if chunk.choices and chunk.choices[0].logprobs
                for entry in chunk.choices[0].logprobs.content]
    assert len(streamed) == chunks[-1].usage.completion_tokens
    body = http.get(f"/v1/sessions/{session_id}/trajectory").json()
    assert body["turns"] == 1 and body["messages"][-1]["tool_calls"][0]["id"] == calls[0].id
    # Kept as sampled: the streamed turn's tokens are the trajectory's generated ones.
    trace = body["token_trace"]
    assert trace["loss_mask"][body["prompt_len"]:] == [1] * len(streamed)
    assert trace["logprobs"][body["prompt_len"]:] == streamed
