"""The trainer's plain logic (``TrainerLogic``) with the real torch backend on the demo model and a
recording bus: handlers run concurrently, as the shell runs them, until a step is reached."""

from __future__ import annotations

import asyncio
import hashlib
import math
from pathlib import Path

import msgspec
import pytest
import torch

from support.fakes import RecordingPublisher
from rollmesh.ports import MessageContext
from rollmesh.checkpoint import ResharderLogic, read_hf_checkpoint
from rollmesh.config import ModelConfig, ResharderConfig, TrainerConfig
from rollmesh.engine.weight_buckets import load_published, read_manifest
from rollmesh.messages import RolloutCompleted, RolloutFailed, TokenTrace
from rollmesh.messages.subjects import (
    CHECKPOINT_SAVED,
    GROUP_DROPPED,
    ROLLOUT_COMPLETED,
    TRAINER_STEPPED,
    WEIGHTS_PUBLISHED,
)
from rollmesh.rollout.molar_mass import MolarMassTask
from rollmesh.training.torch_backend import TorchTrainerBackend
from rollmesh.training.checkpoint_retention import prune_checkpoints
from rollmesh.training.ledger import TrainingLedger
from rollmesh.training.trainer_logic import TrainerLogic

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

STEP_TIMEOUT_S = 30.0  # a guard against a hang, never a timing assertion
# Ids of the demo model's vocabulary (a prompt of three, a turn of four); what they spell is
# irrelevant to the trainer.
TOKENS = [5, 81, 58, 32, 65, 58, 7]


def build_trainer(run_dir: Path, bus: RecordingPublisher, model: ModelConfig, **config) -> TrainerLogic:
    torch.set_num_threads(1)
    trainer_config = TrainerConfig(**{"lr": 1e-3, "n_samples_per_prompt": 2, "groups_per_step": 1, "ppo_epochs": 1, **config})
    return TrainerLogic(trainer_config, model, TorchTrainerBackend(model, trainer_config), bus,
                        run_dir=run_dir, clock=lambda: 500.0)


@pytest.fixture
def trainer(tmp_path: Path, demo_model_dir: Path):
    """``trainer(bus, **trainer_config)``: a TrainerLogic on the demo model, run dir ``tmp_path``."""
    return lambda bus, **config: build_trainer(tmp_path, bus, ModelConfig(path=str(demo_model_dir)), **config)


def completed(rollout_id: str, group_id: str, reward: float, *, version: int = 0,
              purpose: str = "train") -> RolloutCompleted:
    tokens = list(TOKENS)
    return RolloutCompleted(
        rollout_id=rollout_id, task="molar_mass", group_id=group_id, purpose=purpose, reward=reward,
        turns=1, tool_calls=0, prompt_len=3, tokens=tokens, loss_mask=[0, 0, 0, 1, 1, 1, 1],
        logprobs=[0.0, 0.0, 0.0, -5.5, -5.6, -5.4, -5.5], versions=[-1, -1, -1] + [version] * 4,
    )


def failed(rollout_id: str, group_id: str) -> RolloutFailed:
    return RolloutFailed(rollout_id=rollout_id, kind="sandbox_error", reason="broker down", group_id=group_id)


def context() -> MessageContext:
    return MessageContext(subject=ROLLOUT_COMPLETED.format("test"))


def record_policy_steps(logic: TrainerLogic) -> tuple[list, list[dict]]:
    """(samples, stats): what each of the backend's policy steps is given and returns, from now on."""
    samples: list = []
    stats: list[dict] = []
    policy_step = logic.backend.policy_step

    def recording(step_samples, **kwargs):
        samples.extend(step_samples)
        stats.append(policy_step(step_samples, **kwargs))
        return stats[-1]

    logic.backend.policy_step = recording
    return samples, stats


async def deliver(logic: TrainerLogic, *messages: RolloutCompleted | RolloutFailed) -> list:
    """Deliver messages concurrently (as the shell does) and wait until every handler returned."""
    handlers = [logic.handle_completed(m, context()) if isinstance(m, RolloutCompleted)
                else logic.handle_failed(m, context()) for m in messages]
    return await asyncio.wait_for(asyncio.gather(*handlers, return_exceptions=True), STEP_TIMEOUT_S)


