"""The torch_dist reader on a real Megatron-core checkpoint (TP=2, written once per session on CPU
under gloo): its plan comes from the index alone, every tensor reads back exactly as torch's own
DCP loader assembles it, parts read alone, and broken shard files are named in the error."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from support.megatron_checkpoints import TINY_DENSE
from test_cli import restore_logging_config  # noqa: F401  (autouse: main() sets up logging)
from rollmesh.checkpoint.arch_maps import canonical_megatron_name
from rollmesh.checkpoint.chunk_geometry import Box
from rollmesh.checkpoint.errors import CheckpointReadError
from rollmesh.checkpoint.torch_dist_reader import TorchDistCheckpoint, layer_box, per_layer_name, stacked_source

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


@pytest.fixture(scope="session")
def reference(dense_tp2, tmp_path_factory):
    """The same checkpoint as torch's own converter assembles it (whole, in one process)."""
    out = tmp_path_factory.mktemp("reference") / "whole.pt"
    dcp_to_torch_save(dense_tp2, out)
    return torch.load(out, weights_only=False)


def test_the_index_holds_tp_sharded_layer_stacked_tensors_that_tile_exactly(dense_tp2):
    checkpoint = TorchDistCheckpoint(dense_tp2)
    checkpoint.check()
    tensors = {t.name: t for t in checkpoint.tensors()}
    qkv = tensors["decoder.layers.self_attention.linear_qkv.weight"]
    groups, heads = TINY_DENSE["num_query_groups"], TINY_DENSE["num_attention_heads"]
    head_dim = TINY_DENSE["hidden_size"] // heads
    assert qkv.shape == (TINY_DENSE["num_layers"], (heads + 2 * groups) * head_dim, TINY_DENSE["hidden_size"])
    assert len(qkv.chunks) == 4, "two layers x two tensor-parallel ranks"
    assert len({chunk.file for chunk in qkv.chunks}) >= 2, "the ranks wrote different files"
    # Megatron names (fused layer norms) fold into the architecture map's names.
    assert canonical_megatron_name(per_layer_name("decoder.layers.self_attention.linear_qkv.layer_norm_weight", 1)) \
        == "decoder.layers.1.input_layernorm.weight"


def test_every_tensor_reads_back_as_torchs_own_loader_assembles_it(dense_tp2, reference):
    checkpoint = TorchDistCheckpoint(dense_tp2)
    names = {t.name for t in checkpoint.tensors()}
    assert names == {k for k, v in reference.items() if isinstance(v, torch.Tensor)}
    for name in sorted(names):
        assert torch.equal(checkpoint.read_region(name), reference[name]), name


def test_one_layer_or_any_box_reads_alone(dense_tp2, reference):
    checkpoint = TorchDistCheckpoint(dense_tp2)
    fc1 = checkpoint.tensor("decoder.layers.mlp.linear_fc1.weight")
    assert torch.equal(checkpoint.read_region(fc1.name, layer_box(fc1, 1)), reference[fc1.name][1:2])
    stacked = {t.name for t in checkpoint.tensors()}
    assert stacked_source("decoder.layers.1.mlp.linear_fc1.weight", stacked) == (fc1.name, 1)
    # A box across both ranks' chunks (rows 60-70 straddle the TP boundary at 64).
    box = Box((0, 60, 5), (2, 10, 7))
    assert torch.equal(checkpoint.read_region(fc1.name, box), reference[fc1.name][0:2, 60:70, 5:12])


