"""Real Megatron-core MoE checkpoints (Qwen3-MoE-like, 4 experts top 2, tensor parallel 2 x
expert parallel 2 = four gloo processes; each format written once per session on CPU): what
megatron-core stores, one source per canonical per-expert tensor, and conversions from both the
torch_dist and the legacy per-rank format that transformers loads with megatron's own logits."""

from __future__ import annotations

import argparse
import shutil

import pytest
import torch

from support.megatron_checkpoints import PROBE_IDS, TINY_MOE, logits_path
from rollmesh.checkpoint.arch_maps import build_arch_map, megatron_shapes
from rollmesh.checkpoint.chunk_geometry import check_tiling
from rollmesh.checkpoint.errors import CheckpointReadError
from rollmesh.checkpoint.legacy_reader import LegacyCheckpoint
from rollmesh.checkpoint.megatron_args import ModelDescription, describe_model, saved_args
from rollmesh.checkpoint.convert_executor import convert_planned
from rollmesh.checkpoint.megatron_to_hf import convert_legacy_to_hf, hf_config
from rollmesh.checkpoint.torch_dist_reader import TorchDistCheckpoint, layer_sources

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

LAYERS, EXPERTS, FFN = TINY_MOE["num_layers"], TINY_MOE["num_experts"], TINY_MOE["moe_ffn_hidden_size"]
HIDDEN = TINY_MOE["hidden_size"]
# float32 on CPU: the converted model's logits were measured 4.6e-7 from megatron-core's (logits up
# to 0.59); swapping two experts moves them by 0.9, so the bound tells a misplaced expert apart.
TOLERANCE = 1e-4


def describe(folder) -> tuple[ModelDescription, dict]:
    model = describe_model(saved_args(folder))
    config = hf_config(model.spec, norm_epsilon=model.norm_epsilon, rope_theta=model.rope_theta,
                       max_position_embeddings=model.max_position_embeddings, dtype=model.dtype,
                       moe_top_k=model.moe_top_k)
    return model, config


def hf_logits(folder) -> tuple[torch.Tensor, torch.nn.Module]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        return model(torch.tensor(PROBE_IDS)).logits, model