async def test_trajectories_are_acked_only_after_the_step_that_consumed_them_published_its_weights(trainer):
    bus = RecordingPublisher()
    logic = trainer(bus)
    bus.hold(WEIGHTS_PUBLISHED)
    handlers = [asyncio.create_task(logic.handle_completed(m, context()))
                for m in (completed("a", "g", 1.0), completed("b", "g", 0.0))]

    (weights,) = await asyncio.wait_for(bus.wait_published(WEIGHTS_PUBLISHED), STEP_TIMEOUT_S)
    assert not any(handler.done() for handler in handlers)
    assert Path(weights.path).is_file()  # durable before anyone hears of it

    bus.release(WEIGHTS_PUBLISHED)
    assert await asyncio.wait_for(asyncio.gather(*handlers), STEP_TIMEOUT_S) == [None, None]


async def test_a_redelivered_rollout_is_not_trained_twice(trainer):
    bus = RecordingPublisher()
    logic = trainer(bus)
    await deliver(logic, completed("a", "g", 1.0), completed("b", "g", 0.0))

    # The redelivery returns (is acked) at once and joins no group (re-admitted, it would open a
    # new group "g" and wait there for a partner).
    assert await deliver(logic, completed("a", "g", 1.0)) == [None]
    assert logic.buffer.open_groups() == 0 and logic.buffer.ready == []
    assert len(bus.messages(TRAINER_STEPPED)) == 1


def split_completed(rollout_id: str, group_id: str, reward: float, **fields) -> RolloutCompleted:
    """A rollout that history_rewrite = "split" made two samples: ``completed``'s, and a second whose
    prompt is a whole render (forced) followed by a turn of version 0."""
    later = TokenTrace(ids=[5, 81, 58, 40, 41], loss_mask=[0, 0, 0, 1, 1], logprobs=[0.0, 0.0, 0.0, -5.5, -5.4],
                       versions=[-1, -1, -1, 0, 0])
    return msgspec.structs.replace(completed(rollout_id, group_id, reward), split_samples=[later], **fields)


async def test_a_split_rollout_trains_each_of_its_samples_once_and_its_redelivery_nothing(trainer):
    bus = RecordingPublisher()
    logic = trainer(bus)
    await deliver(logic, split_completed("a", "g", 1.0), completed("b", "g", 0.0))
    (step,) = bus.messages(TRAINER_STEPPED)
    assert (step.num_samples, step.num_rollouts, step.num_groups) == (3, 2, 1)

    # Redelivered (a worker re-published its outcome): acked, admitted nowhere, trained never.
    assert await deliver(logic, split_completed("a", "g", 1.0)) == [None]
    assert logic.buffer.open_groups() == 0 and logic.buffer.ready == []
    assert len(bus.messages(TRAINER_STEPPED)) == 1 and logic.stats()["duplicates"] == 1


async def test_a_split_rollout_stored_in_the_object_store_is_fetched_whole_at_admission(trainer, tmp_path,
                                                                                       demo_model_dir):
    from rollmesh.rollout.trajectory_offload import InMemoryTrajectories, place_traces

    store = InMemoryTrajectories()
    inline = split_completed("a", "g", 1.0)
    carried = await place_traces("a", "completed", inline.token_traces(), inline_bytes=1, store=store)
    stored = msgspec.structs.replace(inline, tokens=[], loss_mask=[], logprobs=[], versions=[], **carried)
    assert stored.split_sample_refs and stored.trajectory is None
    bus = RecordingPublisher()
    logic = build_trainer(tmp_path, bus, ModelConfig(path=str(demo_model_dir)))
    logic.trajectories = store
    await deliver(logic, stored, completed("b", "g", 0.0))
    (step,) = bus.messages(TRAINER_STEPPED)
    assert (step.num_samples, step.num_rollouts) == (3, 2)


async def test_eval_completions_are_ignored(trainer):
    bus = RecordingPublisher()
    logic = trainer(bus)
    assert await deliver(logic, completed("e1", "g", 1.0, purpose="eval"),
                         completed("e2", "g", 0.0, purpose="eval")) == [None, None]
    assert bus.published == []
    assert logic.stats()["open_groups"] == 0 and logic.step == 0


async def test_eval_failures_are_ignored(trainer):
    bus = RecordingPublisher()
    logic = trainer(bus, n_samples_per_prompt=1)
    eval_failure = RolloutFailed(rollout_id="e", kind="inference_error", reason="x", purpose="eval")
    assert await deliver(logic, eval_failure) == [None]
    assert bus.published == []


