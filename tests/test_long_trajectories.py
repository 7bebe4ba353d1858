"""A 128K-token rollout end to end on the real bus (the session's nats-server): its TokenTrace is
stored in the JetStream object store, its RolloutCompleted travels through the results stream
with a reference, a real TrainerLogic fetches the trace at admission, and a policy step trains on
its last 4K tokens on CPU (the real torch backend, the demo model's architecture with a 128K
context). A step on the whole 128K tokens needs a GPU and is marked so."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import msgspec
import pytest
import torch

from support.fakes import RecordingPublisher
from rollmesh.bus.connection import connect_bus
from rollmesh.bus.publisher import BusPublisher
from rollmesh.bus.streams import ensure_streams, rollout_results_stream
from rollmesh.bus.trajectory_store import ObjectStoreTrajectories, trajectories_bucket
from rollmesh.config import ModelConfig, RolloutConfig, TrainerConfig
from rollmesh.messages import NO_VERSION, RolloutCompleted, TokenTrace
from rollmesh.messages.subjects import ROLLOUT_COMPLETED, TRAINER_STEPPED, WEIGHTS_PUBLISHED
from rollmesh.ports import MessageContext, StateStoreError, TrajectoryLostError
from rollmesh.rollout.trajectory_offload import COMPLETED_OBJECT, place_trace, trace_bytes
from rollmesh.training.grpo import PolicySample
from rollmesh.training.torch_backend import TorchTrainerBackend
from rollmesh.training.trainer_logic import TrainerLogic

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

LONG = 128 * 1024
WINDOW = 4 * 1024
VOCAB = 300  # ids below the demo tokenizer's size (byte-level BPE, about 350 ids)
STEP_TIMEOUT_S = 240.0  # a guard against a hang, never a timing assertion


@pytest.fixture(scope="module")
def long_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo model (a 2-layer Qwen2 and its tokenizer) with positions for a 128K-token rollout."""
    from rollmesh.demo.demo_model import DemoModelShape, build_demo_model

    return build_demo_model(tmp_path_factory.mktemp("long-model"), shape=DemoModelShape(max_position_embeddings=LONG))


def long_trace(seed: int, *, length: int = LONG, turns: int = 32) -> TokenTrace:
    """A synthetic multi-turn rollout: a 1K-token prompt, then turns of generated tokens (version
    0, so the trainer at version 0 admits them) each followed by a 1K-token tool output."""
    rng = random.Random(seed)
    ids, mask, logprobs = [rng.randrange(VOCAB) for _ in range(1024)], [0] * 1024, [0.0] * 1024
    versions = [NO_VERSION] * 1024
    per_turn = (length - 1024) // turns
    for turn in range(turns):
        generated = per_turn - 1024 if turn < turns - 1 else length - len(ids)
        ids += [rng.randrange(VOCAB) for _ in range(generated)]
        mask += [1] * generated
        logprobs += [-rng.uniform(0.01, 8.0) for _ in range(generated)]
        versions += [0] * generated
        if turn < turns - 1:
            ids += [rng.randrange(VOCAB) for _ in range(1024)]
            mask += [0] * 1024
            logprobs += [0.0] * 1024
            versions += [NO_VERSION] * 1024
    trace = TokenTrace(ids=ids, loss_mask=mask, logprobs=logprobs, versions=versions)
    assert len(trace) == length
    return trace


def completed(rollout_id: str, reward: float, carried: dict[str, object], trace: TokenTrace) -> RolloutCompleted:
    return RolloutCompleted(rollout_id=rollout_id, task="synthetic", group_id="g-long", purpose="train",
                            reward=reward, turns=32, tool_calls=31, prompt_len=1024, idempotency_key=rollout_id,
                            num_tokens=len(trace), weight_version=trace.last_version(), **carried)  # type: ignore[arg-type]


def window(sample: PolicySample, size: int) -> PolicySample:
    """The sample's last ``size`` tokens, its advantage and versions kept."""
    tail = TokenTrace(ids=sample.tokens, loss_mask=sample.loss_mask, logprobs=sample.logprobs,
                      versions=sample.versions or []).tail(size)
    return PolicySample.from_trace(tail, sample.advantage)


class LastWindowBackend(TorchTrainerBackend):
    """The real torch backend, training each admitted sample's last ``WINDOW`` tokens (a whole
    128K-token sample needs a GPU); it keeps the samples it was given."""

    def __init__(self, *args: object) -> None:
        super().__init__(*args)
        self.admitted: list[PolicySample] = []
        self.trained: list[PolicySample] = []

    def policy_step(self, samples: list[PolicySample], **kwargs: object) -> dict[str, float]:
        self.admitted.extend(samples)
        self.trained = [window(sample, WINDOW) for sample in samples]
        return super().policy_step(self.trained, **kwargs)  # type: ignore[arg-type]


