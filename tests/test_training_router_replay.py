"""Rollout routing replay (R3): the training forward routes to the experts the inference engine
recorded, with the trainer's own gate weights; storage, per-rank slicing, alignment, recompute.

Tiny random Qwen3-MoE and Mixtral models are built from an HF-style config dict by our own
builder (``test_engine_hf_models`` holds these families equal to transformers), with weights
rounded to bf16 so the bf16 "inference engine" copy and the fp32 "trainer" hold the same values.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from support.moe_models import init_unit_router_weights
from rollmesh.engine.decode import DecodeEngine
from rollmesh.engine.models import CausalLM, build_causal_lm, parse_hf_config, route_top_k
from rollmesh.engine.protocols import GenerateOptions
from rollmesh.messages.base import SamplingParams
from rollmesh.training.losses import token_logprobs
from rollmesh.training.router_replay import (
    ExpertIdError,
    RoutedRowsShapeError,
    RowsAlignmentError,
    compact_rows,
    context_shard,
    expert_id_dtype,
    forward_with_replay,
    rank_sample_indices,
    rank_share,
    replay_tensor,
    rows_for_inputs,
)

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

VOCAB = 256
FAMILIES = {
    "qwen3_moe-norm-topk": dict(model_type="qwen3_moe", num_experts=8, norm_topk_prob=True),
    "qwen3_moe-raw-topk-mixed-layers": dict(model_type="qwen3_moe", num_experts=8, norm_topk_prob=False,
                                            mlp_only_layers=[0]),
    "mixtral": dict(model_type="mixtral", num_local_experts=8),
}


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def tiny_moe(case: str = "qwen3_moe-norm-topk", *, layers: int = 3, seed: int = 0) -> CausalLM:
    config = parse_hf_config(dict(
        hidden_size=64, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=VOCAB, intermediate_size=96, moe_intermediate_size=48, num_experts_per_tok=2,
        **FAMILIES[case]))
    torch.manual_seed(seed)
    return init_unit_router_weights(build_causal_lm(config), config.hidden_size)


def tokens(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def routes_of(model: CausalLM, ids: torch.Tensor, replay: torch.Tensor | None = None):
    with torch.no_grad():
        return model.forward_with_routes(ids, replay)


def sorted_ids(routes: torch.Tensor) -> torch.Tensor:
    return routes.long().sort(-1).values


def count_expert_tokens(model: CausalLM) -> dict[tuple[int, int], int]:
    """Hooks every expert; the dict fills with (layer, expert) -> tokens it ran on."""
    counts: dict[tuple[int, int], int] = {}
    for index, layer in enumerate(model.model.layers):
        block = getattr(layer, layer.feed_forward_name)
        for expert_id, expert in enumerate(getattr(block, "experts", [])):
            def hook(_m, inputs, _out, key=(index, expert_id)):
                counts[key] = counts.get(key, 0) + inputs[0].shape[0]
            expert.register_forward_hook(hook)
    return counts


# -- replay in the model --------------------------------------------------------------------


@pytest.mark.parametrize("case", list(FAMILIES))
def test_replaying_a_models_own_choices_changes_nothing(case: str) -> None:
    # Same ids, same weights: each family's normalisation is kept exactly under replay.
    model = tiny_moe(case)
    ids = tokens(2, 24)
    logits, routes = routes_of(model, ids)
    replayed, replayed_routes = routes_of(model, ids, routes)
    assert torch.equal(replayed, logits)
    assert torch.equal(replayed_routes, routes)


@pytest.mark.parametrize("normalize", [True, False])
def test_replayed_gate_weights_are_the_routers_probabilities_at_the_replayed_ids(normalize: bool) -> None:
    logits = torch.randn(5, 6)
    replay = torch.tensor([[0, 1], [5, 2], [3, 4], [1, 0], [2, 5]], dtype=torch.uint8)
    weights, ids = route_top_k(logits, 2, normalize=normalize, replay=replay)
    assert torch.equal(ids, replay.long())
    picked = torch.softmax(logits, -1).gather(-1, replay.long())
    if normalize:
        # Qwen3-MoE's norm_topk_prob, and Mixtral: the softmax over the selected logits.
        torch.testing.assert_close(weights, torch.softmax(logits.gather(-1, replay.long()), -1))
    else:
        torch.testing.assert_close(weights, picked)
    with pytest.raises(ValueError):
        route_top_k(logits, 2, normalize=normalize, replay=replay[:, :1])


@pytest.mark.parametrize("case", ["qwen3_moe-norm-topk", "mixtral"])
def test_training_forward_uses_the_recorded_experts_even_when_the_router_moved(case: str) -> None:
    engine_model = tiny_moe(case).to(torch.bfloat16)
    ids = tokens(2, 32)
    _, recorded = routes_of(engine_model, ids)
    trainer = tiny_moe(case)
    with torch.no_grad():  # a trainer a little ahead of the engine: its routers moved
        for layer in trainer.model.layers:
            gate = getattr(layer, layer.feed_forward_name).gate.weight
            gate.add_(0.05 * gate.std() * torch.randn_like(gate))
    _, own = routes_of(trainer, ids)
    moved = (sorted_ids(own) != sorted_ids(recorded)).any(-1)
    assert moved.sum() > 0, "the perturbation should change top-k somewhere"

    counts = count_expert_tokens(trainer)
    _, replayed = forward_with_replay(trainer, ids, recorded.long())
    assert torch.equal(replayed, recorded.long())  # at the moved positions too
    # The experts actually run: each got exactly the tokens the recorded rows send it.
    sparse = trainer.config.moe.sparse_layers
    expected = {(layer, e): int((recorded[:, :, slot] == e).sum())
                for slot, layer in enumerate(sparse) for e in range(8)}
    assert {k: v for k, v in counts.items() if v} == {k: v for k, v in expected.items() if v}


def test_replay_lowers_the_bf16_inference_vs_fp32_training_logprob_mismatch() -> None:
    trainer = tiny_moe("qwen3_moe-norm-topk", layers=4)
    engine_model = copy.deepcopy(trainer).to(torch.bfloat16)  # same weights, bf16 as engines run
    ids = tokens(4, 96)
    inputs, targets = ids[:, :-1], ids[:, 1:]
    inference_logits, recorded = routes_of(engine_model, inputs)
    inference = token_logprobs(inference_logits, targets)
    with torch.no_grad():
        free_logits, own = forward_with_replay(trainer, inputs, None)
        replay_logits, _ = forward_with_replay(trainer, inputs, recorded.long())
    without = (token_logprobs(free_logits, targets) - inference).abs().mean().item()
    with_replay = (token_logprobs(replay_logits, targets) - inference).abs().mean().item()
    flipped = (sorted_ids(own) != sorted_ids(recorded)).any(-1).float().mean().item()
    # torch 2.13 CPU, 4 x 95 = 380 tokens, 4 sparse layers x 8 experts, top-2: 4.6% of
    # (token, layer) routes flip between bf16 and fp32; mismatch without replay 0.0295, with
    # 0.0064 (4.6x). What is left with replay is bf16 rounding, routing no longer adds to it.
    print(f"routes flipped {flipped:.4f}; mismatch without {without:.4f}, with {with_replay:.4f}")
    assert flipped > 0
    assert with_replay < without / 2


@pytest.mark.parametrize("case", ["qwen3_moe-raw-topk-mixed-layers", "mixtral"])
def test_gradients_reach_the_router_under_replay(case: str) -> None:
    model = tiny_moe(case).train()
    ids = tokens(2, 16)
    _, recorded = routes_of(model, ids[:, :-1])
    logits, _ = forward_with_replay(model, ids[:, :-1], recorded.long())
    token_logprobs(logits, ids[:, 1:]).mean().backward()
    for layer in model.config.moe.sparse_layers:
        block = getattr(model.model.layers[layer], model.config.feed_forward_name)
        assert block.gate.weight.grad is not None and block.gate.weight.grad.abs().sum() > 0


# -- recompute --------------------------------------------------------------------------------


def test_recompute_replays_the_recorded_experts_and_gives_the_same_gradients() -> None:
    model = tiny_moe(layers=2).train()
    ids = tokens(2, 20)
    _, recorded = routes_of(copy.deepcopy(model).to(torch.bfloat16), ids[:, :-1])
    used: list[tuple[int, torch.Tensor]] = []  # (sparse layer, ids) per call of a block
    for index, layer in enumerate(model.model.layers):
        layer.mlp.register_forward_hook(lambda _m, _i, out, index=index: used.append((index, out[1])))

    def gradients(recompute: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        # Early stop ends a recompute once it has the tensors backward needs, which can be
        # before the block returns and its hook fires; without it the hooks see every call.
        with torch.utils.checkpoint.set_checkpoint_early_stop(False):
            logits, _ = forward_with_replay(model, ids[:, :-1], recorded.long(), recompute=recompute)
            token_logprobs(logits, ids[:, 1:]).mean().backward()
        return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    plain_logits, plain = gradients(recompute=False)
    assert len(used) == 2
    used.clear()
    checkpointed_logits, checkpointed = gradients(recompute=True)
    # Each sparse layer runs twice: in the forward, then (last layer first) in the recompute.
    assert [index for index, _ in used] == [0, 1, 1, 0]
    for index, ids_used in used:
        assert torch.equal(ids_used.view(2, 19, 2), recorded[:, :, index].long())
    assert torch.equal(checkpointed_logits, plain_logits)
    for name, grad in plain.items():
        torch.testing.assert_close(checkpointed[name], grad, rtol=0, atol=0, msg=name)


def test_training_forward_without_recompute_is_the_models_own_forward() -> None:
    model = tiny_moe()
    ids = tokens(2, 24)
    logits, routes = routes_of(model, ids)
    with torch.no_grad():
        ours, ours_routes = forward_with_replay(model, ids, routes.long())
    assert torch.equal(ours, logits) and torch.equal(ours_routes, routes.long())


# -- storage, slicing, alignment ------------------------------------------------------------


def test_rows_are_kept_in_the_smallest_id_dtype_and_validated() -> None:
    assert expert_id_dtype(256) == np.uint8 and expert_id_dtype(257) == np.uint16
    rows = np.array([[[0, 7], [3, 1]], [[6, 2], [5, 4]]], dtype=np.int32)  # SGLang's int32
    kept = compact_rows(rows, num_experts=8, routing_shape=(2, 2))
    assert kept.dtype == np.uint8 and np.array_equal(kept, rows)
    assert compact_rows(rows, num_experts=300, routing_shape=(2, 2)).dtype == np.uint16
    with pytest.raises(RoutedRowsShapeError) as shape:
        compact_rows(rows, num_experts=8, routing_shape=(3, 2), sample=4)
    assert shape.value.shape == (2, 2, 2) and shape.value.expected == (3, 2) and shape.value.sample == 4
    with pytest.raises(RoutedRowsShapeError):
        compact_rows(rows.astype(np.float32), num_experts=8, routing_shape=(2, 2))
    with pytest.raises(ExpertIdError) as out_of_range:
        compact_rows(rows, num_experts=7, routing_shape=(2, 2))
    assert out_of_range.value.expert_id == 7 and out_of_range.value.num_experts == 7
    repeated = rows.copy()
    repeated[1, 0] = [2, 2]
    with pytest.raises(ExpertIdError, match="repeated") as twice:
        compact_rows(repeated, num_experts=8, routing_shape=(2, 2))
    assert twice.value.expert_id == 2


class Poisoned:
    """Another rank's rows: any use of them fails the test."""

    def __getattr__(self, name):
        raise AssertionError(f"another rank's rows were touched ({name})")

    def __array__(self, *args, **kwargs):
        raise AssertionError("another rank's rows were copied")