async def test_trajectories_beyond_max_staleness_are_counted_as_dropped_and_not_trained(trainer):
    bus = RecordingPublisher()
    logic = trainer(bus, n_samples_per_prompt=3, max_staleness=0)
    await deliver(logic, completed("a", "g1", 1.0), completed("b", "g1", 0.0), completed("c", "g1", 0.0))
    assert logic.version == 1

    # "s" was generated by version 0 (lag 1 > max_staleness 0); its reward must not count.
    await deliver(logic, completed("s", "g2", 1.0, version=0), completed("f1", "g2", 1.0, version=1),
                  completed("f2", "g2", 0.0, version=1))
    step = bus.messages(TRAINER_STEPPED)[-1]
    assert (step.dropped_stale, step.num_samples, step.max_generation_lag) == (1, 2, 0)
    assert step.reward_mean == pytest.approx(0.5)
    assert logic.stats()["dropped_stale"] == 1


async def test_version_lag_within_max_staleness_is_trained_and_reported(trainer):
    bus = RecordingPublisher()
    logic = trainer(bus, max_staleness=1)
    await deliver(logic, completed("a", "g1", 1.0), completed("b", "g1", 0.0))
    await deliver(logic, completed("c", "g2", 1.0, version=0), completed("d", "g2", 0.0, version=1))
    step = bus.messages(TRAINER_STEPPED)[-1]
    assert (step.num_samples, step.max_generation_lag, step.dropped_stale) == (2, 1, 0)


async def test_a_failed_member_is_masked_out_of_the_group_statistics(trainer):
    bus = RecordingPublisher()
    logic = trainer(bus, n_samples_per_prompt=3)
    assert await deliver(logic, completed("a", "g", 1.0), completed("b", "g", 0.0), failed("x", "g")) == [None] * 3

    (step,) = bus.messages(TRAINER_STEPPED)
    assert step.num_samples == 2
    assert step.reward_mean == pytest.approx(0.5)  # not 1/3: a failure is not a zero reward


async def test_truncated_rollouts_are_masked_and_counted_when_overlong_is_mask(trainer):
    bus = RecordingPublisher()
    logic = trainer(bus, n_samples_per_prompt=3, overlong="mask")
    cut = msgspec.structs.replace(completed("t", "g", 1.0), finish_reason="truncated")
    assert await deliver(logic, completed("a", "g", 1.0), completed("b", "g", 0.0), cut) == [None] * 3

    (step,) = bus.messages(TRAINER_STEPPED)
    assert step.num_samples == 2
    assert step.reward_mean == pytest.approx(0.5)  # its reward of 1.0 is masked out, as a failure's
    assert logic.stats()["skipped_truncated"] == 1


async def test_truncated_rollouts_are_trained_by_default(trainer):
    bus = RecordingPublisher()
    logic = trainer(bus)
    cut = msgspec.structs.replace(completed("t", "g", 1.0), finish_reason="truncated")
    assert await deliver(logic, cut, completed("b", "g", 0.0)) == [None, None]

    (step,) = bus.messages(TRAINER_STEPPED)
    assert (step.num_samples, logic.stats()["skipped_truncated"]) == (2, 0)


async def test_truncated_rollouts_train_with_the_overlong_penalty_as_their_reward(trainer):
    bus = RecordingPublisher()
    logic = trainer(bus, n_samples_per_prompt=3, overlong="penalty", overlong_penalty=-2.0)
    cut = msgspec.structs.replace(completed("t", "g", 1.0), finish_reason="truncated")
    assert await deliver(logic, completed("a", "g", 1.0), completed("b", "g", 0.0), cut) == [None] * 3

    (step,) = bus.messages(TRAINER_STEPPED)
    assert step.num_samples == 3
    assert step.reward_mean == pytest.approx((1.0 + 0.0 - 2.0) / 3)  # not (1 + 0 + 1) / 3