async def publish_long_rollouts(nats_client, namespace: str, traces: list[TokenTrace]) -> list[RolloutCompleted]:
    """What rollout workers do: store each trace (past the inline limit), then publish its
    RolloutCompleted durably; returns the messages as the results stream holds them."""
    js = nats_client.jetstream()
    await ensure_streams(js, namespace)
    publisher = BusPublisher(nats_client, js, namespace)
    config = RolloutConfig()
    store = ObjectStoreTrajectories(js, namespace, ttl_s=config.trajectory_ttl_s)
    for index, trace in enumerate(traces):
        carried = await place_trace(f"long-{index}", COMPLETED_OBJECT, trace,
                                    inline_bytes=config.inline_trajectory_bytes, store=store)
        await publisher.publish(ROLLOUT_COMPLETED, completed(f"long-{index}", float(1 - index), carried, trace))
    received = []
    for sequence in range(1, len(traces) + 1):
        stored = await js.get_msg(rollout_results_stream(namespace), seq=sequence)
        assert len(stored.data) < 2048, "the message carries a reference, not 128K tokens"
        received.append(ROLLOUT_COMPLETED.decode(stored.data))
    return received


def context() -> MessageContext:
    return MessageContext(subject=ROLLOUT_COMPLETED.format("test"))


async def test_a_128k_token_rollout_is_stored_published_by_reference_admitted_whole_and_trained_on_its_last_4k(
        nats_client, nats_server, namespace, tmp_path: Path, long_model_dir: Path):
    traces = [long_trace(1), long_trace(2)]  # one GRPO group of two, rewards 1 and 0
    assert trace_bytes(traces[0]) > 8 * RolloutConfig().inline_trajectory_bytes
    received = await publish_long_rollouts(nats_client, namespace, traces)
    assert all(m.trajectory is None and m.trajectory_ref.startswith(trajectories_bucket(namespace) + "/")
               for m in received)
    assert [m.num_tokens for m in received] == [LONG, LONG]
    # The bucket removes what no trainer took within the TTL (docs/long-trajectories.md).
    bucket_stream = await nats_client.jetstream().stream_info(f"OBJ_{trajectories_bucket(namespace)}")
    assert bucket_stream.config.max_age == RolloutConfig().trajectory_ttl_s

    # The trainer is another process: its own connection, its own store client.
    trainer_nc = await connect_bus(nats_server.url, name="pytest-trainer", connect_timeout_s=5.0)
    try:
        model = ModelConfig(path=str(long_model_dir))
        config = TrainerConfig(lr=1e-3, n_samples_per_prompt=2, groups_per_step=1, ppo_epochs=1)
        torch.set_num_threads(1)
        backend = LastWindowBackend(model, config)
        before = {name: tensor.clone() for name, tensor in backend.state_dict().items()}
        bus = RecordingPublisher()
        logic = TrainerLogic(config, model, backend, bus, run_dir=tmp_path, clock=lambda: 500.0,
                             trajectories=ObjectStoreTrajectories(trainer_nc.jetstream(), namespace))
        results = await asyncio.wait_for(asyncio.gather(
            *(logic.handle_completed(message, context()) for message in received)), STEP_TIMEOUT_S)
        assert results == [None, None], "both acked once their step was durable"
    finally:
        await trainer_nc.close()

    # Admitted whole, token for token, with each token's logprob and version.
    admitted = sorted(backend.admitted, key=lambda sample: sample.advantage, reverse=True)
    for sample, trace in zip(admitted, traces):
        assert (sample.tokens, sample.loss_mask, sample.logprobs, sample.versions) == (
            trace.ids, trace.loss_mask, trace.logprobs, trace.versions)
    assert [len(sample.tokens) for sample in backend.trained] == [WINDOW, WINDOW]
    (step,), (weights,) = bus.messages(TRAINER_STEPPED), bus.messages(WEIGHTS_PUBLISHED)
    assert (step.num_samples, weights.version) == (2, 1)
    after = backend.state_dict()
    assert any(not torch.equal(before[name], after[name]) for name in before), "the step changed the weights"


async def test_a_stored_trajectory_round_trips_and_a_missing_one_is_lost_not_retried(nats_client, namespace):
    store = ObjectStoreTrajectories(nats_client.jetstream(), namespace)
    trace = long_trace(3, length=20_000, turns=4)
    ref = await store.save("rollout/with spaces", "state-turn-4", trace)
    assert await ObjectStoreTrajectories(nats_client.jetstream(), namespace).load(ref) == trace
    await store.delete(ref)
    with pytest.raises(TrajectoryLostError) as lost:
        await store.load(ref)
    assert lost.value.ref == ref
    await store.delete(ref)  # deleting twice is fine


