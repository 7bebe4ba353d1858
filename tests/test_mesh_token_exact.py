"""A real multi-turn tool-calling rollout through the mesh on a Qwen3-template model, token-exact.

The model is the tests' tiny Qwen2-weights directory with Qwen3's real chat template (thinking on,
its default), made to follow one molar-mass conversation under greedy decoding by a short
supervised fit here (plain torch on the engine's own CausalLM, loss on the assistant's tokens of
the conversation as ``warm_start.conversation_sequence`` tokenizes it). A mesh of its own (the
session's NATS and Ray, no declared accelerators) serves that directory with strict tokenization;
one greedy rollout runs: reasoning, a ``calc`` call in the sandbox, its result, reasoning, the
answer. The completed trajectory is then recomputed with the same weights in one full forward:
each generated id must be the greedy choice there, with the logprob the engine reported.
"""

from __future__ import annotations

import asyncio
import random
import shutil
import uuid
from pathlib import Path

import msgspec
import nats
import pytest
import torch

from rollmesh.chat import ChatModel
from rollmesh.engine.models import load_hf_model
from rollmesh.launcher import Mesh
from rollmesh.mesh_address import new_run_dir
from rollmesh.messages import RolloutCompleted, RolloutFailed, RolloutRequested, SamplingParams
from rollmesh.messages.subjects import ROLLOUT_COMPLETED, ROLLOUT_FAILED, ROLLOUT_REQUESTED
from rollmesh.messages.token_trace import NO_VERSION
from rollmesh.rollout.molar_mass import MolarMassTask
from rollmesh.training.warm_start import conversation_sequence
from conftest import REPO_ROOT
from support.fitted_models import fit_to_samples

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

FORMULA = "H2O"
# Qwen3's own default, named so the model config carries template arguments as a user's would.
TEMPLATE_KWARGS = {"enable_thinking": True}
# Non-empty reasoning in every turn: Qwen3 keeps it in a whole render of the conversation (it
# drops only empty or pre-query reasoning), so the trajectory must equal that render exactly.
REASONING = ("I will ask calc.", "calc answered.")
FIT_MAX_STEPS = 400
# Every assistant token must win greedy decoding by at least this many logits: far above the
# float noise between the engine's paged decode and one full forward.
# fp32: the engine's incremental, paged forward against one full forward of the same weights.
LOGPROB_ATOL = 1e-4
ROLLOUT_TIMEOUT_S = 300.0


def demonstrated_conversation() -> list[dict]:
    """The molar-mass task's correct episode with reasoning in each assistant turn."""
    task = MolarMassTask()
    task_input = {"formula": FORMULA}
    follow = task.demonstration(task_input, exact=True, rng=random.Random(0))
    assistant_turns = [message for message in follow if message["role"] == "assistant"]
    assert len(assistant_turns) == len(REASONING)
    for message, reasoning in zip(assistant_turns, REASONING):
        message["reasoning_content"] = reasoning
    return [*task.messages(task_input), *follow]