async def test_dynamic_sampling_drops_a_uniform_group_announces_it_and_records_it_with_the_next_step(trainer, tmp_path):
    bus = RecordingPublisher()
    logic = trainer(bus, drop_uniform_groups=True)
    # All right: nothing to learn. It does not make a step; it is announced at once.
    uniform = asyncio.ensure_future(deliver(logic, completed("a", "rl/0/1", 1.0), completed("b", "rl/0/1", 1.0)))
    async def announced() -> None:
        while not bus.messages(GROUP_DROPPED):
            await asyncio.sleep(0.01)  # polls the recording bus; the wait is bounded below

    await asyncio.wait_for(announced(), STEP_TIMEOUT_S)
    (dropped,) = bus.messages(GROUP_DROPPED)
    assert (dropped.group_id, dropped.reward) == ("rl/0/1", 1.0)
    assert bus.messages(TRAINER_STEPPED) == [] and not uniform.done()  # un-acked until a step records it

    await deliver(logic, completed("c", "rl/0/2", 1.0), completed("d", "rl/0/2", 0.0))
    assert await uniform == [None, None]
    (step,) = bus.messages(TRAINER_STEPPED)
    assert (step.num_groups, step.dropped_groups, step.num_samples) == (2, 1, 2)
    assert sorted(step.groups) == ["rl/0/1", "rl/0/2"]
    state = TrainingLedger(tmp_path / "trainer" / "ledger.jsonl").read()
    assert sorted(state.last.groups) == ["rl/0/1", "rl/0/2"]
    assert state.consumed == {"a", "b", "c", "d"}


def test_keep_checkpoints_removes_all_but_the_newest_with_their_training_state(tmp_path):
    for step in (2, 4, 6):
        (tmp_path / f"iter_{step:07d}").mkdir()
        (tmp_path / f"iter_{step:07d}" / "common.pt").write_bytes(b"x")
        (tmp_path / f"step_{step:08d}.trainer_state.pt").write_bytes(b"x")
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("6")
    assert prune_checkpoints(tmp_path, 2) == [2]
    assert sorted(path.name for path in tmp_path.iterdir()) == [
        "iter_0000004", "iter_0000006", "latest_checkpointed_iteration.txt",
        "step_00000004.trainer_state.pt", "step_00000006.trainer_state.pt"]
    assert prune_checkpoints(tmp_path, 0) == []  # 0: keep all


async def test_a_group_whose_rewards_are_all_equal_contributes_no_samples_and_publishes_no_weights(trainer):
    bus = RecordingPublisher()
    logic = trainer(bus)
    assert await deliver(logic, completed("a", "g", 1.0), completed("b", "g", 1.0)) == [None, None]

    (step,) = bus.messages(TRAINER_STEPPED)
    assert (step.step, step.num_samples, step.weight_version, step.reward_mean) == (1, 0, 0, 1.0)
    assert bus.messages(WEIGHTS_PUBLISHED) == []


async def test_weights_published_versions_increase_by_one_per_step_and_the_file_matches_its_sha256(trainer):
    bus = RecordingPublisher()
    logic = trainer(bus)
    await deliver(logic, completed("a", "g1", 1.0), completed("b", "g1", 0.0))
    await deliver(logic, completed("c", "g2", 0.0), completed("d", "g2", 1.0))

    published = bus.messages(WEIGHTS_PUBLISHED)
    assert [message.version for message in published] == [1, 2]
    assert [step.weight_version for step in bus.messages(TRAINER_STEPPED)] == [1, 2]
    for message in published:  # the manifest is what the sha256 covers; it covers the buckets
        manifest = read_manifest(Path(message.path), message.sha256)
        assert manifest.version == message.version
        for bucket in manifest.buckets:
            data = (Path(message.path).parent / bucket.file).read_bytes()
            assert hashlib.sha256(data).hexdigest() == bucket.sha256
        assert sum(len((Path(message.path).parent / b.file).read_bytes()) for b in manifest.buckets) == message.num_bytes
    newest = load_published(published[-1].path, published[-1].sha256)
    for name, tensor in logic.backend.state_dict().items():
        assert torch.equal(newest[name], tensor)


async def test_weights_published_by_a_step_name_that_step(trainer):
    bus = RecordingPublisher()
    logic = trainer(bus)
    await deliver(logic, completed("a", "g1", 1.0), completed("b", "g1", 0.0))

    (weights,), (step,) = bus.messages(WEIGHTS_PUBLISHED), bus.messages(TRAINER_STEPPED)
    assert weights.version == step.weight_version
    assert weights.trainer_step == step.step, (
        f"weights v{weights.version} were produced by trainer step {step.step} but claim "
        f"trainer_step={weights.trainer_step}")


