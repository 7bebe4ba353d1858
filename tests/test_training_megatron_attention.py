"""The megatron backend's core attention on torch sdpa (rollmesh.training.megatron_attention)
against megatron-core's own local ``DotProductAttention``, which materialises the [b, h, s, s]
scores: the same output for plain causal attention (sdpa's own causal mask, no mask tensor) and
for packed rows' block-diagonal mask, with grouped-query heads. In this process, no process
group: the attention modules get a one-rank TP group of their own. (The whole model's logits
against transformers', through sdpa, are ``test_training_megatron_backend``'s.)"""

from __future__ import annotations

import types

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core provides the reference attention")

from rollmesh.training.megatron_attention import SdpaAttention, gpt_layer_spec  # noqa: E402
from rollmesh.training.megatron_cpu_shims import megatron_cuda_on_cpu  # noqa: E402

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]

HEADS, GROUPS, DIM, SEQ, BATCH = 4, 2, 16, 12, 2


class _OneRank:
    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0


@pytest.fixture(scope="module")
def modules():
    from megatron.core import parallel_state
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    # DotProductAttention takes its score buffer from megatron's global memory buffer.
    parallel_state._set_global_memory_buffer()
    config = TransformerConfig(num_layers=1, hidden_size=HEADS * DIM, num_attention_heads=HEADS,
                               num_query_groups=GROUPS, kv_channels=DIM, attention_dropout=0.0,
                               hidden_dropout=0.0, use_cpu_initialization=True)
    made = {}
    for cls in (DotProductAttention, SdpaAttention):
        made[cls] = cls(config=config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self",
                        pg_collection=types.SimpleNamespace(tp=_OneRank())).eval()
    yield made[DotProductAttention], made[SdpaAttention]
    parallel_state.destroy_global_memory_buffer()


def _qkv():
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(SEQ, BATCH, HEADS, DIM, generator=generator)
    key, value = (torch.randn(SEQ, BATCH, GROUPS, DIM, generator=generator) for _ in range(2))
    return query, key, value


@pytest.fixture
def cpu_buffers(monkeypatch):
    """megatron's score buffer lives on torch.cuda.current_device() and its dropout forks the CUDA
    RNG: the CPU and no fork here, for the test (megatron_cpu_shims does the same in a rank)."""
    import contextlib

    from megatron.core.tensor_parallel import random as megatron_random

    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    monkeypatch.setattr(megatron_random.CudaRNGStatesTracker, "fork", lambda self, name=None: contextlib.nullcontext())


def test_sdpa_core_attention_matches_megatrons_plain_causal_attention_without_a_mask_tensor(modules, cpu_buffers):
    reference, sdpa = modules
    query, key, value = _qkv()
    causal = torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool), diagonal=1)  # True = masked
    with megatron_cuda_on_cpu():  # megatron's score buffer is asked for on "cuda"
        expected = reference(query, key, value, causal)
    got = sdpa(query, key, value, None)  # None: sdpa's is_causal, no [s, s] mask built
    assert got.shape == expected.shape == (SEQ, BATCH, HEADS * DIM)
    assert (got - expected).abs().max().item() < 1e-5


def test_sdpa_core_attention_matches_megatrons_under_a_packed_rows_block_mask(modules, cpu_buffers):
    reference, sdpa = modules
    query, key, value = _qkv()
    segments = torch.tensor([[0] * 5 + [1] * 4 + [2] * 3, [0] * 8 + [1] * 4])
    same = segments[:, :, None] == segments[:, None, :]
    allowed = same & torch.ones(SEQ, SEQ, dtype=torch.bool).tril()
    mask = ~allowed[:, None]  # [b, 1, s, s], True = masked
    with megatron_cuda_on_cpu():
        expected = reference(query, key, value, mask)
    got = sdpa(query, key, value, mask)
    assert (got - expected).abs().max().item() < 1e-5
    # The mask mattered: plain causal attention gives another result for the packed rows.
    assert (sdpa(query, key, value, None) - expected).abs().max().item() > 1e-3


def test_without_transformer_engine_the_local_spec_runs_sdpa_and_says_so(monkeypatch):
    import structlog

    from rollmesh.training import megatron_attention

    monkeypatch.setattr(megatron_attention, "transformer_engine_available", lambda: False)
    with structlog.testing.capture_logs() as logs:
        layer, final_norm, name = gpt_layer_spec(num_experts=None, qk_layernorm=True, norm=torch.nn.RMSNorm)
    assert name == "local" and final_norm is torch.nn.RMSNorm
    assert layer.submodules.self_attention.submodules.core_attention is SdpaAttention
    assert layer.submodules.self_attention.submodules.q_layernorm is torch.nn.RMSNorm
    assert {"event": "megatron_layer_spec", "spec": "local", "core_attention": "torch_sdpa",
            "log_level": "info"}.items() <= logs[0].items()