async def test_a_completed_rollout_whose_stored_trace_is_gone_is_counted_lost_and_masked_in_its_group(
        nats_client, namespace, tmp_path: Path, long_model_dir: Path):
    js = nats_client.jetstream()
    store = ObjectStoreTrajectories(js, namespace)
    short = long_trace(4, length=4096, turns=2)
    kept = await place_trace("kept", COMPLETED_OBJECT, short, inline_bytes=1024, store=store)
    gone = await place_trace("gone", COMPLETED_OBJECT, short, inline_bytes=1024, store=store)
    await store.delete(str(gone["trajectory_ref"]))  # expired before the trainer got to it

    model = ModelConfig(path=str(long_model_dir))
    config = TrainerConfig(lr=1e-3, n_samples_per_prompt=2, groups_per_step=1, ppo_epochs=1)
    bus = RecordingPublisher()
    logic = TrainerLogic(config, model, TorchTrainerBackend(model, config), bus, run_dir=tmp_path,
                         clock=lambda: 500.0, trajectories=store)
    results = await asyncio.wait_for(asyncio.gather(
        logic.handle_completed(completed("kept", 1.0, kept, short), context()),
        logic.handle_completed(completed("gone", 0.0, gone, short), context())), STEP_TIMEOUT_S)
    assert results == [None, None], "acked, not redelivered forever"
    assert logic.stats()["lost_trajectories"] == 1
    (step,) = bus.messages(TRAINER_STEPPED)
    assert step.num_samples == 0, "a group of one usable member teaches nothing"


class FlakyStore:
    """A trajectory store that cannot answer until ``recover()`` (NATS away past its retries)."""

    def __init__(self, traces: dict[str, TokenTrace]) -> None:
        self.traces, self.up = traces, False

    def recover(self) -> None:
        self.up = True

    async def load(self, ref: str) -> TokenTrace:
        if not self.up:
            raise StateStoreError(f"cannot read {ref!r}: no responders")
        return self.traces[ref]


async def test_a_trajectory_the_store_cannot_give_now_fails_the_delivery_and_its_redelivery_is_admitted(
        tmp_path: Path, long_model_dir: Path):
    short = long_trace(7, length=2048, turns=2)
    refs = {"memory/a/completed": short, "memory/b/completed": short}
    store = FlakyStore(refs)
    model = ModelConfig(path=str(long_model_dir))
    config = TrainerConfig(lr=1e-3, n_samples_per_prompt=2, groups_per_step=1, ppo_epochs=1)
    bus = RecordingPublisher()
    logic = TrainerLogic(config, model, TorchTrainerBackend(model, config), bus, run_dir=tmp_path,
                         clock=lambda: 500.0, trajectories=store)  # type: ignore[arg-type]
    first, second = (completed(name, reward, {"trajectory_ref": f"memory/{name}/completed"}, short)
                     for name, reward in (("a", 1.0), ("b", 0.0)))
    with pytest.raises(StateStoreError):
        await logic.handle_completed(first, context())  # nak'ed: redelivered later
    store.recover()
    results = await asyncio.wait_for(asyncio.gather(logic.handle_completed(first, context()),
                                                    logic.handle_completed(second, context())), STEP_TIMEOUT_S)
    assert results == [None, None] and logic.stats()["duplicates"] == 0
    (step,) = bus.messages(TRAINER_STEPPED)
    assert step.num_samples == 2, "the redelivery was admitted, not taken for a duplicate"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="needs CUDA: a policy step on a whole 128K-token sample (attention and logits over "
                           "131072 positions, with their gradients) is too slow and too large for a CPU test")
async def test_a_policy_step_on_a_whole_128k_token_rollout_fetched_from_the_object_store(nats_client, namespace,
                                                                                        long_model_dir: Path):
    js = nats_client.jetstream()
    store = ObjectStoreTrajectories(js, namespace)
    traces = [long_trace(5), long_trace(6)]
    refs = [await store.save(f"gpu-{i}", COMPLETED_OBJECT, trace) for i, trace in enumerate(traces)]
    samples = [PolicySample.from_trace(await store.load(ref), advantage)
               for ref, advantage in zip(refs, (1.0, -1.0))]
    model = ModelConfig(path=str(long_model_dir))
    backend = TorchTrainerBackend(model, TrainerConfig(lr=1e-3, ppo_epochs=1))
    backend.model.to("cuda")  # the torch backend trains where its model is; batches follow the default device
    before = {name: tensor.detach().clone() for name, tensor in backend.model.state_dict().items()}
    with torch.device("cuda"):
        stats = backend.policy_step(samples, current_version=0)
    assert all(value == value for value in stats.values()), f"NaN in {stats}"
    after = backend.model.state_dict()
    assert any(not torch.equal(before[name], after[name]) for name in before)
    assert msgspec.structs.asdict(await store.load(refs[0])) == msgspec.structs.asdict(traces[0])