async def test_trainer_stepped_reward_mean_averages_all_admitted_members_of_the_step(trainer):
    bus = RecordingPublisher()
    logic = trainer(bus, groups_per_step=2)
    await deliver(logic, completed("a", "g1", 1.0), completed("b", "g1", 0.0),
                  completed("c", "g2", 1.0), completed("d", "g2", 1.0))

    (step,) = bus.messages(TRAINER_STEPPED)
    assert (step.num_groups, step.num_samples) == (2, 2)  # g2's equal rewards teach nothing...
    assert step.reward_mean == pytest.approx(0.75)  # ...but its rewards are part of the mean
    assert math.isfinite(step.loss)


async def test_a_step_whose_weights_cannot_be_written_naks_its_trajectories_and_trains_their_redelivery(tmp_path, trainer):
    bus = RecordingPublisher()
    logic = trainer(bus)
    (tmp_path / "weights").write_text("not a directory")  # the weights folder cannot be created

    outcomes = await deliver(logic, completed("a", "g", 1.0), completed("b", "g", 0.0))
    assert all(isinstance(outcome, Exception) for outcome in outcomes)  # nak'ed, so redelivered
    assert bus.messages(WEIGHTS_PUBLISHED) == [] and bus.messages(TRAINER_STEPPED) == []

    (tmp_path / "weights").unlink()
    assert await deliver(logic, completed("a", "g", 1.0), completed("b", "g", 0.0)) == [None, None]
    (step,) = bus.messages(TRAINER_STEPPED)
    assert [m.version for m in bus.messages(WEIGHTS_PUBLISHED)] == [step.weight_version]
    assert (step.weight_version, step.max_generation_lag) == (1, 0), (
        f"the failed step advanced the version counter to {logic.version - 1} without publishing it, "
        f"so the redelivered trajectories (made by v0) count a version lag of {step.max_generation_lag}")


async def test_save_checkpoint_publishes_a_megatron_checkpoint_of_the_trained_weights(tmp_path, trainer, demo_model_dir):
    bus = RecordingPublisher()
    logic = trainer(bus)
    await deliver(logic, completed("a", "g", 1.0), completed("b", "g", 0.0))
    saved = await logic.save_checkpoint()

    assert bus.messages(CHECKPOINT_SAVED) == [saved]
    assert (saved.format, saved.step, saved.weight_version) == ("megatron_torch_dist", 1, 1)
    # The model directory rides along (the resharder copies its tokenizer into the export); only
    # scalar settings do: the wire field holds no nested values.
    assert saved.model_config["path"] == str(demo_model_dir)
    assert "chat_template_kwargs" not in saved.model_config
    converted = ResharderLogic(ResharderConfig(), export_root=tmp_path / "hf").convert(saved)
    exported, trained = read_hf_checkpoint(Path(converted.hf_path)), logic.backend.state_dict()
    trained.pop("lm_head.weight", None)  # tied to the embeddings: HF leaves it out
    assert exported.keys() == trained.keys()
    assert all(torch.equal(exported[name], trained[name]) for name in trained)


async def test_checkpoint_every_saves_after_that_many_steps(trainer):
    bus = RecordingPublisher()
    logic = trainer(bus, checkpoint_every=2)
    await deliver(logic, completed("a", "g1", 1.0), completed("b", "g1", 0.0))
    assert bus.messages(CHECKPOINT_SAVED) == []
    await deliver(logic, completed("c", "g2", 1.0), completed("d", "g2", 0.0))
    assert [saved.step for saved in bus.messages(CHECKPOINT_SAVED)] == [2]


async def test_warm_start_trains_on_demonstrations_and_publishes_a_version(trainer):
    bus = RecordingPublisher()
    logic = trainer(bus)
    before = logic.backend.state_dict()
    result = await logic.warm_start(MolarMassTask(), steps=2, batch_size=4, lr=1e-3, exact_fraction=0.5, seed=0)

    (weights,) = bus.messages(WEIGHTS_PUBLISHED)
    assert result["weight_version"] == weights.version == 1 == logic.version
    assert math.isfinite(result["loss"])
    published = load_published(weights.path, weights.sha256)
    assert any(not torch.equal(published[name], before[name]) for name in before)


