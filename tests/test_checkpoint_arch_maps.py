"""The Megatron <-> Hugging Face architecture maps: names against real transformers checkpoints,
and (hypothesis) every element covered exactly once, no HF name twice, and exact round trips."""

from __future__ import annotations

import pytest
import torch
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open

from rollmesh.checkpoint.arch_maps import (
    FAMILIES,
    ArchSpec,
    build_arch_map,
    canonical_megatron_name,
    expert_index,
    megatron_shapes,
    per_expert_name,
)
from rollmesh.checkpoint.layout_transforms import deinterleave_qkv, interleave_qkv

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]

TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=300, intermediate_size=128, tie_word_embeddings=False)


def hf_config(family: str, tie: bool):
    fields = {**TINY, "tie_word_embeddings": tie}
    if family == "llama":
        return transformers.LlamaConfig(**fields), transformers.LlamaForCausalLM
    if family == "qwen2":
        return transformers.Qwen2Config(**fields), transformers.Qwen2ForCausalLM
    if family == "qwen3_moe":
        return (transformers.Qwen3MoeConfig(**fields, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
                transformers.Qwen3MoeForCausalLM)
    return (transformers.MixtralConfig(**fields, num_local_experts=4, num_experts_per_tok=2),
            transformers.MixtralForCausalLM)


def spec_for(family: str, tie: bool) -> ArchSpec:
    moe = family in ("mixtral", "qwen3_moe")
    return ArchSpec(family=family, num_layers=2, hidden_size=64, num_heads=4, num_query_groups=2, head_dim=16,
                    ffn_hidden_size=128, vocab_size=300, padded_vocab_size=384, tie_embeddings=tie,
                    num_experts=4 if moe else 0, moe_ffn_hidden_size=32 if family == "qwen3_moe" else 0)


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("family", FAMILIES)
def test_hf_names_and_shapes_are_those_transformers_saves(family, tie, tmp_path):
    config, cls = hf_config(family, tie)
    cls(config).save_pretrained(tmp_path)
    saved = {}
    for file in tmp_path.glob("*.safetensors"):
        with safe_open(file, "pt") as handle:
            saved.update({name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys()})
    arch = build_arch_map(spec_for(family, tie))
    assert sorted(arch.hf_names()) == sorted(saved)
    # Mapping tensors of the Megatron shapes gives tensors of exactly the saved shapes.
    mapped = {}
    for name, shape in megatron_shapes(arch.spec).items():
        mapped.update(arch.to_hf(name, torch.zeros(shape)))
    assert {name: tuple(t.shape) for name, t in mapped.items()} == saved


def test_qkv_deinterleave_takes_each_groups_q_heads_then_k_then_v():
    groups, heads, d = 2, 4, 1
    fused = torch.arange(groups * (heads // groups + 2) * d, dtype=torch.float32)[:, None]
    q, k, v = deinterleave_qkv(fused, groups=groups, heads=heads, head_dim=d)
    # rows: group 0 = q0 q1 k0 v0, group 1 = q2 q3 k1 v1
    assert q[:, 0].tolist() == [0, 1, 4, 5] and k[:, 0].tolist() == [2, 6] and v[:, 0].tolist() == [3, 7]


def test_transformer_engine_names_and_per_expert_layout_are_recognised():
    assert canonical_megatron_name("decoder.layers.3.self_attention.linear_qkv.layer_norm_weight") == \
        "decoder.layers.3.input_layernorm.weight"
    assert canonical_megatron_name("decoder.layers.0.mlp.linear_fc1.layer_norm_weight") == \
        "decoder.layers.0.pre_mlp_layernorm.weight"
    # TEGroupedMLP's per-gemm weights are the canonical per-expert tensors.
    assert canonical_megatron_name("decoder.layers.2.mlp.experts.linear_fc2.weight5") == \
        "decoder.layers.2.mlp.experts.local_experts.5.linear_fc2.weight"
    # A per-expert tensor sits at its global id on the expert axis of the grouped one torch_dist stores.
    assert expert_index("decoder.layers.1.mlp.experts.local_experts.7.linear_fc1.weight") == (
        "decoder.layers.1.mlp.experts.experts.linear_fc1.weight", 7)
    assert per_expert_name("decoder.layers.1.mlp.experts.experts.linear_fc1.weight", 7) == \
        "decoder.layers.1.mlp.experts.local_experts.7.linear_fc1.weight"
    assert expert_index("decoder.layers.1.mlp.linear_fc1.weight") is None
    assert per_expert_name("decoder.layers.1.mlp.linear_fc1.weight", 0) is None
    arch = build_arch_map(spec_for("llama", False))
    with pytest.raises(KeyError, match="not a tensor of a llama checkpoint"):
        arch.rule("decoder.layers.9.mlp.router.weight")


@st.composite
def specs(draw) -> ArchSpec:
    family = draw(st.sampled_from(FAMILIES))
    groups = draw(st.integers(1, 3))
    heads = groups * draw(st.integers(1, 3))
    head_dim = draw(st.sampled_from([1, 2, 4]))
    vocab = draw(st.integers(3, 40))
    moe = family in ("mixtral", "qwen3_moe")
    return ArchSpec(
        family=family, num_layers=draw(st.integers(1, 2)), hidden_size=draw(st.integers(2, 6)),
        num_heads=heads, num_query_groups=groups, head_dim=head_dim, ffn_hidden_size=draw(st.integers(1, 5)),
        vocab_size=vocab, padded_vocab_size=vocab + draw(st.integers(0, 8)),
        tie_embeddings=draw(st.booleans()), num_experts=draw(st.integers(1, 4)) if moe else 0,
        moe_ffn_hidden_size=draw(st.integers(0, 3)) if moe else 0)


@settings(max_examples=60, deadline=None)
@given(specs())
def test_every_element_is_mapped_exactly_once_with_no_name_twice_and_maps_back_exactly(spec):
    arch = build_arch_map(spec)
    assert len(set(arch.hf_names())) == len(arch.hf_names()), "an HF name appears twice"
    shapes = megatron_shapes(spec)
    assert sorted(shapes) == sorted(arch.megatron_names())
    # MoE: one rule per expert per layer, under global expert ids, and the router.
    experts = [name for name in shapes if expert_index(name) is not None]
    assert len(experts) == 2 * spec.num_layers * spec.num_experts
    assert all(per_expert_name(*expert_index(name)) == name for name in experts)
    # Every Megatron element gets a unique id; padding rows of vocabulary tables are zero (they
    # carry nothing and are dropped), so ids are only given to real rows.
    next_id, megatron, expected = 1, {}, []
    for name, shape in shapes.items():
        tensor = torch.zeros(shape, dtype=torch.int64)
        real = tensor[:spec.vocab_size] if name in ("embedding.word_embeddings.weight", "output_layer.weight") else tensor
        real.copy_(torch.arange(next_id, next_id + real.numel()).reshape(real.shape))
        expected.append(real.flatten())
        next_id += real.numel()
        megatron[name] = tensor
    hf = {}
    for name, tensor in megatron.items():
        hf.update(arch.to_hf(name, tensor))
    mapped = torch.cat([t.flatten() for t in hf.values()])
    assert torch.equal(mapped.sort().values, torch.cat(expected).sort().values), "not covered exactly once"
    back = arch.to_megatron(hf)
    assert all(torch.equal(back[name], megatron[name]) for name in megatron)


@settings(max_examples=100, deadline=None)
@given(groups=st.integers(1, 4), per_group=st.integers(1, 4), head_dim=st.integers(1, 4), width=st.integers(0, 3))
def test_qkv_interleave_inverts_deinterleave(groups, per_group, head_dim, width):
    shape = (groups * (per_group + 2) * head_dim,) + ((width,) if width else ())
    fused = torch.randn(shape)
    parts = deinterleave_qkv(fused, groups=groups, heads=groups * per_group, head_dim=head_dim)
    assert torch.equal(interleave_qkv(*parts, groups=groups, heads=groups * per_group, head_dim=head_dim), fused)