def test_a_missing_or_corrupt_shard_file_is_named_in_the_error(dense_tp2, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(dense_tp2, broken)
    checkpoint = TorchDistCheckpoint(broken)
    qkv = checkpoint.tensor("decoder.layers.self_attention.linear_qkv.weight")
    victim = qkv.chunks[0].file
    (broken / victim).write_bytes(b"\0" * (broken / victim).stat().st_size)
    with pytest.raises(CheckpointReadError, match=f"shard file {victim} is corrupt"):
        checkpoint.read_region(qkv.name)
    (broken / victim).unlink()
    with pytest.raises(CheckpointReadError, match=f"shard file {victim} is missing"):
        checkpoint.read_region(qkv.name)
    (broken / ".metadata").unlink()
    with pytest.raises(CheckpointReadError, match="not a torch_dist checkpoint"):
        TorchDistCheckpoint(broken)


def test_a_converted_checkpoint_loads_in_transformers_with_megatrons_logits(dense_tp2, tmp_path):
    import transformers

    from support.megatron_checkpoints import PROBE_IDS, logits_path
    from rollmesh.checkpoint.arch_maps import ArchSpec
    from rollmesh.checkpoint.convert_executor import convert_planned
    from rollmesh.checkpoint.megatron_to_hf import hf_config

    heads = TINY_DENSE["num_attention_heads"]
    spec = ArchSpec(family="llama", num_layers=TINY_DENSE["num_layers"], hidden_size=TINY_DENSE["hidden_size"],
                    num_heads=heads, num_query_groups=TINY_DENSE["num_query_groups"],
                    head_dim=TINY_DENSE["hidden_size"] // heads, ffn_hidden_size=TINY_DENSE["ffn_hidden_size"],
                    vocab_size=TINY_DENSE["vocab_size"], padded_vocab_size=TINY_DENSE["vocab_size"])
    # megatron-core's defaults for what the model was built with: RMSNorm eps 1e-5, RoPE base 10000.
    config = hf_config(spec, norm_epsilon=1e-5, rope_theta=10000.0, max_position_embeddings=64, dtype=torch.float32)
    files = convert_planned(dense_tp2, tmp_path / "hf", spec, config=config, max_shard_bytes=200_000,
                            memory_budget_bytes=1 << 30, workers=2)
    assert files[-3:] == ["sha256_manifest.json", "config.json", "model.safetensors.index.json"] and len(files) > 4, (
        "sharded, index last")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        ours = model(torch.tensor(PROBE_IDS)).logits
    reference = torch.load(logits_path(dense_tp2), weights_only=True)
    # float32 on CPU: measured 1.5e-7 apart (logits up to 0.6); the bound leaves room for kernels.
    assert ours.shape == reference.shape
    assert torch.allclose(ours, reference, atol=1e-4, rtol=0), float((ours - reference).abs().max())


def test_rollmesh_convert_reads_the_model_from_the_save_root_and_writes_what_transformers_loads(
        dense_tp2, tmp_path, capsys):
    import transformers

    from support.megatron_checkpoints import PROBE_IDS, logits_path
    from rollmesh.cli import main

    root = tmp_path / "save"
    shutil.copytree(dense_tp2, root / "iter_0000010")
    (root / "latest_checkpointed_iteration.txt").write_text("10\n")

    assert main(["convert", str(root), str(tmp_path / "plan"), "--dry-run"]) == 0
    planned = capsys.readouterr().out
    assert "torch_dist, llama, 2 layers" in planned and "model-00001-of-" in planned
    assert not (tmp_path / "plan").exists(), "a dry run writes nothing"
    assert main(["convert", str(root), str(tmp_path / "x"), "--target-tp", "0"]) == 2

    assert main(["convert", str(root), str(tmp_path / "hf"), "--dtype", "bfloat16"]) == 0
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["num_key_value_heads"], config["rms_norm_eps"], config["dtype"]) == (2, 1e-5, "bfloat16")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    with torch.no_grad():
        ours = model(torch.tensor(PROBE_IDS)).logits
    # bfloat16 weights: measured 1.6e-3 from the float32 reference (logits up to 0.6).
    assert torch.allclose(ours, torch.load(logits_path(dense_tp2), weights_only=True), atol=3e-2, rtol=0)


def test_the_legacy_per_rank_format_converts_to_the_same_model(legacy_tp2, tmp_path):
    import transformers

    from support.megatron_checkpoints import PROBE_IDS, logits_path
    from rollmesh.cli import main

    assert sorted(p.name for p in legacy_tp2.iterdir()) == ["mp_rank_00", "mp_rank_01"]
    assert main(["convert", str(legacy_tp2), str(tmp_path / "hf")]) == 0
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        ours = model(torch.tensor(PROBE_IDS)).logits
    assert torch.allclose(ours, torch.load(logits_path(legacy_tp2), weights_only=True), atol=1e-4, rtol=0)