def test_megatron_core_stores_experts_stacked_by_layer_and_global_expert_in_tp_chunks(moe_torch_dist):
    checkpoint = TorchDistCheckpoint(moe_torch_dist)
    checkpoint.check()
    fc1 = checkpoint.tensor("decoder.layers.mlp.experts.experts.linear_fc1.weight")
    fc2 = checkpoint.tensor("decoder.layers.mlp.experts.experts.linear_fc2.weight")
    assert fc1.shape == (LAYERS, EXPERTS, 2 * FFN, HIDDEN) and fc2.shape == (LAYERS, EXPERTS, HIDDEN, FFN)
    # One chunk per layer, expert and TP rank: fc1 as that rank's gate rows and its up rows.
    assert len(fc1.chunks) == LAYERS * EXPERTS * 2 * 2 and len(fc2.chunks) == LAYERS * EXPERTS * 2
    assert {chunk.box.offsets[2] for chunk in fc1.chunks} == {0, FFN // 2, FFN, FFN + FFN // 2}
    # Global experts 2 and 3 live on expert-parallel rank 1 (global ranks 2 and 3).
    assert {chunk.file[:3] for chunk in fc2.chunks if chunk.box.offsets[1] >= 2} == {"__2", "__3"}
    assert checkpoint.tensor("decoder.layers.mlp.router.weight").shape == (LAYERS, EXPERTS, HIDDEN)


def test_layer_sources_give_every_canonical_per_expert_name_once_tiling_the_stored_tensors(moe_torch_dist):
    checkpoint = TorchDistCheckpoint(moe_torch_dist)
    model, _ = describe(moe_torch_dist)
    assert (model.spec.family, model.spec.num_experts, model.moe_top_k) == ("qwen3_moe", EXPERTS, 2)
    sources = layer_sources(checkpoint)
    names = build_arch_map(model.spec).megatron_names()
    assert len(names) == len(set(names)) and sorted(sources) == sorted(names)
    # Exactly once: the sources' boxes cover each stored tensor with no gap and no overlap.
    for tensor in checkpoint.tensors():
        check_tiling(tensor.shape, [s.box for s in sources.values() if s.stored == tensor.name])
    shapes = megatron_shapes(model.spec)
    expert = sources["decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight"]
    assert expert.stacked == 2 and checkpoint.source_nbytes(expert) == 2 * FFN * HIDDEN * 4
    assert {file[:3] for file in checkpoint.source_files(expert)} == {"__2", "__3"}, "expert rank 1's files"
    for name in ("decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight",
                 "decoder.layers.0.mlp.experts.local_experts.0.linear_fc2.weight",
                 "decoder.layers.0.mlp.router.weight", "output_layer.weight"):
        assert tuple(checkpoint.read_source(sources[name]).shape) == shapes[name], name


def test_torch_dist_moe_converts_to_qwen3_moe_with_megatrons_logits(moe_torch_dist, tmp_path):
    import transformers

    model, config = describe(moe_torch_dist)
    convert_planned(moe_torch_dist, tmp_path / "hf", model.spec, config=config, max_shard_bytes=100_000,
                    memory_budget_bytes=1 << 30, workers=2)
    loaded = transformers.AutoConfig.from_pretrained(tmp_path / "hf")
    assert (loaded.model_type, loaded.num_experts, loaded.num_experts_per_tok, loaded.moe_intermediate_size,
            loaded.norm_topk_prob, loaded.head_dim, loaded.rms_norm_eps) == ("qwen3_moe", EXPERTS, 2, FFN, True,
                                                                             HIDDEN // 4, 1e-5)
    ours, hf_model = hf_logits(tmp_path / "hf")
    reference = torch.load(logits_path(moe_torch_dist), weights_only=True)
    assert ours.shape == reference.shape
    assert torch.allclose(ours, reference, atol=TOLERANCE, rtol=0), float((ours - reference).abs().max())
    # The bound is tight enough to see an expert in the wrong place (e.g. EP-local numbering).
    experts = hf_model.model.layers[0].mlp.experts
    with torch.no_grad():
        for weight in (experts.gate_up_proj, experts.down_proj):
            weight[[0, 2]] = weight[[2, 0]].clone()
        swapped = hf_model(torch.tensor(PROBE_IDS)).logits
    assert (swapped - reference).abs().max() > 100 * TOLERANCE


def test_legacy_expert_parallel_folders_hold_the_same_model_and_convert_to_it(moe_legacy, moe_torch_dist, tmp_path):
    # Megatron-LM's naming without pipeline parallelism: mp_rank_{tp:02d}_{ep:03d}.
    assert sorted(p.name for p in moe_legacy.iterdir()) == [
        "mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000", "mp_rank_01_001"]
    legacy = LegacyCheckpoint(moe_legacy)
    assert (legacy.tp, legacy.pp, legacy.ep) == (2, 1, 2)
    merged = legacy.global_state()
    checkpoint = TorchDistCheckpoint(moe_torch_dist)
    sources = layer_sources(checkpoint)
    assert sorted(merged) == sorted(sources)
    assert all(torch.equal(merged[name], checkpoint.read_source(source)) for name, source in sources.items())

    model, config = describe(moe_legacy)
    convert_legacy_to_hf(moe_legacy, tmp_path / "hf", model.spec, config=config, max_shard_bytes=100_000)
    ours, _ = hf_logits(tmp_path / "hf")
    reference = torch.load(logits_path(moe_legacy), weights_only=True)
    assert torch.allclose(ours, reference, atol=TOLERANCE, rtol=0), float((ours - reference).abs().max())


def test_transformer_engine_names_in_rank_files_read_as_the_same_experts(moe_legacy, tmp_path):
    """The same rank files as the Transformer-Engine spec names their tensors (TEGroupedMLP: a
    rank's experts as gemms ``linear_fc1.weight{i}``, local i; the fused input layer norm)."""
    import re

    renamed = tmp_path / "te"
    for rank_dir in moe_legacy.iterdir():
        saved = torch.load(rank_dir / "model_optim_rng.pt", weights_only=False)
        saved["model"] = {
            re.sub(r"experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight$", r"experts.\2.weight\1",
                   name.replace("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight")): value
            for name, value in saved["model"].items()}
        (renamed / rank_dir.name).mkdir(parents=True)
        torch.save(saved, renamed / rank_dir.name / "model_optim_rng.pt")
    assert "decoder.layers.1.mlp.experts.linear_fc2.weight1" in saved["model"]
    ours, theirs = LegacyCheckpoint(renamed).global_state(), LegacyCheckpoint(moe_legacy).global_state()
    assert sorted(ours) == sorted(theirs) and all(torch.equal(ours[name], theirs[name]) for name in theirs)


def test_a_missing_expert_rank_of_the_legacy_format_is_named(moe_legacy, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(moe_legacy, broken)
    shutil.rmtree(broken / "mp_rank_01_001")
    with pytest.raises(CheckpointReadError, match="rank folders missing: mp_rank_01_001"):
        LegacyCheckpoint(broken)


def test_mixtral_config_sizes_its_experts_by_intermediate_size():
    import transformers

    from rollmesh.checkpoint.arch_maps import ArchSpec

    spec = ArchSpec(family="mixtral", num_layers=2, hidden_size=64, num_heads=4, num_query_groups=2, head_dim=16,
                    ffn_hidden_size=128, vocab_size=300, padded_vocab_size=300, num_experts=4,
                    moe_ffn_hidden_size=32)
    config = hf_config(spec, norm_epsilon=1e-6, rope_theta=1e6, max_position_embeddings=64, dtype=torch.float32,
                       moe_top_k=2)
    loaded = transformers.MixtralConfig(**{k: v for k, v in config.items() if k != "model_type"})
    assert (loaded.num_local_experts, loaded.num_experts_per_tok, loaded.intermediate_size, loaded.head_dim,
            loaded.rms_norm_eps) == (4, 2, 32, 16, 1e-6)
    model = transformers.MixtralForCausalLM(loaded)
    assert tuple(model.model.layers[0].mlp.experts.down_proj.shape) == (4, 64, 32)


def test_routing_no_hf_model_reproduces_is_refused_by_name():
    base = dict(num_layers=2, hidden_size=64, num_attention_heads=4, group_query_attention=True, num_query_groups=2,
                ffn_hidden_size=128, padded_vocab_size=300, num_experts=4, moe_ffn_hidden_size=32, qk_layernorm=True)
    assert describe_model(argparse.Namespace(**base)).spec.family == "qwen3_moe"
    for option, value in (("moe_router_pre_softmax", True), ("moe_router_score_function", "sigmoid"),
                          ("moe_shared_expert_intermediate_size", 64), ("moe_layer_freq", [1, 0])):
        with pytest.raises(CheckpointReadError, match=option):
            describe_model(argparse.Namespace(**base, **{option: value}))