@pytest.fixture(scope="module")
def tool_calling_qwen3_dir(chat_model_dir_with_weights: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the session's Qwen3-template directory whose weights follow the conversation."""
    model_dir = tmp_path_factory.mktemp("token-exact") / "qwen3-tool-calling"
    shutil.copytree(chat_model_dir_with_weights, model_dir)
    chat = ChatModel.load(model_dir, template_kwargs=TEMPLATE_KWARGS)
    ids, loss_mask = conversation_sequence(chat, demonstrated_conversation(), tools=MolarMassTask().tools())
    # One thread: a model this small trains several times faster on one than with two threads
    # contending on a loaded machine.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        fit_to_samples(model_dir, [(ids, loss_mask)], chat.vocab_size, max_steps=FIT_MAX_STEPS)
    finally:
        torch.set_num_threads(threads)
    return model_dir


@pytest.fixture(scope="module")
async def token_exact_mesh(tool_calling_qwen3_dir: Path, nats_server, ray_session):
    """A mesh of its own serving that directory; it asks for no accelerators (the session's mesh
    may hold every declared one)."""
    from rollmesh.config import load_config

    config = load_config(overrides={
        "namespace": "exact" + uuid.uuid4().hex[:8],
        "nats.url": nats_server.url,
        "serve.enabled": False,
        "scheduler.total_gpus": 0,
        "scheduler.grants": {},
        "model.path": str(tool_calling_qwen3_dir),
        "model.chat_template_kwargs": TEMPLATE_KWARGS,
        # A difference from a whole render in text the model did not generate fails the rollout.
        "rollout.strict_tokenization": True,
    })
    mesh = Mesh(config, run_dir=new_run_dir(REPO_ROOT / ".rollmesh" / "test-runs"))
    info = await mesh.start()
    yield info
    await mesh.stop()


async def run_rollout(info, request: RolloutRequested) -> RolloutCompleted | RolloutFailed:
    """Publish ``request`` and wait for its completion or failure."""
    outcome: asyncio.Future[RolloutCompleted | RolloutFailed] = asyncio.get_running_loop().create_future()

    async def on_result(msg) -> None:
        subject = ROLLOUT_COMPLETED if msg.subject.endswith(".completed") else ROLLOUT_FAILED
        result = subject.decode(msg.data)
        if result.rollout_id == request.rollout_id and not outcome.done():
            outcome.set_result(result)

    nc = await nats.connect(info.nats_url)
    try:
        for subject in (ROLLOUT_COMPLETED, ROLLOUT_FAILED):
            await nc.subscribe(subject.format(info.namespace), cb=on_result)
        await nc.jetstream().publish(ROLLOUT_REQUESTED.format(info.namespace), ROLLOUT_REQUESTED.encode(request))
        return await asyncio.wait_for(outcome, ROLLOUT_TIMEOUT_S)
    finally:
        await nc.close()


def assistant_segments(loss_mask: list[int]) -> list[tuple[int, int]]:
    """(start, end) of each run of generated positions: one per assistant turn."""
    segments, start = [], None
    for position, mask in enumerate([*loss_mask, 0]):
        if mask and start is None:
            start = position
        elif not mask and start is not None:
            segments.append((start, position))
            start = None
    return segments


async def test_greedy_tool_rollout_keeps_every_sampled_id_with_its_logprob(token_exact_mesh,
                                                                           tool_calling_qwen3_dir):
    request = RolloutRequested(rollout_id="exact-" + uuid.uuid4().hex[:8], task="molar_mass",
                               task_input={"formula": FORMULA}, max_turns=3,
                               sampling=SamplingParams(temperature=0.0, max_new_tokens=96))
    result = await run_rollout(token_exact_mesh, request)
    assert isinstance(result, RolloutCompleted), msgspec.json.encode(result).decode()
    chat = ChatModel.load(tool_calling_qwen3_dir, template_kwargs=TEMPLATE_KWARGS)
    trace = result.token_trace()
    text = chat.decode(trace.ids)

    # A real multi-turn tool rollout, ended by the model, equal to a whole render of itself (the
    # fitted model writes the very tokens its one conversation was encoded into, so not even an
    # assistant-kind re-tokenization difference is expected; {} would mean it went unchecked).
    assert result.tool_calls >= 1 and result.turns >= 2 and result.malformed_tool_calls == 0, text
    assert result.finish_reason == "stop", text
    assert result.tokenization_mismatches == {"special": 0, "non_assistant": 0, "assistant": 0,
                                              "history_rewrite": 0}, text
    segments = assistant_segments(trace.loss_mask)
    assert len(segments) == result.turns, (segments, text)
    assert all(trace.ids[end - 1] in chat.end_of_turn_ids for _, end in segments), text
    assert segments[0][0] == result.prompt_len

    # Generated positions carry a weight version (one: no swap happened) and a logprob; the
    # prompt, tool results and template joins carry neither.
    generated = [position for position, mask in enumerate(trace.loss_mask) if mask]
    masked = [position for position, mask in enumerate(trace.loss_mask) if not mask]
    assert {trace.versions[p] for p in generated} == {result.weight_version}
    assert result.weight_version != NO_VERSION
    assert all(trace.versions[p] == NO_VERSION and trace.logprobs[p] == 0.0 for p in masked)

    # The same weights over the whole trajectory: each generated id is the greedy choice, with
    # the logprob the engine reported.
    wrong = not_greedy_or_other_logprob(tool_calling_qwen3_dir, trace, generated, chat)
    assert not wrong, "\n".join(wrong[:20])


def not_greedy_or_other_logprob(model_dir: Path, trace, positions: list[int], chat: ChatModel) -> list[str]:
    """The positions whose id is not what greedy decoding picks from the logits one position
    earlier, or whose logprob is not the model's own log_softmax there: what the engine reports
    for greedy rows (rollmesh/engine/sampling.py), over the tokenizer's ids only (Qwen's padded
    embedding rows are never sampled)."""
    with torch.no_grad():
        logits = load_hf_model(model_dir)(torch.tensor([trace.ids]))[0, :, :chat.vocab_size]
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    wrong = []
    for position in positions:
        row = logprobs[position - 1]
        sampled = trace.ids[position]
        best = int(row.argmax())
        # A tie within float noise may resolve either way between two forwards.
        is_greedy = sampled == best or float(row[best] - row[sampled]) <= LOGPROB_ATOL
        if not is_greedy or abs(trace.logprobs[position] - float(row[sampled])) > LOGPROB_ATOL:
            wrong.append(f"position {position}: id {sampled} {chat.decode([sampled])!r} with logprob "
                         f"{trace.logprobs[position]:.6f}; recomputed {float(row[sampled]):.6f}, greedy id {best} "
                         f"{chat.decode([best])!r} ({float(row[best]):.6f})")
    return wrong