def test_a_missing_rank_of_the_legacy_format_is_named(legacy_tp2, tmp_path):
    from rollmesh.checkpoint.legacy_reader import LegacyCheckpoint

    broken = tmp_path / "broken"
    shutil.copytree(legacy_tp2, broken)
    (broken / "mp_rank_01" / "model_optim_rng.pt").write_bytes(b"not a torch file")
    with pytest.raises(CheckpointReadError, match="shard file mp_rank_01/model_optim_rng.pt is corrupt"):
        LegacyCheckpoint(broken).global_state()
    shutil.rmtree(broken / "mp_rank_01")
    shutil.copytree(legacy_tp2 / "mp_rank_01", broken / "mp_rank_02")
    with pytest.raises(CheckpointReadError, match="rank folders missing: mp_rank_01"):
        LegacyCheckpoint(broken)


def test_resharding_to_tp2_per_rank_files_gives_megatrons_own_rank_shards(dense_tp2, legacy_tp2, tmp_path, capsys):
    """The same model saved by megatron-core as torch_dist and as per-rank files: resharding the
    first to tensor parallel 2 reproduces the second's shards bit for bit, rank by rank."""
    from rollmesh.cli import main

    assert main(["convert", str(dense_tp2), str(tmp_path / "tp2"), "--target-tp", "2"]) == 0
    for rank in (0, 1):
        ours = torch.load(tmp_path / "tp2" / f"mp_rank_{rank:02d}" / "model_optim_rng.pt", weights_only=False)
        theirs = torch.load(legacy_tp2 / f"mp_rank_{rank:02d}" / "model_optim_rng.pt", weights_only=False)["model"]
        theirs = {canonical_megatron_name(k): v for k, v in theirs.items() if isinstance(v, torch.Tensor)}
        assert sorted(ours["model"]) == sorted(theirs)
        assert all(torch.equal(ours["model"][name], theirs[name]) for name in theirs), rank
        assert ours["args"].tensor_model_parallel_size == 2
    # 2 query groups cannot be spread over 4 ranks: refused, nothing written.
    assert main(["convert", str(dense_tp2), str(tmp_path / "tp4"), "--target-tp", "4"]) == 2
    assert "2 query groups do not split over 4" in capsys.readouterr().err and not (tmp_path / "tp4").exists()


def test_legacy_pipeline_stages_merge_into_the_same_model(legacy_tp2, tmp_path):
    """Megatron-LM's pipeline-parallel naming, mp_rank_TT_PPP: each stage holds its layers under
    local numbers (the second stage's first layer is its layer 0); the reader renumbers them."""
    import re

    from rollmesh.checkpoint.legacy_reader import LegacyCheckpoint

    staged = tmp_path / "tp2_pp2"
    for tp in range(2):
        saved = torch.load(legacy_tp2 / f"mp_rank_{tp:02d}" / "model_optim_rng.pt", weights_only=False)
        saved["args"].pipeline_model_parallel_size = 2
        stages: list[dict] = [{}, {}]
        for name, value in saved["model"].items():
            layer = re.match(r"^decoder\.layers\.(\d+)\.(.*)$", name)
            if layer is not None:  # layer 0 on stage 0, layer 1 on stage 1 as its local layer 0
                stages[int(layer.group(1))][f"decoder.layers.0.{layer.group(2)}"] = value
            else:  # embedding on the first stage, final norm and output layer on the last
                stages[0 if name.startswith("embedding") else 1][name] = value
        for pp, model in enumerate(stages):
            folder = staged / f"mp_rank_{tp:02d}_{pp:03d}"
            folder.mkdir(parents=True)
            torch.save({**saved, "model": model}, folder / "model_optim_rng.pt")
    merged = LegacyCheckpoint(staged)
    assert (merged.tp, merged.pp, merged.ep) == (2, 2, 1)
    original = LegacyCheckpoint(legacy_tp2).global_state()
    stitched = merged.global_state()
    assert sorted(stitched) == sorted(original)
    assert all(torch.equal(stitched[name], original[name]) for name in original)
