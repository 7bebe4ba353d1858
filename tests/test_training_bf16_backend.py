"""The torch backend at ``trainer.precision = "bf16"``: bf16 weights and gradients against fp32
master weights and Adam moments, on the device (``MixedPrecisionAdamW``) or offloaded to host
memory in chunks (``trainer.optimizer_offload``: ``ChunkedOffloadAdamW``). On the demo model:
both train the same bits, a warm start carries into RL, and a resume is exact."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rollmesh.config import ModelConfig, TrainerConfig
from rollmesh.training.grpo import PolicyBatch, PolicySample
from rollmesh.training.losses import token_logprobs
from rollmesh.training.optimizer_adamw import MixedPrecisionAdamW
from rollmesh.training.optimizer_offload import ChunkedOffloadAdamW
from rollmesh.training.torch_backend import TorchTrainerBackend

pytestmark = pytest.mark.unit

# A small grad_clip, so that clipping (applied to the fp32 gradients) is active in every step, and a
# learning rate small enough that the second PPO epoch is not clipped away entirely.
BF16 = dict(lr=1e-3, ppo_epochs=2, seed=0, precision="bf16", grad_clip=0.05, weight_decay=0.01)
DEMONSTRATIONS = [([1, 40, 41, 42, 43, 2], [0, 0, 1, 1, 1, 1]), ([1, 50, 51, 52, 2], [0, 1, 1, 1, 1])]


@pytest.fixture
def model(demo_model_dir: Path) -> ModelConfig:
    return ModelConfig(path=str(demo_model_dir))


def samples(backend: TorchTrainerBackend, shift: int) -> list[PolicySample]:
    """Two samples whose behaviour logprobs are ``backend``'s own now, so the PPO clip leaves
    them gradient whatever the model's logprobs are (fixed ones would be clipped away)."""
    tokens = [[1, 60 + shift, 61, 62, 63, 2], [1, 70 + shift, 71, 72, 2]]
    masks = [[0, 0, 1, 1, 1, 1], [0, 1, 1, 1, 1]]
    out = []
    for ids, mask, advantage in zip(tokens, masks, (1.0, -1.0)):
        batch = PolicyBatch.collate([PolicySample(ids, mask, [0.0] * len(ids), 0.0)], pad_id=0)
        with torch.no_grad():
            logprobs = token_logprobs(backend.model(batch.inputs), batch.targets)[0].float().tolist()
        out.append(PolicySample(ids, mask, [0.0, *logprobs], advantage))
    return out


def train(backend: TorchTrainerBackend, steps: range) -> list[dict[str, float]]:
    return [backend.policy_step(samples(backend, step), current_version=step) for step in steps]


def test_bf16_weights_train_against_fp32_state_on_the_device_or_offloaded_with_the_same_bits(model):
    plain = TorchTrainerBackend(model, TrainerConfig(**BF16))
    offload = TorchTrainerBackend(model, TrainerConfig(**BF16, optimizer_offload=True))
    assert isinstance(plain.optimizer, MixedPrecisionAdamW) and isinstance(offload.optimizer, ChunkedOffloadAdamW)
    assert all(p.dtype == torch.bfloat16 for p in offload.model.parameters())
    initial = plain.state_dict()
    assert plain.sft_step(DEMONSTRATIONS, lr=1e-2) == offload.sft_step(DEMONSTRATIONS, lr=1e-2)
    ours, theirs = train(plain, range(3)), train(offload, range(3))
    assert ours == theirs and all(s["grad_norm"] > BF16["grad_clip"] for s in ours)  # clipped each step
    after_plain, after_offload = plain.state_dict(), offload.state_dict()
    assert all(torch.equal(after_plain[k], after_offload[k]) for k in after_plain)
    assert all(torch.equal(plain.optimizer.state_of(n).master, offload.optimizer.state_of(n).master)
               for n, _ in plain.model.named_parameters())
    assert any(not torch.equal(after_plain[k], initial[k]) for k in initial)


def test_rl_after_a_bf16_warm_start_starts_from_the_warm_started_weights(model):
    """The RL optimizer's fp32 masters are taken after the warm start: a stale copy of the
    initial weights would overwrite the warm start at the first RL step."""
    backend = TorchTrainerBackend(model, TrainerConfig(**{**BF16, "lr": 1e-5}))
    initial = backend.state_dict()
    for _ in range(3):
        backend.sft_step(DEMONSTRATIONS, lr=3e-2)
    warm = backend.state_dict()
    train(backend, range(1))  # lr 1e-5: the weights barely move from where RL starts
    after = backend.state_dict()
    distance = lambda a, b: max((a[k].float() - b[k].float()).abs().max().item() for k in a)  # noqa: E731
    assert distance(after, warm) < 0.1 * distance(warm, initial)


def test_a_bf16_offload_backend_resumes_bit_for_bit_from_its_training_state(model):
    config = TrainerConfig(**BF16, optimizer_offload=True)
    original = TorchTrainerBackend(model, config)
    train(original, range(2))
    weights, state = original.state_dict(), original.training_state()
    train(original, range(2, 4))
    resumed = TorchTrainerBackend(model, config)
    resumed.load_state_dict(weights)
    resumed.load_training_state(state)
    train(resumed, range(2, 4))
    expected, got = original.state_dict(), resumed.state_dict()
    assert all(torch.equal(expected[k], got[k]) for k in expected)
    # The fp32 masters came back too, not only the bf16 weights they round to.
    assert all(torch.equal(original.optimizer.state_of(n).master, resumed.optimizer.state_of(n).master)
               for n, _ in original.model.named_parameters())


def test_offload_without_bf16_is_a_config_error():
    with pytest.raises(ValueError, match="optimizer_offload needs"):
        TrainerConfig(optimizer_offload=True)
