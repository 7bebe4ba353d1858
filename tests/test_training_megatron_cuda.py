"""The megatron backend on CUDA through its rank processes (``MegatronRanks``): ranks on GPU
LOCAL_RANK under NCCL, answers moved to the CPU before they leave a rank, the refusal of more
ranks than GPUs, and peak device memory with and without ``trainer.optimizer_offload``. Every
test here needs CUDA and is skipped elsewhere, saying so; none has run yet (no GPU in the
sessions that wrote them). ``scripts/gpu/smoke.sh`` runs the same paths with figures."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core builds the trained model")
transformers = pytest.importorskip("transformers", reason="transformers writes the model")

from rollmesh.config import ModelConfig, TrainerConfig  # noqa: E402
from rollmesh.trainer_config import MegatronConfig  # noqa: E402
from rollmesh.training.grpo import PolicySample  # noqa: E402
from rollmesh.training.megatron_devices import TooManyRanksError  # noqa: E402
from rollmesh.training.megatron_ranks import MegatronRanks  # noqa: E402
from support.hf_llamas import save_random_llama  # noqa: E402

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600),
              pytest.mark.skipif(GPUS == 0, reason="needs CUDA: NCCL ranks, one GPU per rank, "
                                                   "torch.cuda.max_memory_allocated")]

LLAMA = dict(hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, vocab_size=8192,
             intermediate_size=2048, eos_token_id=2, max_position_embeddings=1024, tie_word_embeddings=False)


def _samples(count: int = 4, length: int = 128) -> list[PolicySample]:
    rng = np.random.default_rng(0)
    return [PolicySample(rng.integers(3, LLAMA["vocab_size"], length).tolist(), [0] * 8 + [1] * (length - 8),
                         (-9.0 + rng.normal(0, 0.3, length)).tolist(), 1.0 if i % 2 else -1.0) for i in range(count)]


def _trainer(tp: int, **fields) -> TrainerConfig:
    return TrainerConfig(lr=1e-4, ppo_epochs=1, **fields,
                         megatron=MegatronConfig(tensor_parallel=tp, start_timeout_s=300, call_timeout_s=300))


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> ModelConfig:
    return ModelConfig(path=str(save_random_llama(LLAMA, tmp_path_factory.mktemp("cuda_llama") / "llama")))


def test_ranks_train_on_their_own_gpus_and_answer_with_cpu_tensors(model):
    tp = min(GPUS, 2)
    ranks = MegatronRanks(model, _trainer(tp))
    try:
        stats = ranks.policy_step(_samples(), current_version=0)
        weights = ranks.state_dict()
        memory = ranks.device_memory()
    finally:
        ranks.close()
    assert np.isfinite(stats["loss"]) and stats["trained_tokens"] > 0
    assert {tensor.device.type for tensor in weights.values()} == {"cpu"}
    assert [m["device"] for m in memory] == [f"cuda:{rank}" for rank in range(tp)]


def test_more_ranks_than_gpus_are_refused_before_any_starts(model):
    with pytest.raises(TooManyRanksError) as caught:
        MegatronRanks(model, _trainer(GPUS + 1))
    assert (caught.value.ranks_on_node, caught.value.gpus) == (GPUS + 1, GPUS)


def test_optimizer_offload_lowers_the_peak_device_memory_of_a_bf16_step(model):
    peaks = {}
    for offload in (False, True):
        ranks = MegatronRanks(model, _trainer(1, precision="bf16", optimizer_offload=offload))
        try:
            ranks.device_memory()  # the window opens after the model and optimizer are built
            ranks.policy_step(_samples(), current_version=0)
            (memory,) = ranks.device_memory()
        finally:
            ranks.close()
        peaks[offload] = memory["peak_bytes"]
    parameters = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_pretrained(model.path).parameters())
    # Without offload the fp32 masters and both moments (12 bytes a parameter) sit on the device.
    assert peaks[False] - peaks[True] > 6 * parameters, peaks
