"""The torch trainer backend on Hugging Face families ("hf"): tiny random Llama (GQA, tied
embeddings) and Qwen3-MoE models built with transformers and saved as HF directories, trained by
the engine's own ``CausalLM``; routing replay in ``policy_step``; Megatron ``torch_dist``
checkpoints that ``export_to_hf`` and the resharder turn back into the same HF tensors and
hyperparameters.

The models get O(0.1-1) random weights (as in ``test_engine_hf_models``): HF's init keeps the
router near uniform, where a perturbed route would hardly change a logprob.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="transformers builds the reference HF checkpoints; pip install .[test]")

from rollmesh.checkpoint.hf_writer import read_hf_checkpoint  # noqa: E402
from rollmesh.checkpoint.megatron_export import ExportOptions, export_to_hf  # noqa: E402
from rollmesh.checkpoint.resharder import ResharderLogic  # noqa: E402
from rollmesh.checkpoint.torch_dist_reader import TorchDistCheckpoint  # noqa: E402
from rollmesh.config import ModelConfig, ResharderConfig, TrainerConfig  # noqa: E402
from rollmesh.engine.models import SparseMoeBlock, load_hf_model, read_hf_config, read_safetensors  # noqa: E402
from rollmesh.engine.weight_staging import WeightStager  # noqa: E402
from rollmesh.messages.checkpoint import CheckpointSaved  # noqa: E402
from rollmesh.training.grpo import PolicyBatch, PolicySample  # noqa: E402
from rollmesh.training.losses import token_logprobs  # noqa: E402
from rollmesh.training.megatron_checkpoint import (  # noqa: E402
    UnmappableModelError,
    describe_hf_model,
    save_megatron_checkpoint,
)
from rollmesh.training.router_replay import compact_rows  # noqa: E402
from rollmesh.training.torch_backend import TorchTrainerBackend  # noqa: E402

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]

TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=300,
            intermediate_size=128)
# Non-default hyperparameters, so a round trip that fell back to a default would show.
LLAMA = dict(TINY, tie_word_embeddings=True, rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=256,
             eos_token_id=2)
QWEN3_MOE = dict(TINY, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                 tie_word_embeddings=False, rope_theta=20000.0)
EXPERTS, TOP_K = 4, 2


def _save_hf_model(kind: str, directory: Path) -> Path:
    if kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA))
    else:
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**QWEN3_MOE))
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif name.endswith("gate.weight"):
                p.normal_(0, 1.0)
            else:
                p.normal_(0, 0.1)
    model.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf_models")
    return {kind: _save_hf_model(kind, root / kind) for kind in ("llama", "qwen3_moe")}


def backend_for(directory: Path, **trainer) -> TorchTrainerBackend:
    settings = dict(lr=1e-3, ppo_epochs=1, seed=0) | trainer
    return TorchTrainerBackend(ModelConfig(path=str(directory)), TrainerConfig(**settings))


def sequences(seed: int = 0) -> list[tuple[list[int], list[int]]]:
    """(tokens, loss mask) of two lengths, so the batch is right-padded."""
    rng = np.random.default_rng(seed)
    out = []
    for length in (12, 7):
        tokens = rng.integers(3, TINY["vocab_size"], length).tolist()
        out.append((tokens, [0] * 3 + [1] * (length - 3)))
    return out


def on_policy_samples(backend: TorchTrainerBackend, advantage: float = 1.0) -> list[PolicySample]:
    """Samples whose behaviour logprobs are the backend's own now (ratio 1 at the first epoch)."""
    samples = []
    with torch.no_grad():
        for tokens, mask in sequences():
            ids = torch.tensor([tokens])
            logprobs = token_logprobs(backend.model(ids[:, :-1]), ids[:, 1:])[0].tolist()
            samples.append(PolicySample(tokens, mask, [0.0, *logprobs], advantage))
    return samples