async def test_sft_step_trains_whole_chat_conversations_with_the_models_tokens(trainer):
    logic = trainer(RecordingPublisher())
    task = MolarMassTask()
    conversation = [*task.messages({"formula": "H2O"}),
                    {"role": "assistant", "content": "",
                     "tool_calls": [{"id": "c1", "type": "function",
                                     "function": {"name": "calc", "arguments": '{"formula": "H2O"}'}}]},
                    {"role": "tool", "tool_call_id": "c1", "content": "18.015"},
                    {"role": "assistant", "content": "18.015"}]
    trained: list = []
    sft_step = logic.backend.sft_step

    def recording(sequences, **kwargs):
        trained.extend(sequences)
        return sft_step(sequences, **kwargs)

    logic.backend.sft_step = recording
    losses = [await logic.sft_step([(conversation, task.tools())], lr=1e-2) for _ in range(3)]
    assert losses[-1] < losses[0]  # the same conversation, learnt
    ids, mask = trained[0]
    chat = await logic._chat_model()
    assert chat.decode([i for i, m in zip(ids, mask) if m]) == (
        '<tool_call>\n{"name": "calc", "arguments": {"formula": "H2O"}}\n</tool_call><|im_end|>18.015<|im_end|>')


async def test_warm_start_of_zero_steps_publishes_nothing(trainer):
    bus = RecordingPublisher()
    logic = trainer(bus)
    result = await logic.warm_start(MolarMassTask(), steps=0, batch_size=4, lr=1e-3, exact_fraction=0.5, seed=0)
    assert bus.published == [] and result["weight_version"] == 0


async def test_a_moe_rollouts_recorded_expert_rows_reach_the_policy_step(trainer):
    import numpy as np

    from rollmesh.rollout.routed_experts import InMemoryRoutedExperts

    store = InMemoryRoutedExperts()
    logic = trainer(RecordingPublisher())
    logic.routed_experts = store
    rows = {rid: np.full((6, 1, 2), index, dtype=np.uint16) for index, rid in enumerate("ab")}
    refs = {rid: await store.save_turn(rid, 0, 0, rows[rid]) for rid in "ab"}
    trained, _ = record_policy_steps(logic)
    messages = [msgspec.structs.replace(completed(rid, "g", reward), routed_experts_ref=refs[rid])
                for rid, reward in (("a", 1.0), ("b", 0.0))]
    assert await deliver(logic, *messages) == [None, None]
    assert sorted(int(sample.routed_experts[0, 0, 0]) for sample in trained) == [0, 1]
    assert all(np.array_equal(sample.routed_experts, rows[rid]) for sample, rid in zip(trained, "ab"))


async def test_the_rollouts_sampling_temperature_reaches_the_policy_step(trainer):
    logic = trainer(RecordingPublisher())
    trained, _ = record_policy_steps(logic)
    messages = [msgspec.structs.replace(completed(rid, "g", reward), temperature=0.7)
                for rid, reward in (("a", 1.0), ("b", 0.0))]
    assert await deliver(logic, *messages) == [None, None]
    assert [sample.temperature for sample in trained] == [0.7, 0.7]


async def test_trainer_stepped_carries_the_policy_steps_logprob_mismatch(trainer):
    logic = trainer(bus := RecordingPublisher())
    _, reported = record_policy_steps(logic)
    assert await deliver(logic, completed("a", "g1", 1.0), completed("b", "g1", 0.0)) == [None, None]
    assert await deliver(logic, completed("c", "g2", 1.0), completed("d", "g2", 1.0)) == [None, None]
    trained, untrained = bus.messages(TRAINER_STEPPED)
    assert trained.logprob_mismatch == reported[0]["logprob_mismatch"] and trained.logprob_mismatch > 0
    assert untrained.num_samples == 0 and untrained.logprob_mismatch is None


# -- trainer.weight_sync = "memory" ------------------------------------------------------------


class HeldBuckets:
    """The trainer's shared-memory seam (``HoldsWeightBuckets``) as a dict of serialised versions."""

    def __init__(self) -> None:
        self.held = {}

    def put_buckets(self, version, buckets):
        pass  # put with the manifest below

    def put(self, serialized):
        from rollmesh.engine.weight_memory import MemoryLocation

        self.held[serialized.version] = serialized
        return MemoryLocation("trainer", "node-a")


