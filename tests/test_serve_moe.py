"""The inference Serve app over a Mixture-of-Experts model: routed experts through /generate and
the OpenAI routes, and the admin endpoints (weight versions, a weight update from a file, cache
flush) behind an API key, which /tokenize and /detokenize need too.

The model is a tiny Qwen3-MoE checkpoint built locally with transformers (nothing downloaded)
with the demo model's tokenizer files (and so its chat template), so the text routes work too;
served by one prefill and one decode actor on the session's Ray; one deployment for the module.
The weight update test moves the deployment's version forward, so tests here never assume
version 0.
"""

from __future__ import annotations

import base64
import json
import shutil
import socket
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import torch

from support.ray_actors import stop_and_kill
from support.serve_models import start_inference_workers
from rollmesh.mesh_address import MeshAddress
from rollmesh.bus.embedded_server import EmbeddedNatsServer
from rollmesh.chat import ChatModel
from rollmesh.config import InferenceConfig, ModelConfig
from rollmesh.engine.models import load_hf_model
from rollmesh.engine.served_model import describe_served_model
from rollmesh.engine.weights import save_weights
from rollmesh.serve_apps import build_inference_app, deploy_inference_app, shutdown_inference_app

transformers = pytest.importorskip(
    "transformers", reason="builds the tiny MoE checkpoint; pip install .[test]")

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

NUM_LAYERS, NUM_EXPERTS, TOP_K = 2, 4, 2
API_KEY = "sk-moe-" + uuid.uuid4().hex[:8]
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@dataclass(frozen=True)
class Deployed:
    url: str
    model_name: str
    checkpoint: Path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# The demo model's tokenizer and chat template, copied next to the MoE weights.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def build_moe_checkpoint(path: Path, tokenizer_dir: Path) -> Path:
    vocab_size = json.loads((tokenizer_dir / "config.json").read_text())["vocab_size"]
    end_of_turn = ChatModel.load(tokenizer_dir).encode("<|im_end|>")
    config = transformers.Qwen3MoeConfig(
        hidden_size=64, num_hidden_layers=NUM_LAYERS, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=128, moe_intermediate_size=64,
        num_experts=NUM_EXPERTS, num_experts_per_tok=TOP_K, vocab_size=vocab_size,
        max_position_embeddings=64, eos_token_id=end_of_turn[0],
    )
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(config).eval()
    with torch.no_grad():  # a router far from uniform, so routes differ between positions
        for name, param in model.named_parameters():
            if name.endswith("gate.weight"):
                param.normal_(0, 1.0)
    model.save_pretrained(path)
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer_dir / name, path / name)
    return path


@pytest.fixture(scope="module")
def deployed(
    ray_session: None, nats_server: EmbeddedNatsServer, tmp_path_factory: pytest.TempPathFactory,
    demo_model_dir: Path,
) -> Iterator[Deployed]:
    checkpoint = build_moe_checkpoint(tmp_path_factory.mktemp("tiny-qwen3-moe"), demo_model_dir)
    model = ModelConfig(path=str(checkpoint))
    namespace = "t" + uuid.uuid4().hex[:10]
    mesh = MeshAddress(namespace=namespace, nats_url=nats_server.url,
                       run_dir=str(tmp_path_factory.mktemp("serve-moe-run")))
    inference = InferenceConfig(max_batch=4)
    prefill, decode = start_inference_workers(namespace, mesh, model, inference)
    try:
        served = describe_served_model(model)
        app = build_inference_app(
            prefill_actor_names=[f"prefill-{namespace}"],
            decode_actor_names=[f"decode-{namespace}"], ray_namespace=namespace,
            model=model, api_key=API_KEY,
        )
        url = deploy_inference_app(app, host="127.0.0.1", port=free_port())
        yield Deployed(url=url, model_name=served.name, checkpoint=checkpoint)
    finally:
        shutdown_inference_app()
        stop_and_kill(decode, prefill)