def changed(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> bool:
    return any(not torch.equal(before[name], after[name]) for name in before)


def test_hf_llama_backend_sft_and_policy_steps_change_the_weights_and_lower_the_loss(hf_dirs):
    backend = backend_for(hf_dirs["llama"])
    assert all(p.dtype == torch.float32 and p.requires_grad for p in backend.model.parameters())
    start = backend.state_dict()
    losses = [backend.sft_step(sequences(), lr=3e-3) for _ in range(4)]
    assert losses[-1] < losses[0] and changed(start, backend.state_dict())

    samples = on_policy_samples(backend)
    before = backend.state_dict()
    stats = [backend.policy_step(samples, current_version=0) for _ in range(3)]
    # Positive advantages on fixed behaviour logprobs: each update raises the ratio, so the
    # clipped surrogate's loss (-ratio x A) falls from -1 at the first, on-policy epoch.
    assert stats[0]["mean_ratio"] == pytest.approx(1.0, abs=1e-5)
    assert stats[-1]["loss"] < stats[0]["loss"] and stats[-1]["mean_ratio"] > 1.0
    assert stats[0]["router_replay"] == 0.0  # dense: nothing to replay
    assert changed(before, backend.state_dict())


def test_right_padding_with_the_models_eos_id_changes_no_real_tokens_logprob(hf_dirs):
    backend = backend_for(hf_dirs["llama"])
    assert backend.pad_id == LLAMA["eos_token_id"]  # the byte tokenizer's PAD_ID (258) is no model id here
    (long_tokens, long_mask), (short_tokens, short_mask) = sequences()
    short = PolicySample(short_tokens, short_mask, [0.0] * len(short_tokens), 0.0)
    long = PolicySample(long_tokens, long_mask, [0.0] * len(long_tokens), 0.0)
    with torch.no_grad():
        alone = PolicyBatch.collate([short], pad_id=backend.pad_id)
        padded = PolicyBatch.collate([long, short], pad_id=backend.pad_id)
        own = token_logprobs(backend.model(alone.inputs), alone.targets)[0]
        beside = token_logprobs(backend.model(padded.inputs), padded.targets)[1, : len(short_tokens) - 1]
    torch.testing.assert_close(beside, own, rtol=0, atol=1e-5)


def test_hf_state_dict_has_the_inference_models_names_and_stages_into_an_engine_worker(hf_dirs):
    backend = backend_for(hf_dirs["llama"])
    backend.sft_step(sequences(), lr=3e-3)
    weights = backend.state_dict()
    engine = load_hf_model(hf_dirs["llama"])
    assert {k: v.shape for k, v in weights.items()} == {k: v.shape for k, v in engine.state_dict().items()}
    assert "lm_head.weight" in weights  # tied, yet listed: WeightStager expects every name the model has

    stager = WeightStager(engine)
    assert stager.stage(weights, 1) and stager.apply_staged() == 1
    ids = torch.tensor([sequences()[0][0]])
    with torch.no_grad():
        assert torch.equal(engine(ids), backend.model(ids))

    # Resuming from the HF files themselves (tied: no lm_head.weight) copies into the same
    # parameters, which the optimizer still holds.
    parameters = list(backend.model.parameters())
    backend.load_state_dict(read_safetensors(hf_dirs["llama"]))
    assert list(backend.model.parameters()) == parameters
    assert torch.equal(backend.model.lm_head.weight, read_safetensors(hf_dirs["llama"])["model.embed_tokens.weight"])


def recorded_routes(backend: TorchTrainerBackend, tokens: list[int]) -> np.ndarray:
    """The experts the model itself picks at each training input position (what an engine
    running these weights records), [len(tokens) - 1, sparse layers, top_k]."""
    with torch.no_grad():
        _, routes = backend.model.forward_with_routes(torch.tensor([tokens[:-1]]))
    return compact_rows(routes[0], num_experts=EXPERTS, routing_shape=backend.model.routing_shape)


def other_experts(rows: np.ndarray) -> np.ndarray:
    """Each row's complement: with 4 experts and top 2, the two experts the router did not pick."""
    out = np.empty_like(rows)
    for index in np.ndindex(rows.shape[:-1]):
        out[index] = sorted(set(range(EXPERTS)) - set(rows[index].tolist()))
    return out


def used_experts(backend: TorchTrainerBackend) -> tuple[list[torch.Tensor], list]:
    """Hooks collecting the expert ids every sparse block uses, [tokens, top_k] per call."""
    used: list[torch.Tensor] = []
    handles = [module.register_forward_hook(lambda _m, _i, out: used.append(out[1].detach().clone()))
               for module in backend.model.modules() if isinstance(module, SparseMoeBlock)]
    return used, handles


def test_qwen3_moe_policy_step_replays_the_recorded_experts(hf_dirs):
    backend = backend_for(hf_dirs["qwen3_moe"])
    samples = on_policy_samples(backend)
    perturbed = [dataclasses.replace(s, routed_experts=other_experts(recorded_routes(backend, s.tokens)))
                 for s in samples]
    seq_len = max(len(s.tokens) for s in samples) - 1
    routes = backend.replay_routes(perturbed, seq_len)
    assert routes is not None and routes.shape == (2, seq_len, 2, TOP_K)

    used, handles = used_experts(backend)
    stats = backend.policy_step(perturbed, current_version=0)
    for handle in handles:
        handle.remove()
    assert stats["router_replay"] == 1.0
    # One forward (ppo_epochs=1), one call per sparse layer: every real position used exactly
    # the recorded experts, not the router's own top k.
    assert len(used) == TINY["num_hidden_layers"]
    for layer, ids in enumerate(used):
        ids = ids.view(2, seq_len, TOP_K)
        for row, sample in enumerate(perturbed):
            real = len(sample.tokens) - 1
            assert torch.equal(ids[row, :real], torch.from_numpy(sample.routed_experts[:, layer].astype(np.int64)))
    # The behaviour logprobs came from the router's own choices: under the other experts the
    # first epoch's ratio is no longer 1.
    assert abs(stats["mean_ratio"] - 1.0) > 1e-3


def test_replay_of_the_models_own_choices_or_no_rows_leaves_the_step_unreplayed_in_effect(hf_dirs):
    own = backend_for(hf_dirs["qwen3_moe"])
    samples = on_policy_samples(own)
    with_rows = [dataclasses.replace(s, routed_experts=recorded_routes(own, s.tokens)) for s in samples]
    stats = own.policy_step(with_rows, current_version=0)
    assert stats["router_replay"] == 1.0 and stats["mean_ratio"] == pytest.approx(1.0, abs=1e-5)

    # One trained sample without rows: the whole batch routes by the trainer's router.
    partial = backend_for(hf_dirs["qwen3_moe"])
    mixed = [with_rows[0], samples[1]]
    assert partial.replay_routes(mixed, 11) is None
    assert partial.policy_step(mixed, current_version=0)["router_replay"] == 0.0
    # ...unless that sample failed (it trains nothing, its rows are never read).
    failed = [with_rows[0], dataclasses.replace(samples[1], infra_failed=True)]
    assert partial.replay_routes(failed, 11) is not None
    # And the switch turns replay off.
    off = backend_for(hf_dirs["qwen3_moe"], router_replay=False)
    assert off.replay_routes(with_rows, 11) is None


EXPECTED_KEYS = {
    # What megatron-core 0.16 (local spec) stores for these models, layer norms under its fused names.
    "llama": {"embedding.word_embeddings.weight", "decoder.final_layernorm.weight",
              "decoder.layers.self_attention.linear_qkv.layer_norm_weight",
              "decoder.layers.self_attention.linear_qkv.weight", "decoder.layers.self_attention.linear_proj.weight",
              "decoder.layers.mlp.linear_fc1.layer_norm_weight", "decoder.layers.mlp.linear_fc1.weight",
              "decoder.layers.mlp.linear_fc2.weight"},
    "qwen3_moe": {"embedding.word_embeddings.weight", "decoder.final_layernorm.weight", "output_layer.weight",
                  "decoder.layers.self_attention.linear_qkv.layer_norm_weight",
                  "decoder.layers.self_attention.linear_qkv.weight",
                  "decoder.layers.self_attention.linear_proj.weight",
                  "decoder.layers.self_attention.q_layernorm.weight",
                  "decoder.layers.self_attention.k_layernorm.weight",
                  "decoder.layers.mlp.linear_fc1.layer_norm_weight", "decoder.layers.mlp.router.weight",
                  "decoder.layers.mlp.experts.experts.linear_fc1.weight",
                  "decoder.layers.mlp.experts.experts.linear_fc2.weight"},
}
ROUND_TRIP_FIELDS = ("rms_norm_eps", "rope_theta", "num_attention_heads", "num_key_value_heads", "vocab_size",
                     "tie_word_embeddings", "head_dim", "intermediate_size", "max_position_embeddings")


def hf_tensors(backend: TorchTrainerBackend) -> dict[str, torch.Tensor]:
    """The backend's weights as an HF checkpoint holds them (a tied model has no lm_head)."""
    weights = backend.state_dict()
    if backend.model.config.tie_word_embeddings:
        weights.pop("lm_head.weight")
    return weights


@pytest.fixture(scope="module", params=["llama", "qwen3_moe"])
def saved_checkpoint(request, hf_dirs, tmp_path_factory):
    """A backend after one update, and the Megatron checkpoint it saved at iteration 3."""
    backend = backend_for(hf_dirs[request.param])
    backend.sft_step(sequences(), lr=3e-3)  # trained weights, not the source's
    root = tmp_path_factory.mktemp(f"megatron_{request.param}")
    path, fmt = backend.save_checkpoint(root, iteration=3, weight_version=1)
    return request.param, backend, root, path, fmt


def test_an_hf_backend_saves_megatrons_torch_dist_layout(saved_checkpoint):
    kind, backend, root, path, fmt = saved_checkpoint
    assert fmt == "megatron_torch_dist" and path == root / "iter_0000003"
    assert (root / "latest_checkpointed_iteration.txt").read_text() == "3"
    assert {p.name for p in path.iterdir()} >= {".metadata", "common.pt", "metadata.json"}
    stored = {info.name: info.shape for info in TorchDistCheckpoint(path).tensors()}
    assert set(stored) == EXPECTED_KEYS[kind]
    layers, hidden = TINY["num_hidden_layers"], TINY["hidden_size"]
    assert stored["embedding.word_embeddings.weight"] == (384, hidden)  # padded to a multiple of 128
    assert stored["decoder.layers.self_attention.linear_qkv.weight"] == (layers, (4 + 2 * 2) * 16, hidden)
    if kind == "qwen3_moe":
        assert stored["decoder.layers.mlp.experts.experts.linear_fc1.weight"] == (layers, EXPERTS, 2 * 32, hidden)
        assert stored["decoder.layers.mlp.experts.experts.linear_fc2.weight"] == (layers, EXPERTS, hidden, 32)
    args = torch.load(path / "common.pt", weights_only=False)["args"]
    assert (args.lr, args.seed, args.padded_vocab_size, args.vocab_size) == (1e-3, 0, 384, 300)


def test_the_megatron_checkpoint_exports_back_to_the_same_tensors_and_config(saved_checkpoint, hf_dirs, tmp_path):
    kind, backend, root, _, _ = saved_checkpoint
    export_to_hf(root, tmp_path / "hf", ExportOptions(workers=1))  # the save root: its latest iteration
    exported, expected = read_hf_checkpoint(tmp_path / "hf"), hf_tensors(backend)
    assert exported.keys() == expected.keys()
    assert all(torch.equal(exported[name], expected[name]) for name in expected)

    source = json.loads((hf_dirs[kind] / "config.json").read_text())
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    for field in ROUND_TRIP_FIELDS:
        if field in source:
            assert written[field] == source[field], field
    # Parsed, every field the engine builds from agrees (transformers 5 saves Qwen3-MoE's
    # expert count as num_local_experts, and the rope base under rope_parameters) but the EOS
    # id, which Megatron's arguments do not carry.
    ours, theirs = read_hf_config(tmp_path / "hf"), read_hf_config(hf_dirs[kind])
    assert ours == msgspec.structs.replace(theirs, eos_token_id=None)
    if kind == "qwen3_moe":
        assert (ours.moe.num_experts, ours.moe.num_experts_per_tok, ours.moe.moe_intermediate_size) == (4, 2, 32)


async def test_the_resharder_converts_the_backends_checkpoint_into_a_model_the_engine_serves(saved_checkpoint,
                                                                                         tmp_path):
    kind, backend, _, path, fmt = saved_checkpoint
    resharder = ResharderLogic(ResharderConfig(max_shard_bytes=1 << 30), export_root=tmp_path / "exports")
    converted = await resharder.handle_checkpoint_saved(
        CheckpointSaved(step=3, weight_version=1, path=str(path), format=fmt))
    exported, expected = read_hf_checkpoint(Path(converted.hf_path)), hf_tensors(backend)
    assert exported.keys() == expected.keys()
    assert all(torch.equal(exported[name], expected[name]) for name in expected)
    served = load_hf_model(converted.hf_path)
    ids = torch.tensor([sequences()[0][0]])
    with torch.no_grad():
        assert torch.equal(served(ids), backend.model(ids))


def test_the_demo_model_saves_a_megatron_checkpoint_that_exports_back_to_its_weights(demo_model_dir, tmp_path):
    # The demo model is a Qwen2 (q/k/v biases, tied embeddings); no torch-format branch is left.
    backend = TorchTrainerBackend(ModelConfig(path=str(demo_model_dir)), TrainerConfig(lr=1e-2, seed=0))
    backend.sft_step(sequences(), lr=1e-2)
    path, fmt = backend.save_checkpoint(tmp_path / "checkpoints", iteration=5, weight_version=2)
    assert (path, fmt) == (tmp_path / "checkpoints" / "iter_0000005", "megatron_torch_dist")
    export_to_hf(path, tmp_path / "hf", ExportOptions(workers=1))
    exported, expected = read_hf_checkpoint(tmp_path / "hf"), hf_tensors(backend)
    assert exported.keys() == expected.keys()
    assert all(torch.equal(exported[name], expected[name]) for name in expected)


@pytest.mark.parametrize(("config", "field"), [
    (dict(LLAMA, model_type="llama", attention_bias=True), "attention_bias"),
    (dict(QWEN3_MOE, model_type="qwen3_moe", mlp_only_layers=[0]), "mlp_only_layers"),
    (dict(QWEN3_MOE, model_type="qwen3_moe", norm_topk_prob=False), "norm_topk_prob"),
])
def test_a_model_no_megatron_checkpoint_reproduces_is_refused_by_field(config, field):
    with pytest.raises(UnmappableModelError) as caught:
        describe_hf_model(config)
    assert caught.value.field == field


@pytest.mark.parametrize("kind", ["qwen2", "mixtral"])
def test_the_other_families_round_trip_through_megatron_too(kind, tmp_path):
    """Qwen2 (QKV biases, tied) and Mixtral (w1/w2/w3 experts under block_sparse_moe)."""
    if kind == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**TINY, tie_word_embeddings=True))
    else:
        model = transformers.MixtralForCausalLM(transformers.MixtralConfig(**TINY, num_local_experts=4,
                                                                           num_experts_per_tok=2))
    model.save_pretrained(tmp_path / "hf")
    ours = load_hf_model(tmp_path / "hf")
    weights = {name: tensor.detach().clone() for name, tensor in ours.state_dict().items()}
    save_megatron_checkpoint(weights, ours.config, tmp_path / "megatron", iteration=1)
    export_to_hf(tmp_path / "megatron", tmp_path / "out", ExportOptions(workers=1))
    exported = read_hf_checkpoint(tmp_path / "out")
    if ours.config.tie_word_embeddings:
        weights.pop("lm_head.weight")
    assert exported.keys() == weights.keys()
    assert all(torch.equal(exported[name], weights[name]) for name in weights)
    assert read_hf_config(tmp_path / "out") == msgspec.structs.replace(read_hf_config(tmp_path / "hf"),
                                                                       eos_token_id=None)