def memory_trainer(run_dir: Path, bus: RecordingPublisher, model_dir: Path, memory: HeldBuckets,
                   latest=None) -> TrainerLogic:
    torch.set_num_threads(1)
    config = TrainerConfig(lr=1e-3, n_samples_per_prompt=2, groups_per_step=1, ppo_epochs=1, weight_sync="memory")
    model = ModelConfig(path=str(model_dir))
    return TrainerLogic(config, model, TorchTrainerBackend(model, config), bus, run_dir=run_dir, clock=lambda: 500.0,
                        memory=memory, latest_weights=latest)


async def test_in_memory_mode_a_version_is_announced_from_memory_before_its_files_exist_then_written(
        tmp_path, demo_model_dir):
    bus, memory = RecordingPublisher(), HeldBuckets()
    logic = memory_trainer(tmp_path, bus, demo_model_dir, memory)
    bus.hold(WEIGHTS_PUBLISHED)
    step = asyncio.create_task(deliver(logic, completed("a", "g1", 1.0), completed("b", "g1", 0.0)))
    (announced,) = await asyncio.wait_for(bus.wait_published(WEIGHTS_PUBLISHED), STEP_TIMEOUT_S)
    assert (announced.version, announced.memory_holder, announced.memory_node) == (1, "trainer", "node-a")
    assert not Path(announced.path).exists(), "announced only after the files were written"
    assert announced.sha256 == memory.held[1].manifest_sha256
    bus.release(WEIGHTS_PUBLISHED)
    assert await step == [None, None]

    (stepped,) = bus.messages(TRAINER_STEPPED)
    assert stepped.weight_version == 1 and bus.messages(WEIGHTS_PUBLISHED) == [announced]  # announced once
    from_files = load_published(announced.path, announced.sha256)  # durable, the same bytes
    assert all(torch.equal(from_files[k], t) for k, t in logic.backend.state_dict().items())
    assert TrainingLedger(tmp_path / "trainer" / "ledger.jsonl").read().last.weights_path == announced.path


async def test_a_trainer_resumed_in_memory_mode_numbers_past_a_version_announced_but_never_recorded(
        tmp_path, demo_model_dir):
    first_bus = RecordingPublisher()
    first = memory_trainer(tmp_path, first_bus, demo_model_dir, HeldBuckets())
    await deliver(first, completed("a", "g1", 1.0), completed("b", "g1", 0.0))
    (recorded,) = first_bus.messages(WEIGHTS_PUBLISHED)
    # Version 2 was announced, then the trainer died before its ledger line.
    lost = msgspec.structs.replace(recorded, version=2)

    async def latest():
        return lost

    bus = RecordingPublisher()
    resumed = memory_trainer(tmp_path, bus, demo_model_dir, HeldBuckets(), latest=latest)
    await resumed.start()
    assert resumed.version == 1  # the weights it holds are the ledger's
    await deliver(resumed, completed("c", "g2", 1.0), completed("d", "g2", 0.0))
    assert [m.version for m in bus.messages(WEIGHTS_PUBLISHED)] == [1, 3]  # the re-announcement, then past 2


# -- trainer.weight_sync = "nccl" / "ipc": pushed into SGLang servers ---------------------------


class BrokenPush:
    """The push seam (``PushesWeights``) whose servers fail mid-broadcast."""

    method = "nccl"

    async def push(self, state_dict, version):
        from rollmesh.engine.errors import WeightSyncError

        raise WeightSyncError(version, self.method, "bucket 2 of 3: connection reset")


async def test_a_failed_push_is_logged_typed_and_the_version_still_announced_as_files(trainer):
    from structlog.testing import capture_logs

    logic = trainer(bus := RecordingPublisher(), weight_sync="nccl")
    logic.push = BrokenPush()
    with capture_logs() as logs:
        assert await deliver(logic, completed("a", "g1", 1.0), completed("b", "g1", 0.0)) == [None, None]
    (announced,) = bus.messages(WEIGHTS_PUBLISHED)
    assert announced.version == 1 and load_published(announced.path, announced.sha256)  # the fallback
    (failure,) = [line for line in logs if line["event"] == "weights_push_failed"]
    assert (failure["weight_version"], failure["method"], failure["fallback"]) == (1, "nccl", "files")
    assert "connection reset" in failure["reason"] and logic.stats()["push_failures"] == 1