class ReadLog(list):
    """A batch of rows that records which samples were read."""

    def __init__(self, items) -> None:
        super().__init__(items)
        self.read: list[int] = []

    def __getitem__(self, index):
        self.read.append(index)
        return super().__getitem__(index)


def test_a_rank_reads_and_widens_only_its_own_samples_rows() -> None:
    assert [list(rank_sample_indices(5, rank=r, world_size=2)) for r in range(2)] == [[0, 1, 2], [3, 4]]
    mine = [np.full((n, 2, 2), n, dtype=np.uint8) for n in (6, 9)]
    batch = ReadLog([Poisoned(), Poisoned(), Poisoned(), *mine])
    share = rank_share(batch, rank=1, world_size=2)
    assert batch.read == [3, 4] and share[0] is mine[0] and share[1] is mine[1]  # no copies
    replay = replay_tensor(share, 10)
    assert replay.shape == (2, 10, 2, 2) and replay.dtype == torch.long
    assert (replay[0, :6] == 6).all() and (replay[1, :9] == 9).all()
    # Right padding gets a fixed, valid, repeat-free choice: experts 0..k-1.
    assert replay[0, 6:].tolist() == [[[0, 1], [0, 1]]] * 4


def test_context_parallel_shard_widens_only_its_positions() -> None:
    rows = [np.arange(40, dtype=np.uint8).reshape(10, 2, 2) % 8, np.zeros((7, 2, 2), np.uint8)]
    full = replay_tensor(rows, 11)
    shards = [context_shard(11, cp_rank=r, cp_size=3) for r in range(3)]
    assert [(s.start, s.stop) for s in shards] == [(0, 4), (4, 8), (8, 11)]
    assert torch.equal(torch.cat([replay_tensor(rows, 11, positions=s) for s in shards], dim=1), full)
    with pytest.raises(RowsAlignmentError):
        replay_tensor(rows, 9)


