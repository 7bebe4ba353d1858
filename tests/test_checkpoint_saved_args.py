"""Saved training arguments that are None (other Megatron front ends write None for options a
model does not use), through the real ``rollmesh convert`` on real megatron-core checkpoints
(dense at tensor parallel 2; MoE at tensor parallel 2 x expert parallel 2). Each argument, set to
None in turn, has one of three outcomes:
- SAME: it does not apply to the model, or Megatron-LM gives its None a meaning that is this
  model's: the conversion gives the same tensors and config.json as the checkpoint as saved;
- NEEDED: the model needs it: refused by name (``CheckpointArgumentError``), one error line, exit 1;
- TENSORS: a switch that None turns off (as Megatron-LM reads it), or a size whose None Megatron
  derives otherwise than this model was built: the checkpoint's tensors refuse it, one error line.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import pytest
import torch

from rollmesh.checkpoint.errors import CheckpointArgumentError, CheckpointReadError
from rollmesh.checkpoint.hf_writer import read_hf_checkpoint
from rollmesh.checkpoint.legacy_reader import RANK_FILE, LegacyCheckpoint
from rollmesh.checkpoint.megatron_args import COMMON_FILE, describe_model
from rollmesh.checkpoint.megatron_export import inspect_source
from rollmesh.cli import main
from rollmesh.cli.errors import EXIT_FAILURE

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

SAME, NEEDED, TENSORS = "same", "needed", "tensors"

MOE_ONLY = ("moe_router_topk", "moe_ffn_hidden_size", "moe_router_pre_softmax", "moe_router_score_function",
            "moe_router_load_balancing_type", "moe_token_dispatcher_type", "moe_grouped_gemm",
            "moe_router_topk_scaling_factor", "moe_router_enable_expert_bias", "moe_shared_expert_intermediate_size",
            "moe_router_num_groups", "moe_layer_freq", "expert_tensor_parallel_size")
DENSE = {
    # The model cannot be known without them.
    "num_layers": NEEDED, "hidden_size": NEEDED, "num_attention_heads": NEEDED, "num_query_groups": NEEDED,
    "padded_vocab_size": NEEDED, "norm_epsilon": NEEDED, "rotary_base": NEEDED, "max_position_embeddings": NEEDED,
    # Megatron-LM's meaning of None (hidden // heads, its ffn default, no padding, float32 without
    # bf16/fp16, no experts) is this model's.
    "kv_channels": SAME, "ffn_hidden_size": SAME, "vocab_size": SAME, "params_dtype": SAME, "num_experts": SAME,
    # Switches and feature options: None is off, as this model has them (rope, whole and plain).
    "swiglu": SAME, "add_qkv_bias": SAME, "qk_layernorm": SAME, "bf16": SAME, "fp16": SAME,
    "position_embedding_type": SAME, "rotary_percent": SAME, "rotary_interleaved": SAME, "use_rope_scaling": SAME,
    "rotary_seq_len_interpolation_factor": SAME,
    # Switches that this model has on: None turns them off, and the tensors say otherwise.
    "group_query_attention": TENSORS, "untie_embeddings_and_output_weights": TENSORS,
    # Not the converter's business (the layout is read from the files), or the other spelling.
    "normalization": SAME, "tensor_model_parallel_size": SAME, "pipeline_model_parallel_size": SAME,
    "expert_model_parallel_size": SAME, "layernorm_epsilon": SAME,
    # What a dense model does not use.
    **dict.fromkeys(MOE_ONLY, SAME),
}
MOE = {
    **DENSE,
    "moe_router_topk": NEEDED,
    # None: no experts, no QK norms (Mixtral then), or Megatron-LM's moe_ffn_hidden_size =
    # ffn_hidden_size (128, where this model's experts have 32): not this model.
    "num_experts": TENSORS, "qk_layernorm": TENSORS, "moe_ffn_hidden_size": TENSORS,
}


def saved_args(checkpoint: Path) -> argparse.Namespace:
    return torch.load(checkpoint / COMMON_FILE, weights_only=False)["args"]


def with_none(checkpoint: Path, out: Path, name: str) -> Path:
    """A copy of the torch_dist ``checkpoint`` whose saved ``args`` carry ``name = None``."""
    shutil.copytree(checkpoint, out)
    common = torch.load(out / COMMON_FILE, weights_only=False)
    setattr(common["args"], name, None)
    torch.save(common, out / COMMON_FILE)
    return out


def convert(src: Path, dst: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, list[str]]:
    capsys.readouterr()
    code = main(["convert", str(src), str(dst)])
    return code, capsys.readouterr().err.strip().splitlines()


def assert_same_export(directory: Path, reference: Path) -> None:
    ours, theirs = read_hf_checkpoint(directory), read_hf_checkpoint(reference)
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[name], theirs[name]) for name in ours)
    assert json.loads((directory / "config.json").read_text()) == json.loads((reference / "config.json").read_text())


@pytest.fixture(scope="module")
def dense_reference(dense_tp2: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("saved_args") / "dense_hf"
    assert main(["convert", str(dense_tp2), str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def moe_reference(moe_torch_dist: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("saved_args") / "moe_hf"
    assert main(["convert", str(moe_torch_dist), str(out)]) == 0
    return out


def check_none(outcome: str, name: str, checkpoint: Path, reference: Path, tmp_path: Path,
               capsys: pytest.CaptureFixture[str]) -> None:
    src = with_none(checkpoint, tmp_path / "src", name)
    code, err = convert(src, tmp_path / "hf", capsys)
    if outcome == SAME:
        assert code == 0 and not [line for line in err if "error" in line], err  # progress lines only
        assert_same_export(tmp_path / "hf", reference)
        return
    assert code == EXIT_FAILURE and len(err) == 1, err
    assert not (tmp_path / "hf").exists()
    if outcome == NEEDED:
        assert err[0].startswith(f"rollmesh: error: cannot read checkpoint: saved argument {name} = None: "), err
        with pytest.raises(CheckpointArgumentError) as refused:
            inspect_source(src)
        assert (refused.value.argument, refused.value.value, refused.value.path) == (name, None, str(src))
    else:
        assert err[0].startswith("rollmesh: error: cannot read checkpoint: ") and (
            "does not fit" in err[0] or "tensor shapes differ" in err[0]), err


@pytest.mark.parametrize("name", sorted(DENSE))
def test_a_dense_checkpoint_with_an_argument_saved_as_none_converts_or_is_refused_by_name(
        name, dense_tp2, dense_reference, tmp_path, capsys):
    check_none(DENSE[name], name, dense_tp2, dense_reference, tmp_path, capsys)


@pytest.mark.parametrize("name", sorted(MOE))
def test_an_moe_checkpoint_with_an_argument_saved_as_none_converts_or_is_refused_by_name(
        name, moe_torch_dist, moe_reference, tmp_path, capsys):
    check_none(MOE[name], name, moe_torch_dist, moe_reference, tmp_path, capsys)


def test_every_argument_the_checkpoint_writers_save_is_among_those_tried(dense_tp2, moe_torch_dist):
    assert set(vars(saved_args(dense_tp2))) <= set(DENSE)
    assert set(vars(saved_args(moe_torch_dist))) <= set(MOE)


def test_a_moe_checkpoint_of_per_rank_files_needs_its_expert_parallel_size_to_name_its_folders(
        moe_legacy, moe_reference, tmp_path, capsys):
    """mp_rank_TT_NNN names a pipeline or an expert rank; for an MoE model only the saved
    expert_model_parallel_size tells which. The other parallel sizes may be None."""
    for name, outcome in (("expert_model_parallel_size", NEEDED), ("expert_tensor_parallel_size", SAME),
                          ("pipeline_model_parallel_size", SAME)):
        src = tmp_path / name
        shutil.copytree(moe_legacy, src)
        for rank_file in src.glob(f"mp_rank_*/{RANK_FILE}"):
            saved = torch.load(rank_file, weights_only=False)
            setattr(saved["args"], name, None)
            torch.save(saved, rank_file)
        code, err = convert(src, tmp_path / f"{name}_hf", capsys)
        if outcome == SAME:
            assert code == 0 and not [line for line in err if "error" in line], err
            assert_same_export(tmp_path / f"{name}_hf", moe_reference)
        else:
            assert code == EXIT_FAILURE and len(err) == 1, err
            assert f"saved argument {name} = None" in err[0]


def test_a_dense_models_expert_options_saved_as_none_leave_its_folders_pipeline_stages(tmp_path):
    args = argparse.Namespace(num_experts=None, expert_model_parallel_size=None, pipeline_model_parallel_size=None)
    for stage in range(2):
        (tmp_path / f"mp_rank_00_{stage:03d}").mkdir()
        torch.save({"model": {}, "args": args}, tmp_path / f"mp_rank_00_{stage:03d}" / RANK_FILE)
    checkpoint = LegacyCheckpoint(tmp_path)
    assert (checkpoint.tp, checkpoint.pp, checkpoint.ep) == (1, 2, 1)


BASE = dict(num_layers=2, hidden_size=64, num_attention_heads=4, group_query_attention=True, num_query_groups=2,
            ffn_hidden_size=128, padded_vocab_size=300, max_position_embeddings=64)


@pytest.mark.parametrize(("name", "value"), [
    ("hidden_size", "64"), ("num_layers", True), ("num_layers", 2.5), ("num_attention_heads", 0),
    ("num_query_groups", 0), ("num_query_groups", 3), ("kv_channels", -16), ("padded_vocab_size", [300]),
    ("vocab_size", 301), ("norm_epsilon", float("nan")), ("norm_epsilon", "1e-5"), ("rotary_base", 0),
    ("max_position_embeddings", None), ("params_dtype", "int8"), ("params_dtype", object()),
    ("untie_embeddings_and_output_weights", "yes"), ("group_query_attention", 2),
    ("position_embedding_type", 1), ("num_experts", -1),
])
def test_an_unreadable_argument_is_refused_by_name_never_a_bare_type_error(name, value):
    with pytest.raises(CheckpointArgumentError) as refused:
        describe_model(argparse.Namespace(**{**BASE, name: value}), path="ckpt")
    assert (refused.value.argument, refused.value.path) == (name, "ckpt")
    assert refused.value.value is value and isinstance(refused.value, CheckpointReadError)


@pytest.mark.parametrize(("name", "value"), [
    ("moe_router_topk", None), ("moe_router_topk", 5), ("moe_router_topk", "2"), ("moe_ffn_hidden_size", 0),
    ("moe_router_score_function", 1),
])
def test_an_unreadable_moe_argument_of_an_moe_model_is_refused_by_name(name, value):
    with pytest.raises(CheckpointArgumentError) as refused:
        describe_model(argparse.Namespace(**{**BASE, "num_experts": 4, name: value}), path="ckpt")
    assert refused.value.argument == name


def test_arguments_read_the_same_from_a_mapping_and_from_either_epsilon_spelling():
    """Megatron-LM core 0.16 saves --norm-epsilon as layernorm_epsilon; a front end may save a dict."""
    namespace = describe_model(argparse.Namespace(**BASE, norm_epsilon=1e-6))
    assert describe_model(dict(BASE, norm_epsilon=1e-6)) == namespace
    assert describe_model(dict(BASE, layernorm_epsilon=1e-6)) == namespace
    assert describe_model(dict(BASE, norm_epsilon=None, layernorm_epsilon=1e-6)) == namespace
    unset = describe_model(dict(BASE, group_query_attention=None, num_query_groups=None, kv_channels=None,
                                ffn_hidden_size=None, swiglu=True, params_dtype=None, bf16=True))
    assert (unset.spec.num_query_groups, unset.spec.head_dim, unset.spec.ffn_hidden_size, unset.dtype) == (
        4, 16, 128, torch.bfloat16)
