"""A megatron-core GPTModel (local layer spec) built from a Hugging Face directory of the engine's
families, its tensor- and expert-parallel weights moved to and from HF names, and its MoE
routers driven by megatron-core's routing replay.

Knows megatron-core (model, parallel state, ``RouterReplay``), the checkpoint package's maps
(``arch_maps``: HF <-> canonical Megatron tensors, experts by global id; ``tp_reshard.rank_boxes``:
which box of each global tensor a TP rank holds) and torch.distributed; nothing of losses,
optimizers, Ray or NATS. Runs inside one process per rank, with torch.distributed and
``parallel_state`` (TP x EP) already initialised by the caller.

Families: Llama, Qwen2 (QKV bias), Qwen3-MoE (QK norms, MoE) and Mixtral (MoE), what the maps
express exactly (no o_proj/MLP bias, no sliding window, every layer sparse, top-k renormalised).
MoE: megatron's softmax router takes the top k of the logits, then a softmax over those k: the
engine's ``route_top_k`` (softmax over all, top k, renormalised) up to rounding; no
load-balancing loss (the torch backend has none). Experts are ``SequentialMLP``s behind the
allgather dispatcher; EP rank r holds experts [r*n, (r+1)*n), each split over the expert-TP
group (= TP) as a dense MLP over TP.

Sequence parallel: on for an MoE model at TP > 1, because megatron-core refuses to train an MoE
layer without it. Each TP rank then holds a contiguous 1/TP of the positions (the batch is
padded at its end to a multiple of TP) and its routers route only those; megatron's own CPU
norm refuses sequence parallel, hence ``_RMSNorm``.

Routing replay (``logits(inputs, replay_rows)``): each router's ``RouterReplay`` gets its layer's
expert ids [tokens, k] in megatron's token order (sequence-major: token = t * B + b) and
REPLAY_FORWARD; ``prepare_backward`` switches it to REPLAY_BACKWARD so that a layer recomputed
in the backward replays the same ids. ``RouterReplay`` also lists every instance in a class-level
list, which its static methods act on: the list is cleared when a model is built, and this
class drives its own routers' instances, never the list.

Vocabulary: padded only to a multiple of the TP degree (not to Megatron-LM's 128), and the padded
logits are cut off (``logits``): a padded row's logit (0) would otherwise enter the softmax.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from rollmesh.checkpoint.arch_maps import (
    ArchMap,
    ArchSpec,
    build_arch_map,
    canonical_megatron_name,
    expert_index,
    megatron_shapes,
    per_expert_name,
)
from rollmesh.checkpoint.chunk_geometry import Box
from rollmesh.checkpoint.tp_reshard import rank_boxes
from rollmesh.engine.models import CheckpointKeysError, read_hf_config
from rollmesh.engine.models.hf_config import HFModelConfig
from rollmesh.training.megatron_checkpoint import describe_hf_model
from rollmesh.training.router_replay import replay_tensor


class UnsupportedMegatronModelError(ValueError):
    """An HF model this backend does not build: ``field`` is the HF config field in the way."""

    def __init__(self, reason: str, *, field: str, path: str) -> None:
        super().__init__(f"{path}: {field}: {reason}")
        self.field = field
        self.path = path


def megatron_spec(config: HFModelConfig, *, tp: int, ep: int = 1, path: str = "") -> ArchSpec:
    """The ``ArchSpec`` of ``config`` with the vocabulary padded to a multiple of ``tp`` only."""
    moe = config.moe
    refusals = (
        ("attention_bias", config.o_proj_bias or (config.qkv_bias and config.model_type != "qwen2"),
         "only Qwen2's QKV bias has a Megatron tensor"),
        ("mlp_bias", config.mlp_bias, "MLP biases have no Megatron tensor"),
        ("sliding_window", config.sliding_window is not None, "sliding-window attention is not built"),
        ("mlp_only_layers", moe is not None and moe.sparse_layers != tuple(range(config.num_hidden_layers)),
         "every layer must be sparse"),
        ("norm_topk_prob", moe is not None and not moe.norm_topk_prob,
         "megatron's router renormalises the top-k probabilities"),
        ("num_experts", moe is None and ep > 1, f"expert parallel {ep} needs an MoE model"),
        ("num_experts", moe is not None and moe.num_experts % ep, f"the experts do not split over {ep} EP ranks"),
        ("moe_intermediate_size", moe is not None and moe.moe_intermediate_size % tp,
         f"the experts' hidden size does not split over {tp} TP ranks"),
        ("num_key_value_heads", config.num_key_value_heads % tp,
         f"{config.num_key_value_heads} query groups do not split over {tp} TP ranks"),
    )
    for field, bad, reason in refusals:
        if bad:
            raise UnsupportedMegatronModelError(reason, field=field, path=path)
    spec = describe_hf_model(config, path=path).spec
    return dataclasses.replace(spec, padded_vocab_size=-(-spec.vocab_size // tp) * tp)


class _RMSNorm(torch.nn.RMSNorm):
    """torch's RMSNorm built from megatron's norm arguments (the same module megatron's CPU
    fallback ``WrappedTorchNorm`` returns, which refuses sequence parallel). It marks its weight
    as megatron's fused norms do: under sequence parallel a rank's gradient covers only its
    positions and is summed over TP after the backward (a QK norm's is summed whatever the
    mode: each TP rank holds only its heads)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_megatron_only) -> None:
        super().__init__(hidden_size, eps=eps)
        self.weight.sequence_parallel = config.sequence_parallel


