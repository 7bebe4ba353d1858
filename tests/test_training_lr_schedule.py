"""The lr warmup of policy steps (rollmesh.training.lr_schedule) and the torch backend's use of it:
the ramp, both optimizer kinds, a fresh optimizer starting it again, and an exact resume
continuing it. Plain torch on the demo model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rollmesh.config import ModelConfig, TrainerConfig
from rollmesh.training.grpo import PolicySample
from rollmesh.training.lr_schedule import set_lr, warmup_lr
from rollmesh.training.optimizer_adamw import AdamWConfig, MixedPrecisionAdamW
from rollmesh.training.torch_backend import TorchTrainerBackend

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]


def test_warmup_ramps_linearly_to_the_lr_and_stays_there():
    assert [warmup_lr(1e-3, done, 4) for done in range(6)] == pytest.approx(
        [2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3, 1e-3])
    assert warmup_lr(1e-3, 0, 0) == 1e-3  # no warmup


def test_set_lr_reaches_torch_and_mixed_precision_optimizers():
    weight = torch.nn.Parameter(torch.ones(3))
    adamw = torch.optim.AdamW([weight], lr=1.0)
    set_lr(adamw, 0.25)
    assert [group["lr"] for group in adamw.param_groups] == [0.25]
    mixed = MixedPrecisionAdamW([("w", torch.nn.Parameter(torch.ones(3, dtype=torch.bfloat16)))],
                                config=AdamWConfig(lr=1.0), device=torch.device("cpu"))
    set_lr(mixed, 0.25)
    assert mixed.config.lr == 0.25 and mixed.config.beta1 == AdamWConfig().beta1


def _samples() -> list[PolicySample]:
    return [PolicySample([1, 2, 3, 4], [0, 1, 1, 1], [0.0, -5.0, -5.0, -5.0], 1.0),
            PolicySample([1, 5, 6, 7], [0, 1, 1, 1], [0.0, -5.0, -5.0, -5.0], -1.0)]


def _lr(backend: TorchTrainerBackend) -> float:
    return backend.optimizer.param_groups[0]["lr"]


def test_policy_steps_warm_up_from_a_fresh_optimizer_and_a_resume_continues_the_ramp(demo_model_dir: Path):
    torch.set_num_threads(1)
    config = TrainerConfig(lr=1e-3, lr_warmup_steps=3, ppo_epochs=1, seed=0)
    backend = TorchTrainerBackend(ModelConfig(path=str(demo_model_dir)), config)
    seen = []
    for _ in range(2):
        backend.policy_step(_samples())
        seen.append(_lr(backend))
    state, weights = backend.training_state(), backend.state_dict()
    backend.policy_step(_samples())
    seen.append(_lr(backend))
    backend.policy_step(_samples())
    seen.append(_lr(backend))
    assert seen == pytest.approx([1e-3 / 3, 2e-3 / 3, 1e-3, 1e-3])

    resumed = TorchTrainerBackend(ModelConfig(path=str(demo_model_dir)), config)
    resumed.load_state_dict(weights)
    resumed.load_training_state(state)  # an exact resume: the third step of the ramp comes next
    resumed.policy_step(_samples())
    assert _lr(resumed) == pytest.approx(1e-3)

    restarted = TorchTrainerBackend(ModelConfig(path=str(demo_model_dir)), config)
    restarted.load_state_dict(weights)  # weights only: fresh moments warm up again
    restarted.policy_step(_samples())
    assert _lr(restarted) == pytest.approx(1e-3 / 3)

    backend.sft_step([([1, 5, 6, 7], [0, 1, 1, 1])], lr=1e-3)
    backend.policy_step(_samples())  # RL after supervised steps: a fresh optimizer, a fresh ramp
    assert _lr(backend) == pytest.approx(1e-3 / 3)
