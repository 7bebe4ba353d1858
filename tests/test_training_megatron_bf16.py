"""The megatron backend in bf16 with fp32 main parameters (``trainer.precision = "bf16"``), with
megatron's mixed-precision optimizer and with the chunked optimizer offload
(``trainer.optimizer_offload``, training/megatron_offload.py), at tensor parallel 2 on CPU under
gloo, against each other and the torch backend's bf16 step. (Peak device memory with and without
the offload needs CUDA: ``test_training_megatron_cuda``.)"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers", reason="transformers builds the reference HF checkpoints")
pytest.importorskip("megatron.core", reason="megatron-core builds the trained model")

from rollmesh.config import ModelConfig, TrainerConfig  # noqa: E402
from rollmesh.engine.models import read_safetensors  # noqa: E402
from rollmesh.training.torch_backend import TorchTrainerBackend  # noqa: E402
from support.hf_llamas import save_random_llama  # noqa: E402
from support.megatron_backend_worker import run_worker  # noqa: E402
from test_training_megatron_backend import MODELS, PROBE, _samples  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

BF16 = dict(lr=1e-3, ppo_epochs=1, seed=0, grad_clip=1.0, weight_decay=0.01, precision="bf16")
CASES = {"bf16": BF16, "bf16_offload": dict(BF16, optimizer_offload=True)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("megatron_bf16")
    directory = save_random_llama(MODELS["untied"], root / "llama")
    torch_backend = TorchTrainerBackend(ModelConfig(path=str(directory)), TrainerConfig(**BF16))
    with torch.no_grad():
        fp32 = TorchTrainerBackend(ModelConfig(path=str(directory)), TrainerConfig(**dict(BF16, precision="fp32")))
        samples = _samples(fp32)  # behaviour logprobs from the fp32 model, as an engine's would be
    torch_stats = torch_backend.policy_step(samples, current_version=0)
    job = {name: dict(hf_path=str(directory), trainer=trainer, layout=dict(tp=2), probe=PROBE, samples=samples)
           for name, trainer in CASES.items()}
    torch.save(job, root / "job.pt")
    results = run_worker(root / "job.pt", root / "out.pt", world=2, timeout_s=540)
    return dict(results, torch_stats=torch_stats, torch_after=torch_backend.state_dict(),
                original=read_safetensors(directory, dtype=torch.float32))


def test_bf16_megatron_keeps_bf16_weights_and_fp32_main_parameters(runs):
    for name in CASES:
        assert all(tensor.dtype == torch.bfloat16 for tensor in runs[name]["after"].values()), name
    classes = {name: {cls for layout in runs[name]["layouts"] for cls in layout["classes"]} for name in CASES}
    assert classes == {"bf16": {"Float16OptimizerWithFloat16Params"}, "bf16_offload": {"MegatronOffloadAdamW"}}


def test_bf16_megatron_policy_step_matches_the_torch_backends_bf16_step(runs):
    ours, theirs = runs["bf16"]["stats"], runs["torch_stats"]
    assert ours.keys() == theirs.keys()
    # bf16 forwards summed in another order (TP halves, sdpa): rounding of bf16's 8-bit mantissa.
    for key in ("loss", "surrogate", "mean_ratio", "logprob_mismatch", "grad_norm"):
        assert ours[key] == pytest.approx(theirs[key], rel=0.03, abs=0.01), key
    assert ours["trained_tokens"] == theirs["trained_tokens"]
    after, reference, original = runs["bf16"]["after"], runs["torch_after"], runs["original"]
    for key in reference:
        moved = (reference[key].float() - original[key].to(torch.bfloat16).float()).abs()
        apart = (after[key].float() - reference[key].float()).abs()
        # Adam's first step moves each weight by about lr: the two agree where it moved it.
        assert apart.mean() <= 0.25 * moved.mean(), key  # norms at 1.0: lr is below a bf16 step, neither moved


def test_the_chunked_offload_steps_as_megatrons_mixed_precision_optimizer(runs):
    plain, offload = runs["bf16"], runs["bf16_offload"]
    for key in plain["stats"]:  # the same forward and loss before the update
        assert offload["stats"][key] == pytest.approx(plain["stats"][key], rel=1e-3, abs=1e-6), key
    differing, total, worst = 0, 0, 0.0
    for key, tensor in plain["after"].items():
        apart = (offload["after"][key].float() - tensor.float()).abs()
        differing += int((apart > 0).sum())
        total += apart.numel()
        worst = max(worst, apart.max().item())
    # bf16 gradient buffers (the offload optimizer takes bf16 gradients) round the scaled
    # gradients differently: a few elements land one bf16 step apart.
    assert differing / total < 0.02 and worst < 4 * BF16["lr"], (differing / total, worst)
