"""``MegatronRanks``: the trainer's handle on the megatron backend's rank processes (TP=2, and
DP=2 with the distributed optimizer, under gloo here), on a tiny random HF Llama: its calls give
the torch backend's results, a resume from its per-rank training state is exact (with either
optimizer), and a failing rank is a typed error that closes the group.

The backend's own numerics are ``test_training_megatron_backend``'s; this module checks the
driving: processes, connections, per-rank state, failures. Each group start is two processes
importing torch and megatron-core (~5 s on 2 cores).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers builds the reference HF checkpoint")
pytest.importorskip("megatron.core", reason="megatron-core builds the trained model")

from rollmesh.config import MegatronConfig, ModelConfig, TrainerConfig  # noqa: E402
from rollmesh.training.errors import MegatronRanksError  # noqa: E402
from rollmesh.training.grpo import PolicySample  # noqa: E402
from rollmesh.training.megatron_ranks import MegatronRanks  # noqa: E402
from rollmesh.training.torch_backend import TorchTrainerBackend  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

TP2 = MegatronConfig(tensor_parallel=2, start_timeout_s=120, call_timeout_s=120)
DP2_DISTRIBUTED = MegatronConfig(data_parallel=2, distributed_optimizer=True, start_timeout_s=120, call_timeout_s=120)
TRAINER = TrainerConfig(lr=1e-3, ppo_epochs=2, seed=0, grad_clip=1.0, weight_decay=0.01, backend="megatron",
                        megatron=TP2)


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory) -> ModelConfig:
    directory = tmp_path_factory.mktemp("ranks_model")
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=300,
        intermediate_size=128, eos_token_id=2, max_position_embeddings=256, tie_word_embeddings=False))
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.1)
    model.save_pretrained(directory)
    return ModelConfig(path=str(directory))


def _samples(seed: int) -> list[PolicySample]:
    rng = np.random.default_rng(seed)
    out = []
    for length, advantage in ((12, 1.0), (9, -0.5)):
        tokens = rng.integers(3, 300, length).tolist()
        out.append(PolicySample(tokens, [0] * 3 + [1] * (length - 3), (-5 + rng.normal(0, 0.1, length)).tolist(),
                                advantage))
    return out


@pytest.fixture(scope="module")
def ranks(hf_model, tmp_path_factory):
    group = MegatronRanks(hf_model, TRAINER, log_dir=tmp_path_factory.mktemp("rank_logs"))
    yield group
    group.close()


def test_ranks_train_as_the_torch_backend(ranks, hf_model):
    reference = TorchTrainerBackend(hf_model, TRAINER)
    theirs = reference.policy_step(_samples(0), current_version=0)
    ours = ranks.policy_step(_samples(0), current_version=0)
    assert ours.keys() == theirs.keys()
    for key in theirs:
        assert ours[key] == pytest.approx(theirs[key], rel=1e-5, abs=1e-5), key
    after, expected = ranks.state_dict(), reference.state_dict()
    assert sorted(after) == sorted(expected)
    # Adam's first steps are ~lr x sign(g): reduction-order noise shows at up to ~1% of lr.
    assert max((after[k] - expected[k]).abs().max().item() for k in expected) < 0.01 * TRAINER.lr


def _resume_is_exact(ranks: MegatronRanks, hf_model: ModelConfig, trainer: TrainerConfig) -> dict:
    """Step, keep the weights and training state, step again; then fresh ranks load both and take
    the same second step: its weights must be the same bit for bit. Returns the state."""
    ranks.policy_step(_samples(1), current_version=1)
    weights, state = ranks.state_dict(), ranks.training_state()
    ranks.policy_step(_samples(2), current_version=2)
    continued = ranks.state_dict()

    resumed = MegatronRanks(hf_model, trainer)
    try:
        resumed.load_state_dict(weights)
        resumed.load_training_state(state)
        resumed.policy_step(_samples(2), current_version=2)
        again = resumed.state_dict()
        other_layout = {**state, "layout": {**state["layout"], "tensor_parallel": 3}}
        with pytest.raises(MegatronRanksError, match="layout"):
            resumed.load_training_state(other_layout)
    finally:
        resumed.close()
    assert all(torch.equal(again[k], continued[k]) for k in continued)
    return state


def test_a_resume_from_the_ranks_training_state_is_exact(ranks, hf_model):
    state = _resume_is_exact(ranks, hf_model, TRAINER)
    assert [rank["tp_rank"] for rank in state["ranks"]] == [0, 1]  # each rank's own shards


def test_a_resume_with_the_distributed_optimizer_is_exact(hf_model):
    """DP=2, each rank holding its half of Adam's moments (megatron's distributed optimizer),
    with the KL reference and two epochs in the loss."""
    trainer = TrainerConfig(lr=1e-3, ppo_epochs=2, seed=0, grad_clip=1.0, weight_decay=0.01, kl_coef=0.05,
                            backend="megatron", megatron=DP2_DISTRIBUTED)
    group = MegatronRanks(hf_model, trainer)
    try:
        state = _resume_is_exact(group, hf_model, trainer)
    finally:
        group.close()
    assert [rank["dp_rank"] for rank in state["ranks"]] == [0, 1]
    # Each rank saved only its own shard of the moments: about half of them.
    shards = [rank["optimizer"][0]["shards"] for rank in state["ranks"]]
    moments = [sum(t["exp_avg"].numel() for buckets in shard[0].values() for bucket in buckets for t in bucket)
               for shard in shards]
    assert moments[0] + moments[1] == sum(p.numel() for p in state["ranks"][0]["reference"].values())
    assert all(rank["reference"] is not None for rank in state["ranks"])


def test_a_failing_rank_is_a_typed_error_and_closes_the_group(hf_model):
    group = MegatronRanks(hf_model, TRAINER)
    # A target beyond the vocabulary: every rank's logprob gather raises (no rank is left
    # waiting in a collective).
    bad = [PolicySample([5, 6, 10_000], [0, 1, 1], [0.0, -1.0, -1.0], 1.0)]
    with pytest.raises(MegatronRanksError) as failure:
        group.policy_step(bad)
    assert failure.value.method == "policy_step" and failure.value.rank == 0
    assert "out of bounds" in failure.value.detail and "Traceback" in failure.value.detail  # the rank's own
    assert all(process.poll() is not None for process in group._processes)
    with pytest.raises(MegatronRanksError, match="closed"):
        group.state_dict()


def test_a_rank_that_cannot_start_fails_the_start_with_its_traceback(tmp_path):
    missing = ModelConfig(path=str(tmp_path / "no_such_model"))
    with pytest.raises(MegatronRanksError) as failure:
        MegatronRanks(missing, TRAINER)
    assert failure.value.method == "start" and "no_such_model" in failure.value.detail


async def test_a_trainer_on_megatron_ranks_restarted_from_a_checkpoint_resumes_bit_for_bit(hf_model, tmp_path):
    """The trainer's own exact-resume path (``TrainerLogic``: ledger, Megatron checkpoint, the
    ranks' training state) with the megatron backend, as ``test_training_exactly_once`` does with
    the torch backend: a copy of the run directory taken after step 1 is restarted on fresh
    ranks, and its step 2 equals the original's bit for bit."""
    import shutil

    from support.fakes import RecordingPublisher
    from test_training_trainer_logic import completed, deliver

    from rollmesh.training.trainer_logic import TrainerLogic

    config = TrainerConfig(lr=1e-3, n_samples_per_prompt=2, groups_per_step=1, ppo_epochs=1, checkpoint_every=1,
                           backend="megatron", megatron=TP2)

    def logic(run_dir, backend):
        return TrainerLogic(config, hf_model, backend, RecordingPublisher(), run_dir=run_dir, clock=lambda: 500.0)

    original_ranks = MegatronRanks(hf_model, config)
    try:
        original = logic(tmp_path / "run", original_ranks)
        await original.start()
        await deliver(original, completed("a", "g1", 1.0), completed("b", "g1", 0.0))
        shutil.copytree(tmp_path / "run", tmp_path / "died")
        assert (tmp_path / "died" / "checkpoints" / "iter_0000001").is_dir()  # the Megatron save root
        second_step = (completed("c", "g2", 0.0), completed("d", "g2", 1.0))
        await deliver(original, *second_step)
        expected = original_ranks.state_dict()
    finally:
        original_ranks.close()

    restarted_ranks = MegatronRanks(hf_model, config)
    try:
        restarted = logic(tmp_path / "died", restarted_ranks)
        await restarted.start()
        assert (restarted.step, restarted.version) == (1, 1)
        await deliver(restarted, *second_step)
        resumed = restarted_ranks.state_dict()
    finally:
        restarted_ranks.close()
    assert all(torch.equal(resumed[name], expected[name]) for name in expected)
