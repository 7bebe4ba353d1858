"""Our HF-compatible model families against transformers on the same random weights.

Each tiny model is built locally from a transformers config with a fixed seed (nothing is
downloaded), saved with small shards so the index is exercised, loaded by our loader, and its
float32 logits compared with transformers' within LOGITS_TOLERANCE.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="transformers is the reference these tests compare against; pip install .[test]"
)

from rollmesh.engine.errors import WeightsFileError  # noqa: E402
from rollmesh.engine.models import (  # noqa: E402
    CheckpointKeysError,
    ModelConfigError,
    UnsupportedModelTypeError,
    build_causal_lm,
    load_hf_model,
    load_state_dict_strict,
    parse_hf_config,
    read_hf_config,
    split_fused_experts,
)

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

# float32 on CPU: our ops mirror HF's order (float32 RMSNorm, the same SDPA kernel), so the
# difference observed is 0 to ~1e-7; the bound leaves room for other kernels and thread counts.
LOGITS_TOLERANCE = 1e-4

TINY = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=300,
    intermediate_size=128,
)
TINY_MOE = dict(num_experts_per_tok=2, moe_intermediate_size=64)


def _hf_model(kind: str, **overrides):
    if kind == "llama":
        config = transformers.LlamaConfig(**TINY, **overrides)
        cls = transformers.LlamaForCausalLM
    elif kind == "qwen2":
        config = transformers.Qwen2Config(**TINY, **overrides)
        cls = transformers.Qwen2ForCausalLM
    elif kind == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(**TINY, **TINY_MOE, num_experts=4, **overrides)
        cls = transformers.Qwen3MoeForCausalLM
    else:
        config = transformers.MixtralConfig(**TINY, num_local_experts=4, num_experts_per_tok=2, **overrides)
        cls = transformers.MixtralForCausalLM
    torch.manual_seed(0)
    model = cls(config).eval()
    # HF's init (std 0.02, norms at one, a near-uniform router) would hide swapped norms or
    # routing bugs; give every tensor an O(0.1-1) random value instead.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif name.endswith("gate.weight"):
                p.normal_(0, 1.0)
            else:
                p.normal_(0, 0.1)
    return model


def _save(model, path: Path) -> Path:
    model.save_pretrained(path, max_shard_size="50KB")
    return path


def _input_ids() -> torch.Tensor:
    return torch.randint(0, TINY["vocab_size"], (3, 19), generator=torch.Generator().manual_seed(7))


CASES = {
    "llama-untied": ("llama", dict(tie_word_embeddings=False)),
    "llama-tied-biased": ("llama", dict(tie_word_embeddings=True, attention_bias=True, mlp_bias=True)),
    "qwen2-untied": ("qwen2", dict(tie_word_embeddings=False, rope_theta=1e6)),
    "qwen2-tied": ("qwen2", dict(tie_word_embeddings=True)),
    "qwen3_moe-norm-topk": ("qwen3_moe", dict(norm_topk_prob=True)),
    "qwen3_moe-raw-topk-mixed-layers": ("qwen3_moe", dict(norm_topk_prob=False, mlp_only_layers=[0])),
    "mixtral": ("mixtral", dict()),
    "mixtral-sliding-window": ("mixtral", dict(sliding_window=8)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers_from_sharded_checkpoint(case: str, tmp_path: Path) -> None:
    kind, overrides = CASES[case]
    reference = _hf_model(kind, **overrides)
    path = _save(reference, tmp_path)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1, "the checkpoint should be sharded"

    ours = load_hf_model(path)
    ids = _input_ids()
    with torch.no_grad():
        expected = reference(ids).logits
        got = ours(ids)
    assert got.shape == (3, 19, TINY["vocab_size"])
    assert (got - expected).abs().max().item() < LOGITS_TOLERANCE


@pytest.mark.parametrize("tied", [True, False])
def test_tied_embeddings_share_one_tensor_and_untied_do_not(tied: bool, tmp_path: Path) -> None:
    path = _save(_hf_model("llama", tie_word_embeddings=tied), tmp_path)
    ours = load_hf_model(path)
    shared = ours.lm_head.weight.data_ptr() == ours.model.embed_tokens.weight.data_ptr()
    assert shared is tied


def test_single_file_checkpoint_loads(tmp_path: Path) -> None:
    reference = _hf_model("qwen2")
    reference.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists()
    ids = _input_ids()
    with torch.no_grad():
        diff = (load_hf_model(tmp_path)(ids) - reference(ids).logits).abs().max().item()
    assert diff < LOGITS_TOLERANCE


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
def test_routed_expert_ids_equal_top_k_of_transformers_router(kind: str, tmp_path: Path) -> None:
    reference = _hf_model(kind)
    router_logits: list[torch.Tensor] = []
    for layer in reference.model.layers:
        # transformers 5 names the block "mlp" for both families; its router returns logits first.
        layer.mlp.gate.register_forward_hook(lambda _m, _i, out: router_logits.append(out[0]))
    ours = load_hf_model(_save(reference, tmp_path))
    ids = _input_ids()
    with torch.no_grad():
        reference(ids)
        _, routes = ours.forward_with_routes(ids)
    assert len(router_logits) == 2, "the hooks should see both sparse layers"
    assert routes is not None and routes.dtype == torch.uint8
    assert routes.shape == (3, 19, 2, 2)  # [batch, tokens, sparse layers, top_k]
    for layer, logits in enumerate(router_logits):
        expected = torch.topk(logits, k=2, dim=-1).indices.view(3, 19, 2)
        assert torch.equal(routes[:, :, layer].long().sort(-1).values, expected.sort(-1).values)


def test_dense_model_reports_no_routes(tmp_path: Path) -> None:
    ours = load_hf_model(_save(_hf_model("llama"), tmp_path))
    with torch.no_grad():
        _, routes = ours.forward_with_routes(_input_ids())
    assert routes is None


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
def test_live_transformers_moe_state_dict_loads_after_splitting_fused_experts(kind: str) -> None:
    reference = _hf_model(kind)
    config = parse_hf_config(reference.config.to_dict())
    ours = build_causal_lm(config)
    load_state_dict_strict(ours, split_fused_experts(reference.state_dict(), config))
    ids = _input_ids()
    with torch.no_grad():
        assert (ours(ids) - reference(ids).logits).abs().max().item() < LOGITS_TOLERANCE


def test_strict_load_lists_missing_and_unexpected_keys(tmp_path: Path) -> None:
    reference = _hf_model("llama")
    state = dict(reference.state_dict())
    state.pop("model.layers.1.mlp.up_proj.weight")
    state["model.layers.9.mlp.up_proj.weight"] = torch.zeros(1)
    state["model.norm.weight"] = torch.zeros(3)
    ours = build_causal_lm(parse_hf_config(reference.config.to_dict()))
    with pytest.raises(CheckpointKeysError) as info:
        load_state_dict_strict(ours, state, path="somewhere")
    error = info.value
    assert error.missing == ["model.layers.1.mlp.up_proj.weight"]
    assert error.unexpected == ["model.layers.9.mlp.up_proj.weight"]
    assert error.mismatched == ["model.norm.weight (3,) != (64,)"]
    assert "model.layers.1.mlp.up_proj.weight" in str(error) and "somewhere" in str(error)


def test_checkpoint_with_a_dropped_shard_tensor_is_refused(tmp_path: Path) -> None:
    path = _save(_hf_model("llama"), tmp_path)
    index_path = path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    del index["weight_map"]["model.layers.0.self_attn.k_proj.weight"]
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointKeysError) as info:
        load_hf_model(path)
    assert info.value.missing == ["model.layers.0.self_attn.k_proj.weight"]


def test_directory_without_safetensors_is_a_weights_file_error(tmp_path: Path) -> None:
    _hf_model("llama").config.save_pretrained(tmp_path)
    with pytest.raises(WeightsFileError):
        load_hf_model(tmp_path)


def test_unsupported_model_type_is_refused_by_name(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(UnsupportedModelTypeError) as info:
        read_hf_config(tmp_path)
    assert info.value.model_type == "gpt2" and "llama" in str(info.value)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"hidden_size": "wide"}, "hidden_size"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling"),
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        ({"use_sliding_window": True}, "use_sliding_window"),
    ],
)
def test_config_fields_we_cannot_honour_raise_a_typed_error(change: dict, field: str) -> None:
    raw = {"model_type": "qwen2", **TINY, **change}
    with pytest.raises(ModelConfigError) as info:
        parse_hf_config(raw)
    assert info.value.field == field


def test_hub_style_qwen3_moe_config_parses() -> None:
    # transformers 4.x / hub configs: top-level rope_theta, num_experts, explicit head_dim.
    raw = {
        "model_type": "qwen3_moe", **TINY, "head_dim": 32, "rope_theta": 1e6, "rope_scaling": None,
        "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [1],
    }
    config = parse_hf_config(raw)
    assert config.head_dim == 32 and config.rope_theta == 1e6 and config.qk_norm
    assert config.moe is not None and config.moe.num_experts == 8 and config.moe.sparse_layers == (0,)
