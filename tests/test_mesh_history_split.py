"""``rollout.history_rewrite = "split"`` through the real mesh: a multi-turn tool rollout on a
Qwen3-template model arrives as several training samples, and the trainer admits and trains them.

The model is the tests' tiny Qwen2-weights directory with Qwen3's real chat template, thinking
off: the generation prompt's empty ``<think></think>`` block is dropped from every earlier
assistant turn, so after the tool result the whole render is no longer an extension of the
sampled tokens and a new sample starts. The weights are fitted here (as in
test_mesh_token_exact.py) so that greedy decoding follows the molar-mass episode on both samples'
prompts: a ``calc`` call, then the answer. A mesh of its own (the session's NATS and Ray, no
declared accelerators, strict tokenization, groups of two, one group per step) runs two greedy
rollouts of one group: one of three turns (call, answer: reward 1, two samples) and one cut at
one turn (call only: reward 0, one sample; its tool result split off with nothing generated after
it is not sent). The step trains three samples of two rollouts.
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
from rollmesh.launcher import Mesh
from rollmesh.mesh_address import new_run_dir
from rollmesh.messages import RolloutCompleted, RolloutRequested, SamplingParams, TrainerStepped
from rollmesh.messages.subjects import ROLLOUT_COMPLETED, ROLLOUT_FAILED, ROLLOUT_REQUESTED, TRAINER_STEPPED
from rollmesh.rollout.molar_mass import MolarMassTask
from rollmesh.training.warm_start import conversation_trajectory
from conftest import REPO_ROOT
from support.fitted_models import fit_to_samples

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

FORMULA = "H2O"
TEMPLATE_KWARGS = {"enable_thinking": False}
FIT_MAX_STEPS = 400
WAIT_S = 300.0


class SplittingChatModel(ChatModel):
    """The model as ``warm_start.conversation_trajectory`` builds its tokens, but split as a
    rollout under ``history_rewrite = "split"`` splits them."""

    def new_trajectory(self, messages, *, tools=None, history_rewrite="keep_sampled", join=None):
        return super().new_trajectory(messages, tools=tools, history_rewrite="split", join=join)


def split_samples(chat: ChatModel) -> list[tuple[list[int], list[int]]]:
    """(ids, loss_mask) of each sample of the task's correct episode, split as a rollout splits it."""
    task = MolarMassTask()
    task_input = {"formula": FORMULA}
    conversation = [*task.messages(task_input), *task.demonstration(task_input, exact=True, rng=random.Random(0))]
    splitting = SplittingChatModel(**{name: getattr(chat, name) for name in chat.__dataclass_fields__})
    trajectory = conversation_trajectory(splitting, conversation, tools=task.tools())
    return [(list(sample.ids), list(sample.loss_mask)) for sample in trajectory.samples]


@pytest.fixture(scope="module")
def splitting_qwen3_dir(chat_model_dir_with_weights: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    model_dir = tmp_path_factory.mktemp("history-split") / "qwen3-thinking-off"
    shutil.copytree(chat_model_dir_with_weights, model_dir)
    chat = ChatModel.load(model_dir, template_kwargs=TEMPLATE_KWARGS)
    samples = split_samples(chat)
    assert len(samples) == 2, "fixture: thinking off, the episode splits once"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a model this small trains faster on one thread on a loaded machine
    try:
        fit_to_samples(model_dir, samples, chat.vocab_size, max_steps=FIT_MAX_STEPS)
    finally:
        torch.set_num_threads(threads)
    return model_dir


@pytest.fixture(scope="module")
async def split_mesh(splitting_qwen3_dir: Path, nats_server, ray_session):
    from rollmesh.config import load_config

    config = load_config(overrides={
        "namespace": "split" + uuid.uuid4().hex[:8],
        "nats.url": nats_server.url,
        "serve.enabled": False,
        "scheduler.total_gpus": 0,
        "scheduler.grants": {},
        "model.path": str(splitting_qwen3_dir),
        "model.chat_template_kwargs": TEMPLATE_KWARGS,
        "rollout.strict_tokenization": True,
        "rollout.history_rewrite": "split",
        "trainer.n_samples_per_prompt": 2,
        "trainer.groups_per_step": 1,
    })
    mesh = Mesh(config, run_dir=new_run_dir(REPO_ROOT / ".rollmesh" / "test-runs"))
    info = await mesh.start()
    yield info
    await mesh.stop()


async def test_a_split_rollout_arrives_as_several_samples_and_the_trainer_trains_each(split_mesh,
                                                                                     splitting_qwen3_dir):
    group = "split-" + uuid.uuid4().hex[:8]
    sampling = SamplingParams(temperature=0.0, max_new_tokens=96)
    answered = RolloutRequested(rollout_id=f"{group}-answered", task="molar_mass", task_input={"formula": FORMULA},
                                group_id=group, max_turns=3, sampling=sampling)
    cut = msgspec.structs.replace(answered, rollout_id=f"{group}-cut", max_turns=1)
    loop = asyncio.get_running_loop()
    outcomes: dict[str, asyncio.Future] = {r.rollout_id: loop.create_future() for r in (answered, cut)}
    stepped: asyncio.Future[TrainerStepped] = loop.create_future()

    async def on_outcome(msg) -> None:
        subject = ROLLOUT_COMPLETED if msg.subject.endswith(".completed") else ROLLOUT_FAILED
        result = subject.decode(msg.data)
        if result.rollout_id in outcomes and not outcomes[result.rollout_id].done():
            outcomes[result.rollout_id].set_result(result)

    async def on_stepped(msg) -> None:
        if not stepped.done():
            stepped.set_result(TRAINER_STEPPED.decode(msg.data))

    nc = await nats.connect(split_mesh.nats_url)
    try:
        for subject in (ROLLOUT_COMPLETED, ROLLOUT_FAILED):
            await nc.subscribe(subject.format(split_mesh.namespace), cb=on_outcome)
        await nc.subscribe(TRAINER_STEPPED.format(split_mesh.namespace), cb=on_stepped)
        for request in (answered, cut):
            await nc.jetstream().publish(ROLLOUT_REQUESTED.format(split_mesh.namespace),
                                         ROLLOUT_REQUESTED.encode(request))
        full, short = await asyncio.wait_for(asyncio.gather(*outcomes.values()), WAIT_S)
        step = await asyncio.wait_for(stepped, WAIT_S)
    finally:
        await nc.close()

    chat = ChatModel.load(splitting_qwen3_dir, template_kwargs=TEMPLATE_KWARGS)
    assert isinstance(full, RolloutCompleted), msgspec.json.encode(full).decode()
    assert isinstance(short, RolloutCompleted), msgspec.json.encode(short).decode()
    first, second = full.token_traces()
    text = chat.decode(second.ids)
    assert (full.reward, full.turns, full.tool_calls, full.num_samples) == (1.0, 2, 1, 2), text
    # Each sample is what the fitted episode's split gives: the first ends with the call, the
    # second is the template's whole render of the conversation, then the answer.
    assert [(list(t.ids), list(t.loss_mask)) for t in (first, second)] == split_samples(chat), text
    assert full.tokenization_mismatches == dict.fromkeys(("special", "non_assistant", "assistant",
                                                          "history_rewrite"), 0), text
    assert (short.reward, short.turns, short.num_samples) == (0.0, 1, 1)
    # The group (two rollouts, three samples) was admitted and trained in one step.
    assert (step.num_groups, step.num_rollouts, step.num_samples) == (1, 2, 3)
