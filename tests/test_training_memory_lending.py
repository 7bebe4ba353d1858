"""The torch trainer lends its accelerator between steps: offload moves weights and optimizer
state to host memory (storage emptied in place, so the optimizers keep their references), reload
brings them back, and training goes on bit for bit. On CPU the real offload moves nothing; the
same path is exercised by moving host tensors too (``StorageSwap(include_host=True)``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rollmesh.config import ModelConfig, TrainerConfig
from rollmesh.engine.memory_release import StorageSwap
from rollmesh.training.grpo import PolicySample
from rollmesh.training.torch_backend import TorchTrainerBackend, TrainerOffloadedError

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]

SAMPLES = [PolicySample([1, 60, 61, 62, 63, 2], [0, 0, 1, 1, 1, 1], [0.0, -5.0, -5.0, -5.0, -5.0, -5.0], 1.0),
           PolicySample([1, 70, 71, 72, 2], [0, 1, 1, 1, 1], [0.0, -5.0, -5.0, -5.0, -5.0], -1.0)]
KINDS = {"fp32": {}, "bf16": {"precision": "bf16"}, "bf16_offload": {"precision": "bf16", "optimizer_offload": True}}


def backend(model_dir: Path, **settings) -> TorchTrainerBackend:
    return TorchTrainerBackend(ModelConfig(path=str(model_dir)), TrainerConfig(lr=1e-3, seed=0, **settings))


def test_offload_on_cpu_runs_the_protocol_moving_nothing_and_refuses_steps_until_reload(demo_model_dir) -> None:
    trainer, twin = backend(demo_model_dir), backend(demo_model_dir)
    assert trainer.policy_step(SAMPLES) == twin.policy_step(SAMPLES)
    offloaded = trainer.offload()
    assert trainer.offloaded and offloaded.bytes_moved == 0  # host memory already
    with pytest.raises(TrainerOffloadedError) as refused:
        trainer.policy_step(SAMPLES)
    assert refused.value.operation == "policy_step"
    with pytest.raises(TrainerOffloadedError):
        trainer.state_dict()
    trainer.reload()
    assert not trainer.offloaded
    assert trainer.policy_step(SAMPLES) == twin.policy_step(SAMPLES)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_offloaded_weights_and_optimizer_state_come_back_in_place_and_train_the_same_bits(demo_model_dir, kind) -> None:
    trainer, twin = backend(demo_model_dir, **KINDS[kind]), backend(demo_model_dir, **KINDS[kind])
    if kind == "fp32":  # its weights map the safetensors file, which cannot be resized (devices' can)
        for parameter in trainer.model.parameters():
            parameter.data = parameter.data.clone()
    trainer.policy_step(SAMPLES)
    twin.policy_step(SAMPLES)
    trainer._swap = StorageSwap(include_host=True)  # host tensors move too: the CUDA path, on CPU
    moved = trainer.offload()
    parameters = list(trainer.model.parameters())
    assert all(p.untyped_storage().nbytes() == 0 for p in parameters)  # emptied, not copied aside
    assert moved.bytes_moved >= sum(p.numel() * p.element_size() for p in parameters)
    trainer.reload()
    assert trainer.policy_step(SAMPLES) == twin.policy_step(SAMPLES)
    assert all(torch.equal(a, b) for a, b in zip(trainer.state_dict().values(), twin.state_dict().values()))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: device memory is given back only there")
def test_storage_swap_gives_cuda_memory_back_and_restores_it() -> None:
    weights = torch.nn.Parameter(torch.randn(1024, 1024, device="cuda"))
    optimizer = torch.optim.AdamW([weights])
    weights.grad = torch.ones_like(weights)
    optimizer.step()
    before = weights.detach().clone()
    resident = torch.cuda.memory_allocated()
    swap = StorageSwap()
    swap.offload([weights, *optimizer.state[weights].values()])
    assert torch.cuda.memory_allocated() < resident - 3 * weights.numel() * 4 + 1024
    swap.reload()
    assert torch.equal(weights.detach(), before)
