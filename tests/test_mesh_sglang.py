"""A mesh with ``inference.backend = "sglang"`` attached to (fake) SGLang servers runs rollouts.

The whole mesh on the session's NATS and Ray (trainer, sandbox broker, rollout worker, the Serve
app), with ``inference.sglang.urls`` naming a ``FakeSGLang`` (tests/support/sglang_fake.py) served from
this process: the launcher spawns SGLang workers as the decode workers and no prefill workers,
the rollout worker's router and the Serve app generate through them, token-in token-out. The fake
answers each turn with the next assistant turn of the molar-mass task's correct episode, as the
demo model's chat template encodes it, so a real tool call runs in the sandbox and the answer is
rewarded; the tokens, logprobs and weight versions in the trajectory are the fake's.
"""

from __future__ import annotations

import asyncio
import random
import socket
import uuid
from pathlib import Path

import httpx
import msgspec
import pytest
import ray

from rollmesh.chat import ChatModel
from rollmesh.launcher import Mesh
from rollmesh.mesh_address import new_run_dir
from rollmesh.messages import RolloutCompleted, RolloutRequested, SamplingParams
from rollmesh.messages.token_trace import NO_VERSION
from rollmesh.rollout.molar_mass import MolarMassTask
from rollmesh.training.warm_start import conversation_sequence
from conftest import REPO_ROOT
from support.sglang_fake import FakeSGLang
from test_mesh_token_exact import assistant_segments, run_rollout

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

FORMULA = "H2O"
LABEL = "0"  # the fake's weight label (a launched server starts at 0): every generated token carries it


def episode(chat: ChatModel) -> tuple[list[int], list[int]]:
    """The molar-mass task's correct episode, as the model's template encodes it."""
    task = MolarMassTask()
    task_input = {"formula": FORMULA}
    messages = [*task.messages(task_input),
                *task.demonstration(task_input, exact=True, rng=random.Random(0))]
    return conversation_sequence(chat, messages, tools=task.tools())


def next_turn(ids: list[int], loss_mask: list[int], end_ids: frozenset[int]):
    """The fake's answer to a prompt: the episode's next assistant turn when the prompt is the
    episode so far, else just an end of turn."""
    segments = dict(assistant_segments(loss_mask))

    def respond(prompt: list[int]) -> list[int]:
        if prompt == ids[:len(prompt)] and len(prompt) in segments:
            return ids[len(prompt):segments[len(prompt)]]
        return [min(end_ids)]

    return respond


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
async def sglang_mesh(demo_model_dir: Path, nats_server, ray_session):
    chat = ChatModel.load(demo_model_dir)
    ids, loss_mask = episode(chat)
    fake = FakeSGLang(label=LABEL, decode=chat.decode,
                      responder=next_turn(ids, loss_mask, chat.end_of_turn_ids))
    await fake.start()
    from rollmesh.config import load_config

    config = load_config(overrides={
        "namespace": "sgl" + uuid.uuid4().hex[:8],
        "nats.url": nats_server.url,
        "serve.port": free_port(),
        "scheduler.total_gpus": 0,
        "scheduler.grants": {},
        "model.path": str(demo_model_dir),
        "inference.backend": "sglang",
        "inference.sglang.urls": [fake.url],
    })
    mesh = Mesh(config, run_dir=new_run_dir(REPO_ROOT / ".rollmesh" / "test-runs"))
    try:
        info = await mesh.start()
        yield mesh, info, fake, chat, (ids, loss_mask)
    finally:
        await mesh.stop()
        await fake.stop()


async def test_a_tool_rollout_runs_end_to_end_through_sglang_workers(sglang_mesh):
    mesh, info, fake, chat, (ids, loss_mask) = sglang_mesh
    assert mesh.prefill_workers == [] and len(mesh.decode_workers) == 1
    request = RolloutRequested(rollout_id="sgl-" + uuid.uuid4().hex[:8], task="molar_mass",
                               task_input={"formula": FORMULA}, max_turns=3,
                               sampling=SamplingParams(temperature=0.0, max_new_tokens=96))
    result = await run_rollout(info, request)
    assert isinstance(result, RolloutCompleted), msgspec.json.encode(result).decode()
    trace = result.token_trace()
    text = chat.decode(trace.ids)

    # The whole episode, token for token: the fake's turns and the sandbox's real tool result.
    assert trace.ids == ids, text
    assert result.tool_calls == 1 and result.turns == 2 and result.reward == 1.0, text
    # Each generated token carries the server's weight label and the logprob it reported; the
    # prompt and tool tokens carry neither.
    generated = [p for p, mask in enumerate(trace.loss_mask) if mask]
    assert generated == [p for p, mask in enumerate(loss_mask) if mask]
    assert {trace.versions[p] for p in generated} == {int(LABEL)} and result.weight_version == int(LABEL)
    for start, end in assistant_segments(trace.loss_mask):
        assert trace.logprobs[start:end] == pytest.approx([-0.5 - i / 10 for i in range(end - start)])
    assert all(trace.versions[p] == NO_VERSION for p, mask in enumerate(trace.loss_mask) if not mask)
    # Token ids in, with the model's end-of-turn ids as SGLang's stop_token_ids.
    first = fake.bodies("/generate")[0]
    assert first["input_ids"] == ids[:result.prompt_len]
    assert set(first["sampling_params"]["stop_token_ids"]) == set(chat.end_of_turn_ids)


async def test_the_serve_app_generates_through_the_sglang_workers(sglang_mesh):
    mesh, info, fake, chat, (ids, loss_mask) = sglang_mesh
    prompt = ids[:next(p for p, mask in enumerate(loss_mask) if mask)]
    async with httpx.AsyncClient(base_url=info.serve_url, timeout=120) as http:
        response = await http.post("/generate", json={
            "input_ids": prompt, "sampling_params": {"temperature": 0.0, "max_new_tokens": 64}})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["output_ids"] == next_turn(ids, loss_mask, chat.end_of_turn_ids)(prompt)
    assert fake.bodies("/generate")[-1]["input_ids"] == prompt
    assert body["meta_info"]["weight_version"] in (LABEL, int(LABEL))


async def test_a_published_version_reaches_sglang_as_a_model_directory_loaded_in_place(sglang_mesh):
    mesh, info, fake, chat, _ = sglang_mesh
    trainer = ray.get_actor("trainer", namespace=mesh.ray_namespace)
    # One supervised step publishes version 1; the SGLang worker follows it.
    await trainer.warm_start.remote("rollmesh.rollout.molar_mass:MolarMassTask", steps=1, batch_size=2,
                                    lr=1e-4, exact_fraction=1.0, seed=0)
    version = await trainer.version.remote()
    give_up = asyncio.get_running_loop().time() + 120
    while not fake.bodies("/update_weights_from_disk") and asyncio.get_running_loop().time() < give_up:
        await asyncio.sleep(0.1)  # polls the fake's record; the worker's update is the signal
    [update] = fake.bodies("/update_weights_from_disk")
    directory = Path(update["model_path"])
    assert (update["weight_version"], update["flush_cache"]) == (str(version), False)
    assert (directory / "model.safetensors").is_file() and (directory / "config.json").is_file()
    assert [p for p, _ in fake.requests if p not in ("/generate",)][-3:] == [
        "/pause_generation", "/update_weights_from_disk", "/continue_generation"]
    assert fake.bodies("/pause_generation")[-1] == {"mode": "in_place"}
    decode = ray.get_actor("decode-0", namespace=mesh.ray_namespace)
    assert await decode.current_version.remote() == version == int(fake.label)