@pytest.fixture(scope="module")
def client(deployed: Deployed) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=deployed.url, timeout=60, headers=AUTH) as http:
        yield http


def generate(client: httpx.Client, input_ids: list[int], **fields: object) -> dict:
    response = client.post("/generate", json={
        "input_ids": input_ids, "sampling_params": {"temperature": 0.0, "max_new_tokens": 5},
        **fields})
    assert response.status_code == 200, response.text
    return response.json()


def routed_rows(encoded: dict) -> np.ndarray:
    """The rows of a ``meta_info`` or ``rollmesh`` object, decoded as the README says."""
    data = base64.b64decode(encoded["routed_experts"])
    dtype = np.dtype(encoded["routed_experts_dtype"]).newbyteorder("<")
    return np.frombuffer(data, dtype=dtype).reshape(encoded["routed_experts_shape"])


# "route these tokens" in the demo tokenizer's ids (its own merges of the text).
@pytest.fixture(scope="module")
def prompt(deployed: Deployed) -> list[int]:
    return ChatModel.load(deployed.checkpoint).encode("route these tokens")


def test_generate_returns_routed_experts_for_positions_from_start_len(
    client: httpx.Client, prompt: list[int]
) -> None:
    full = generate(client, prompt, return_routed_experts=True)
    meta = full["meta_info"]
    seqlen = len(prompt) + len(full["output_ids"])
    assert meta["routed_experts_dtype"] == "uint8"
    assert meta["routed_experts_shape"] == [seqlen - 1, NUM_LAYERS, TOP_K]
    assert meta["routed_experts_start_len"] == 0
    rows = routed_rows(meta)
    assert rows.max() < NUM_EXPERTS
    assert all(len(set(row)) == TOP_K for row in rows.reshape(-1, TOP_K).tolist())
    assert len({row.tobytes() for row in rows}) > 1  # routes differ between positions

    start = 4
    sliced = generate(client, prompt, return_routed_experts=True, routed_experts_start_len=start)
    assert sliced["output_ids"] == full["output_ids"]  # greedy, same weights
    assert sliced["meta_info"]["routed_experts_start_len"] == start
    np.testing.assert_array_equal(routed_rows(sliced["meta_info"]), rows[start:])

    sglang = generate(client, prompt, return_routed_experts=True, routed_experts_dtype="int32")
    assert sglang["meta_info"]["routed_experts_dtype"] == "int32"
    flat = np.frombuffer(base64.b64decode(sglang["meta_info"]["routed_experts"]), dtype="<i4")
    np.testing.assert_array_equal(flat, rows.reshape(-1))  # SGLang's flat int32 rows

    plain = generate(client, prompt)
    assert "routed_experts" not in plain["meta_info"]


def test_openai_routes_return_routed_experts_in_the_rollmesh_object(
    deployed: Deployed,
) -> None:
    with openai.OpenAI(base_url=f"{deployed.url}/v1", api_key=API_KEY, timeout=60,
                       max_retries=0) as client:
        request = {"model": deployed.model_name, "messages": [{"role": "user", "content": "hi"}],
                   "max_tokens": 4, "temperature": 0,
                   "extra_body": {"return_routed_experts": True, "routed_experts_start_len": 2}}
        completion = client.chat.completions.create(**request)
        (choice,) = completion.choices
        extension = choice.model_extra["rollmesh"]
        usage = completion.usage
        assert extension["routed_experts_start_len"] == 2
        assert routed_rows(extension).shape == (
            usage.prompt_tokens + usage.completion_tokens - 1 - 2, NUM_LAYERS, TOP_K)

        chunks = list(client.chat.completions.create(**request, stream=True))
        last = chunks[-1].choices[0]
        assert last.finish_reason == choice.finish_reason
        np.testing.assert_array_equal(routed_rows(last.model_extra["rollmesh"]),
                                      routed_rows(extension))

        text = client.completions.create(model=deployed.model_name, prompt="ab", max_tokens=3,
                                         temperature=0,
                                         extra_body={"return_routed_experts": True})
        assert routed_rows(text.choices[0].model_extra["rollmesh"]).shape[1:] == (
            NUM_LAYERS, TOP_K)