def test_engine_rows_align_with_the_training_inputs_and_padding_changes_no_real_position() -> None:
    engine_model = tiny_moe().to(torch.bfloat16)
    engine = DecodeEngine(engine_model, max_batch=2, block_size=8)
    prompts = {"a": tokens(1, 12, seed=3)[0].tolist(), "b": tokens(1, 5, seed=4)[0].tolist()}
    options = GenerateOptions(return_routed_experts=True)
    for request_id, prompt in prompts.items():
        engine.add_prompt(request_id, prompt, SamplingParams(temperature=1.0, max_new_tokens=6), options)
    done: dict = {}
    while engine.has_work():
        done.update((s.request_id, s) for s in engine.step())
    trajectories = [prompts[r] + done[r].token_ids for r in ("a", "b")]
    rows = [rows_for_inputs(compact_rows(done[r].routed_experts, num_experts=8, routing_shape=(3, 2),
                                         sample=i), len(t), sample=i)
            for i, (r, t) in enumerate(zip(("a", "b"), trajectories))]
    with pytest.raises(RowsAlignmentError) as misaligned:
        rows_for_inputs(rows[0], len(trajectories[0]) + 1, sample=0)
    assert misaligned.value.rows == len(trajectories[0]) - 1

    trainer = tiny_moe()
    length = max(map(len, trajectories))
    batch = torch.tensor([t + [0] * (length - len(t)) for t in trajectories])
    with torch.no_grad():
        logits, used = forward_with_replay(trainer, batch[:, :-1], replay_tensor(rows, length - 1))
        for i, t in enumerate(trajectories):
            # Row t is the choice made when the engine ran token t (prefill, then decode).
            assert torch.equal(used[i, : len(t) - 1], torch.from_numpy(rows[i]).long())
            alone, _ = forward_with_replay(trainer, torch.tensor([t[:-1]]),
                                           torch.from_numpy(rows[i]).long()[None])
            torch.testing.assert_close(logits[i, : len(t) - 1], alone[0], rtol=0, atol=1e-5)