def build_gpt_model(config: HFModelConfig, spec: ArchSpec, *, tp: int, ep: int = 1, recompute: bool = False):
    """A float32, CPU-initialised local-spec GPTModel shaped like ``config`` (random weights).
    ``recompute``: full activation recompute, one layer per checkpoint."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.moe.router_replay import RouterReplay
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
    from megatron.core.transformer.transformer_config import TransformerConfig

    moe = config.moe
    moe_fields = {} if moe is None else dict(
        num_moe_experts=moe.num_experts, moe_router_topk=moe.num_experts_per_tok,
        moe_ffn_hidden_size=moe.moe_intermediate_size, moe_router_pre_softmax=False,
        moe_router_score_function="softmax", moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
        moe_token_dispatcher_type="allgather", moe_grouped_gemm=False, moe_enable_routing_replay=True,
        expert_model_parallel_size=ep)
    recompute_fields = dict(recompute_granularity="full", recompute_method="uniform",
                            recompute_num_layers=1) if recompute else {}
    transformer = TransformerConfig(
        num_layers=spec.num_layers, hidden_size=spec.hidden_size, num_attention_heads=spec.num_heads,
        num_query_groups=spec.num_query_groups, kv_channels=spec.head_dim, ffn_hidden_size=spec.ffn_hidden_size,
        normalization="RMSNorm", layernorm_epsilon=config.rms_norm_eps, gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, add_bias_linear=False, add_qkv_bias=config.qkv_bias,
        qk_layernorm=config.qk_norm, sequence_parallel=moe is not None and tp > 1,
        # megatron's defaults are 0.1: HF models train without dropout, and CPU runs have no
        # model-parallel RNG to draw it from (megatron_cpu_shims).
        hidden_dropout=0.0, attention_dropout=0.0,
        params_dtype=torch.float32, use_cpu_initialization=True, tensor_model_parallel_size=tp,
        **moe_fields, **recompute_fields)
    # The local spec's rotary embedding is non-interleaved (rotate_half), as HF's is.
    layer = get_gpt_layer_local_spec(num_experts=moe.num_experts if moe else None, moe_grouped_gemm=False,
                                     qk_layernorm=config.qk_norm, normalization="RMSNorm")
    layer.submodules.input_layernorm = layer.submodules.pre_mlp_layernorm = _RMSNorm
    if config.qk_norm:
        layer.submodules.self_attention.submodules.q_layernorm = _RMSNorm
        layer.submodules.self_attention.submodules.k_layernorm = _RMSNorm
    block = TransformerBlockSubmodules(layer_specs=[layer] * get_num_layers_to_build(transformer),
                                       layer_norm=_RMSNorm)
    # RouterReplay keeps every router it ever made in a class-level list: drop the routers of
    # models built before, which would otherwise live as long as the process.
    RouterReplay.clear_global_router_replay_instances()
    return GPTModel(config=transformer, transformer_layer_spec=block,
                    vocab_size=spec.padded_vocab_size, max_sequence_length=config.max_position_embeddings,
                    position_embedding_type="rope", rotary_base=config.rope_theta,
                    share_embeddings_and_output_weights=spec.tie_embeddings)


def _region(tensor: torch.Tensor, box: Box) -> torch.Tensor:
    return tensor[tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes, strict=True))]


class MegatronLlama:
    """One rank's GPTModel of an HF directory, with HF-named weights in and out."""

    def __init__(self, hf_path: str | Path, *, recompute: bool = False) -> None:
        from megatron.core import parallel_state as ps

        self.hf_path = str(hf_path)
        self.hf_config = read_hf_config(hf_path)
        self.tp, self.rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
        self.group = ps.get_tensor_model_parallel_group()
        self.ep, self.ep_rank = ps.get_expert_model_parallel_world_size(), ps.get_expert_model_parallel_rank()
        self.ep_group = ps.get_expert_model_parallel_group()
        self.etp, self.etp_rank = ps.get_expert_tensor_parallel_world_size(), ps.get_expert_tensor_parallel_rank()
        self.etp_group = ps.get_expert_tensor_parallel_group()
        self.recompute = recompute
        self.spec = megatron_spec(self.hf_config, tp=self.tp, ep=self.ep, path=self.hf_path)
        self.arch_map: ArchMap = build_arch_map(self.spec)
        self.shapes = megatron_shapes(self.spec)
        self.model = build_gpt_model(self.hf_config, self.spec, tp=self.tp, ep=self.ep, recompute=recompute)
        self.sequence_parallel = self.model.config.sequence_parallel
        self.local_experts = self.spec.num_experts // self.ep
        self.params = {self._global_name(name): p for name, p in self.model.named_parameters()}
        held = {name for name in self.shapes if self._holds(name)}
        if self.params.keys() != held:
            raise UnsupportedMegatronModelError(
                f"megatron-core built {sorted(self.params.keys() ^ held)} unlike the map", field="$", path=self.hf_path)
        moe = self.hf_config.moe
        # (sparse layers, top k) of a replayed row; None for a dense model.
        self.routing_shape = None if moe is None else (len(moe.sparse_layers), moe.num_experts_per_tok)
        # This model's routers' replay handles with each one's global layer (megatron numbers from 1).
        self._replays = [(block.layer_number - 1, block.mlp.router.router_replay)
                         for block in self.model.decoder.layers if moe is not None]

    def is_expert(self, name: str) -> bool:
        """Whether a (canonical) parameter name is an expert's: held by one EP rank only."""
        return expert_index(name) is not None

    def _global_name(self, name: str) -> str:
        """A megatron parameter name with its local expert index made global."""
        name = canonical_megatron_name(name)
        found = expert_index(name)
        if found is None:
            return name
        return per_expert_name(found[0], self.ep_rank * self.local_experts + found[1])

    def _holds(self, name: str) -> bool:
        found = expert_index(name)
        return found is None or found[1] // self.local_experts == self.ep_rank

    def _boxes(self, name: str, whole: Box, rank: int) -> list[Box]:
        found = expert_index(name)
        if found is None:
            return rank_boxes(name, whole, rank, self.tp)
        # An expert splits over expert-TP as a dense MLP over TP; rank_boxes knows the dense names.
        return rank_boxes("mlp." + found[0].rpartition(".experts.experts.")[2], whole, rank, self.etp)

    def logits(self, inputs: torch.Tensor, replay_rows: Sequence[np.ndarray] | None = None) -> torch.Tensor:
        """[B, T, vocab] full-vocabulary logits (gathered over TP; differentiable: the backward
        keeps each rank's vocabulary slice), causal attention, padded vocabulary rows cut off.
        ``replay_rows``: per sample, the experts to route each position to (``router_replay``
        rows [positions, sparse layers, top_k]; None: the routers' own top k)."""
        from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

        length = inputs.shape[1]
        # Sequence parallel splits the positions evenly over TP: pad at the end, where a causal
        # model's real positions never look (any valid id does).
        padded = -(-length // self.tp) * self.tp if self.sequence_parallel else length
        inputs = F.pad(inputs, (0, padded - length))
        self._route(replay_rows, padded)
        positions = torch.arange(padded)[None].expand_as(inputs)
        # True = masked. Passed explicitly: megatron's default causal mask is built on "cuda".
        causal = torch.triu(torch.ones(1, 1, padded, padded, dtype=torch.bool), diagonal=1)
        sharded = self.model(inputs, positions, causal)
        return gather_from_tensor_model_parallel_region(sharded)[:, :length, : self.spec.vocab_size]

    def _route(self, replay_rows: Sequence[np.ndarray] | None, padded: int) -> None:
        """Set every router to replay ``replay_rows`` in the next forward, or to route itself."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        if replay_rows is not None and not self._replays:
            raise ValueError("routes to replay given to a dense model")
        for _, replay in self._replays:
            replay.clear_indices()  # also what a no-grad forward left for a backward that never came
            replay.clear_router_replay_action()
        if replay_rows is None:
            return
        # Every rank routes the whole batch (EP ranks see the same samples: no data parallel
        # here), so each builds the rows of every sample, but only of its own positions: with
        # sequence parallel its 1/TP of them, without it all of them.
        per_rank = padded // self.tp
        window = slice(self.rank * per_rank, (self.rank + 1) * per_rank) if self.sequence_parallel else None
        routes = replay_tensor(replay_rows, padded, positions=window)  # [B, T, layers, k]
        # megatron's routers see tokens in [sequence, batch] order: token = t * B + b.
        tokens = routes.transpose(0, 1).reshape(-1, *routes.shape[2:])
        for layer, replay in self._replays:
            replay.set_target_indices(tokens[:, layer].contiguous())
            replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)

    def prepare_backward(self) -> None:
        """Call before ``backward()``: the layers recomputed in it then replay the experts their
        forward replayed (megatron's REPLAY_BACKWARD), not a top k of their own."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        for _, replay in self._replays:
            if self.recompute and replay.router_replay_action == RouterReplayAction.REPLAY_FORWARD:
                replay.set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)

    def load_hf_state_dict(self, weights: dict[str, torch.Tensor]) -> None:
        """Copy HF-named whole tensors into this rank's parameters, in place (the optimizer holds
        them). A tied model's ``lm_head.weight`` is ignored, as the engine's loader does. Names
        or (Megatron-side) shapes unlike the model's: ``CheckpointKeysError``."""
        tied_head = "lm_head.weight" if self.spec.tie_embeddings else None
        weights = {name: t for name, t in weights.items() if name != tied_head}
        expected = set(self.arch_map.hf_names())
        if weights.keys() != expected:
            raise CheckpointKeysError(path=self.hf_path, missing=sorted(expected - weights.keys()),
                                      unexpected=sorted(weights.keys() - expected))
        canonical = self.arch_map.to_megatron({name: t.detach().float() for name, t in weights.items()})
        mismatched = sorted(f"{name} {tuple(canonical[name].shape)} != {shape}"
                            for name, shape in self.shapes.items() if tuple(canonical[name].shape) != shape)
        if mismatched:
            raise CheckpointKeysError(path=self.hf_path, missing=[], unexpected=[], mismatched=mismatched)
        with torch.no_grad():
            for name, param in self.params.items():
                whole = canonical[name]
                rank = self.etp_rank if self.is_expert(name) else self.rank
                boxes = self._boxes(name, Box((0,) * whole.dim(), tuple(whole.shape)), rank)
                # Several boxes (SwiGLU fc1: rank r's gate rows, then its up rows) stack on dim 0.
                param.copy_(torch.cat([_region(whole, box) for box in boxes]).reshape(param.shape))

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """Every rank's shards gathered into whole HF-named tensors (every rank gets them all; a
        collective: every rank must call it). A tied model also lists ``lm_head.weight`` (the
        embedding), as the torch backend's state dict does."""
        out: dict[str, torch.Tensor] = {}
        # Every rank walks its parameters in the same order (experts by local index), so the
        # collectives pair up across ranks.
        for name, param in self.params.items():
            if not self.is_expert(name):
                out.update(self.arch_map.to_hf(name, self._gather(name, param.detach(), self.tp, self.group)))
                continue
            whole = self._gather(name, param.detach(), self.etp, self.etp_group)
            grouped, expert = expert_index(name)
            pieces = [torch.empty_like(whole) for _ in range(self.ep)]
            dist.all_gather(pieces, whole, group=self.ep_group)
            for ep_rank, piece in enumerate(pieces):
                held = ep_rank * self.local_experts + expert % self.local_experts
                out.update(self.arch_map.to_hf(per_expert_name(grouped, held), piece))
        if self.spec.tie_embeddings:
            out["lm_head.weight"] = out["model.embed_tokens.weight"]
        return out

    def _gather(self, name: str, shard: torch.Tensor, size: int, group) -> torch.Tensor:
        """The whole tensor of ``name`` from its shards over ``group`` (TP, or expert TP)."""
        shape = self.shapes[name]
        whole_box = Box((0,) * len(shape), shape)
        if self._boxes(name, whole_box, 0) == [whole_box]:
            return shard.clone()  # replicated: every rank holds it whole
        shards = [torch.empty_like(shard) for _ in range(size)]
        dist.all_gather(shards, shard.contiguous(), group=group)
        whole = torch.empty(shape, dtype=shard.dtype)
        for rank, piece in enumerate(shards):
            offset = 0
            for box in self._boxes(name, whole_box, rank):
                # Several boxes (SwiGLU fc1: gate rows, then up rows) sit one after another on dim 0.
                _region(whole, box).copy_(piece.narrow(0, offset, box.sizes[0]))
                offset += box.sizes[0]
        return whole