def test_admin_endpoints_refuse_requests_without_the_api_key(deployed: Deployed) -> None:
    with httpx.Client(base_url=deployed.url, timeout=60) as anonymous:
        answers = [
            anonymous.get("/v1/admin/weights"),
            anonymous.post("/flush_cache"),
            anonymous.post("/update_weights_from_disk",
                           json={"model_path": "/nonexistent/w.safetensors"}),
        ]
    for answer in answers:
        assert answer.status_code == 401, answer.text
        assert answer.json()["error"]["code"] == "invalid_api_key"


def test_tokenize_routes_need_the_api_key_as_the_others(deployed: Deployed) -> None:
    with httpx.Client(base_url=deployed.url, timeout=60) as anonymous:
        answers = [anonymous.post("/tokenize", json={"prompt": "hi"}),
                   anonymous.post("/detokenize", json={"tokens": [65]})]
    for answer in answers:
        assert answer.status_code == 401, answer.text
        assert answer.json()["error"]["code"] == "invalid_api_key"
    with httpx.Client(base_url=deployed.url, timeout=60, headers=AUTH) as keyed:
        tokens = keyed.post("/tokenize", json={"prompt": "hi"}).json()["tokens"]
        assert keyed.post("/detokenize", json={"tokens": tokens}).json() == {"prompt": "hi"}


def test_update_weights_from_disk_activates_the_version_on_every_worker(
    client: httpx.Client, deployed: Deployed, tmp_path: Path, prompt: list[int]
) -> None:
    before = client.get("/v1/admin/weights").json()["weight_version"]
    state_dict = {name: tensor * 1.01 for name, tensor in
                  load_hf_model(deployed.checkpoint).state_dict().items()}
    weights_file = tmp_path / "weights.safetensors"
    save_weights(state_dict, weights_file)

    # SGLang's clients send the version as a string; ints work too.
    response = client.post("/update_weights_from_disk", json={
        "model_path": str(weights_file), "weight_version": str(before + 1)})
    assert response.status_code == 200, response.text
    assert response.json()["success"] is True
    assert response.json()["weight_version"] == before + 1

    versions = client.get("/v1/admin/weights").json()
    assert versions["weight_version"] == before + 1
    assert [(w["role"], w["current_version"], w["staged_version"])
            for w in versions["workers"]] == [("prefill", before + 1, None),
                                              ("decode", before + 1, None)]

    served = generate(client, prompt, min_weight_version=before + 1, return_routed_experts=True)
    assert served["meta_info"]["weight_versions"] == [before + 1] * len(served["output_ids"])
    assert client.post("/generate", json={
        "input_ids": prompt, "min_weight_version": before + 2}).status_code == 503

    stale = client.post("/update_weights_from_disk", json={
        "model_path": str(weights_file), "weight_version": before})
    assert stale.status_code == 400, stale.text
    assert stale.json()["error"]["code"] == "stale_weight_version"


def test_flush_cache_drops_parked_sessions(
    client: httpx.Client, prompt: list[int], deployed: Deployed,
) -> None:
    session = {"session_id": "moe-" + uuid.uuid4().hex[:8]}
    first = generate(client, prompt, **session)
    more = ChatModel.load(deployed.checkpoint).encode(" ok")
    second = generate(client, [*prompt, *first["output_ids"], *more], **session)
    assert second["meta_info"]["cached_tokens"] > 0
    flushed = client.post("/flush_cache")
    assert flushed.status_code == 200, flushed.text
    assert flushed.json()["kv_blocks_freed"] > 0
