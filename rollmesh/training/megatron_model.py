"""One rank's pipeline stage of a megatron-core GPTModel (``megatron_attention``'s layer spec:
Transformer Engine's where it imports, else the local one; attention on torch sdpa), in float32 or
bf16, on the rank's device, built from a Hugging Face directory of the engine's families, its
tensor-, pipeline- and expert-parallel weights moved to and from HF names, and its MoE routers
driven by megatron-core's routing replay.

Knows megatron-core (model, parallel state, ``RouterReplay``), the checkpoint package's maps
(``arch_maps``: HF <-> canonical Megatron tensors, experts by global id; ``tp_reshard.rank_boxes``:
which box of each global tensor a TP rank holds), ``megatron_pipeline.Microbatch`` and
torch.distributed; nothing of losses, optimizers, Ray or NATS. Runs inside one process per rank,
with torch.distributed and ``parallel_state`` (TP x PP x DP, EP out of DP) already initialised by
the caller. Verified on CPU under gloo (the megatron backend's tests): TP, PP (tied and untied),
DP, TP x PP, PP x DP; MoE at DP x EP, TP with sequence parallel, TP x DP x EP and PP (routing
replay under 1F1B, with and without recompute). Not run yet: MoE at PP x TP (sequence parallel
between stages) or PP x EP.

Stages: layers split evenly over PP; parameters are named by their whole-model canonical names
(global layer, global expert id); a tied model's last stage (PP > 1) holds a copy of the
embedding as its output layer, loaded alike and kept equal by megatron's gradient reduction.

Families: Llama, Qwen2 (QKV bias), Qwen3-MoE (QK norms, MoE) and Mixtral (MoE), what the maps
express exactly (no o_proj/MLP bias, no sliding window, every layer sparse, top-k renormalised).
MoE: megatron's softmax router takes the top k of the logits, then a softmax over those k: the
engine's ``route_top_k`` (softmax over all, top k, renormalised) up to rounding; no
load-balancing loss (the torch backend has none). Experts are ``SequentialMLP``s behind the
allgather dispatcher; EP rank r holds experts [r*n, (r+1)*n), each split over the expert-TP
group (= TP) as a dense MLP over TP.

Sequence parallel: on for an MoE model at TP > 1, because megatron-core refuses to train an MoE
layer without it. Each TP rank then holds a contiguous 1/TP of the positions (the batch is
padded at its end to a multiple of TP: ``padded_length``) and its routers route only those;
megatron's own CPU norm refuses sequence parallel, hence ``_RMSNorm``.

Routing replay (``run_stage``, per microbatch): each of this stage's routers' ``RouterReplay``
gets its global layer's expert ids [tokens, k] in megatron's token order (sequence-major: token
= t * B + b) and REPLAY_FORWARD; when the stage's backward of that microbatch starts
(``_ReplayInBackward``) it switches to REPLAY_BACKWARD, so a layer recomputed there replays the
same ids. ``RouterReplay`` also lists every instance in a class-level list, which its static
methods act on: the list is cleared when a model is built, and this class drives its own
routers' instances, never the list.

Packed rows (supervised steps, ``packing``): megatron's packed (THD) format needs Transformer
Engine, which the CPU path lacks, so a packed microbatch runs as any other with a block-diagonal
causal mask (the caller's) and positions reset per example. megatron-core's RoPE ignores
``position_ids`` (it rotates by 0..T-1), so ``run_stage`` makes this stage's rotary embedding
answer each token's own position for that forward (``_rope_at``).

Vocabulary: padded only to a multiple of the TP degree (not to Megatron-LM's 128); the padded
logits are cut off by ``megatron_pipeline``: a padded row's logit (0) would otherwise enter the
softmax.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

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
from rollmesh.training.errors import UnsupportedMegatronModelError
from rollmesh.training.megatron_checkpoint import describe_hf_model
from rollmesh.training.megatron_cpu_shims import megatron_cuda_on_cpu
from rollmesh.training.megatron_pipeline import Microbatch
from rollmesh.training.router_replay import replay_tensor


def megatron_spec(config: HFModelConfig, *, tp: int, ep: int = 1, pp: int = 1, path: str = "") -> ArchSpec:
    """The ``ArchSpec`` of ``config`` with the vocabulary padded to a multiple of ``tp`` only;
    ``UnsupportedMegatronModelError`` for a model this backend cannot build at TP x EP x PP."""
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
        ("num_hidden_layers", config.num_hidden_layers % pp,
         f"{config.num_hidden_layers} layers do not split evenly over {pp} pipeline stages"),
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
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype)  # bf16 with a bf16 model
        self.weight.sequence_parallel = config.sequence_parallel


def build_gpt_model(config: HFModelConfig, spec: ArchSpec, *, recompute: bool = False,
                    dtype: torch.dtype = torch.float32):
    """This rank's pipeline stage of a CPU-initialised GPTModel of ``dtype`` (float32, or bf16:
    then megatron's bf16 mode, activations between stages in bf16) shaped like ``config``
    (random weights; layer spec and core attention: ``megatron_attention.gpt_layer_spec``), its
    TP, PP and EP sizes from ``parallel_state``: layers split
    evenly over the stages, embeddings on the first, final norm and output layer on the last
    (a tied model's last stage holds a copy of the embedding as its output layer). Configured
    for ``megatron_pipeline.forward_backward``: per-token loss normalisation, float32
    activations between stages. ``recompute``: full activation recompute, one layer per
    checkpoint."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.moe.router_replay import RouterReplay
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
    from megatron.core.transformer.transformer_config import TransformerConfig

    from rollmesh.training.megatron_attention import gpt_layer_spec

    tp, pp = ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()
    moe = config.moe
    moe_fields = {} if moe is None else dict(
        num_moe_experts=moe.num_experts, moe_router_topk=moe.num_experts_per_tok,
        moe_ffn_hidden_size=moe.moe_intermediate_size, moe_router_pre_softmax=False,
        moe_router_score_function="softmax", moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
        moe_token_dispatcher_type="allgather", moe_grouped_gemm=False, moe_enable_routing_replay=True,
        expert_model_parallel_size=ps.get_expert_model_parallel_world_size())
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
        params_dtype=dtype, bf16=dtype == torch.bfloat16, use_cpu_initialization=True,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, pipeline_dtype=dtype,
        # megatron_pipeline: each microbatch's loss is a sum, the normaliser summed over all.
        calculate_per_token_loss=True, **moe_fields, **recompute_fields)
    layer, final_norm, _ = gpt_layer_spec(num_experts=moe.num_experts if moe else None,
                                          qk_layernorm=config.qk_norm, norm=_RMSNorm)
    block = TransformerBlockSubmodules(layer_specs=[layer] * get_num_layers_to_build(transformer),
                                       layer_norm=final_norm)
    # RouterReplay keeps every router it ever made in a class-level list: drop the routers of
    # models built before, which would otherwise live as long as the process.
    RouterReplay.clear_global_router_replay_instances()
    # A tied model's last stage copies the first stage's embedding over the embedding group at
    # construction, moving it with .cuda() first (megatron_cuda_on_cpu).
    with megatron_cuda_on_cpu():
        return GPTModel(config=transformer, transformer_layer_spec=block,
                        vocab_size=spec.padded_vocab_size, max_sequence_length=config.max_position_embeddings,
                        position_embedding_type="rope", rotary_base=config.rope_theta,
                        share_embeddings_and_output_weights=spec.tie_embeddings,
                        pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage())


def _region(tensor: torch.Tensor, box: Box) -> torch.Tensor:
    return tensor[tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes, strict=True))]


class _ReplayInBackward(torch.autograd.Function):
    """The identity on a stage's output, whose backward (the stage's first step back for that
    microbatch) sets the routers to REPLAY_BACKWARD: the layers recomputed in it then take the
    experts their forward replayed (``RouterReplay`` hands them out in forward order, which is
    the 1F1B backward order), though other microbatches' forwards ran in between."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, replays: list) -> torch.Tensor:
        ctx.replays = replays
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        for _, replay in ctx.replays:
            replay.set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)
        return grad, None


class MegatronLlama:
    """This rank's pipeline stage of an HF directory's model, with HF-named weights in and out
    and its routers driven per microbatch."""

    def __init__(self, hf_path: str | Path, *, recompute: bool = False, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        from megatron.core import parallel_state as ps

        self.hf_path = str(hf_path)
        self.hf_config = read_hf_config(hf_path)
        self.tp, self.rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
        self.group = ps.get_tensor_model_parallel_group()
        self.pp, self.pp_rank = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
        self.pp_group = ps.get_pipeline_model_parallel_group()
        self.ep, self.ep_rank = ps.get_expert_model_parallel_world_size(), ps.get_expert_model_parallel_rank()
        self.ep_group = ps.get_expert_model_parallel_group()
        self.etp, self.etp_rank = ps.get_expert_tensor_parallel_world_size(), ps.get_expert_tensor_parallel_rank()
        self.etp_group = ps.get_expert_tensor_parallel_group()
        self.recompute = recompute
        self.spec = megatron_spec(self.hf_config, tp=self.tp, ep=self.ep, pp=self.pp, path=self.hf_path)
        self.arch_map: ArchMap = build_arch_map(self.spec)
        self.shapes = megatron_shapes(self.spec)
        self.layers_per_stage = self.spec.num_layers // self.pp
        self.dtype, self.device = dtype, torch.device(device)
        # Built on the CPU (megatron's use_cpu_initialization), then moved whole to the rank's
        # device before DDP wraps it: DDP puts its gradient buffers where the parameters are.
        self.model = build_gpt_model(self.hf_config, self.spec, recompute=recompute, dtype=dtype).to(self.device)
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
        # This stage's routers' replay handles with each one's global layer (megatron numbers
        # from 1, across stages): a replayed row's layer axis is the global one.
        self._replays = [(block.layer_number - 1, block.mlp.router.router_replay)
                         for block in self.model.decoder.layers if moe is not None]

    def is_expert(self, name: str) -> bool:
        """Whether a (canonical) parameter name is an expert's: held by one EP rank only."""
        return expert_index(name) is not None

    def _global_name(self, name: str) -> str:
        """A megatron parameter name of this stage made a whole-model canonical one: its layer
        global, its local expert index global, and a tied model's last-stage output layer (PP >
        1) named as the embedding it copies."""
        if name.startswith("decoder.layers."):
            local, rest = name[len("decoder.layers."):].split(".", 1)
            name = f"decoder.layers.{self.model.decoder.layers[int(local)].layer_number - 1}.{rest}"
        elif name == "output_layer.weight" and self.spec.tie_embeddings:
            name = "embedding.word_embeddings.weight"
        name = canonical_megatron_name(name)
        found = expert_index(name)
        if found is None:
            return name
        return per_expert_name(found[0], self.ep_rank * self.local_experts + found[1])

    def _stage_of(self, name: str) -> int:
        """The pipeline stage owning a canonical name (a tied model's embedding: the first)."""
        if name.startswith("decoder.layers."):
            return int(name.split(".")[2]) // self.layers_per_stage
        return 0 if name.startswith("embedding.") else self.pp - 1

    def _holds(self, name: str) -> bool:
        tied_copy = (self.spec.tie_embeddings and self.pp > 1 and self.pp_rank == self.pp - 1
                     and name == "embedding.word_embeddings.weight")
        if self._stage_of(name) != self.pp_rank and not tied_copy:
            return False
        found = expert_index(name)
        return found is None or found[1] // self.local_experts == self.ep_rank

    def _boxes(self, name: str, whole: Box, rank: int) -> list[Box]:
        found = expert_index(name)
        if found is None:
            return rank_boxes(name, whole, rank, self.tp)
        # An expert splits over expert-TP as a dense MLP over TP; rank_boxes knows the dense names.
        return rank_boxes("mlp." + found[0].rpartition(".experts.experts.")[2], whole, rank, self.etp)

    def padded_length(self, length: int) -> int:
        """The sequence length a batch of ``length`` positions runs at: sequence parallel splits
        the positions evenly over TP, so it pads at the end, where a causal model's real
        positions never look (any valid id does)."""
        return -(-length // self.tp) * self.tp if self.sequence_parallel else length

    def replay_targets(self, rows: Sequence[np.ndarray], length: int) -> torch.Tensor:
        """The ``router_replay`` rows of a microbatch's samples as this rank's replay targets
        [samples, positions, sparse layers, top_k] at ``length`` (``padded_length``) positions:
        with sequence parallel only this TP rank's 1/TP of them (its routers route only those),
        so only those are widened."""
        per_rank = length // self.tp
        window = slice(self.rank * per_rank, (self.rank + 1) * per_rank) if self.sequence_parallel else None
        return replay_tensor(rows, length, positions=window, device=self.device)

    def clear_routes(self) -> None:
        """Before a forward/backward pass: forget the replay targets of earlier passes (a
        no-grad pass leaves them for a backward that never comes)."""
        for _, replay in self._replays:
            replay.clear_indices()
            replay.clear_router_replay_action()

    def run_stage(self, stage: torch.nn.Module, microbatch: Microbatch, positions: torch.Tensor,
                  mask: torch.Tensor) -> torch.Tensor:
        """One microbatch's forward through this rank's stage (``stage``: the model or its DDP
        wrapper; ``megatron_pipeline``'s ``run_stage``), every router set to replay
        ``microbatch.routes`` (``replay_targets``) or, when None, to route by its own top k;
        ``positions`` [B, T] (RoPE's, ``_rope_at``) and ``mask`` (True = masked) as given."""
        with self._rope_at(positions):
            return self._run_stage(stage, microbatch, positions, mask)

    @contextlib.contextmanager
    def _rope_at(self, positions: torch.Tensor) -> Iterator[None]:
        """While a forward runs: this stage's RoPE at ``positions`` [B, T] (each token's own),
        not megatron's 0..T-1, when they differ (packed rows). The frequencies become [T, B, 1,
        dim], which megatron's rotation broadcasts over the heads as it does [T, 1, 1, dim]."""
        rotary = getattr(self.model, "rotary_pos_emb", None)
        plain = torch.arange(positions.shape[1], device=positions.device)
        if rotary is None or bool((positions == plain).all()):
            yield
            return
        original = rotary.forward

        def at_positions(_max_seq_len: int, *args, **kwargs) -> torch.Tensor:
            table = original(int(positions.max()) + 1, *args, **kwargs)  # [P, 1, 1, dim]
            return table[:, 0, 0][positions.t()].unsqueeze(2)

        rotary.forward = at_positions
        try:
            yield
        finally:
            del rotary.forward

    def _run_stage(self, stage: torch.nn.Module, microbatch: Microbatch, positions: torch.Tensor,
                   mask: torch.Tensor) -> torch.Tensor:
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        routes = microbatch.routes
        if routes is not None and not self._replays:
            raise ValueError("routes to replay given to a dense model")
        if routes is None:
            for _, replay in self._replays:
                replay.clear_router_replay_action()
            return stage(microbatch.inputs, positions, mask)
        # megatron's routers see tokens in [sequence, batch] order: token = t * B + b. Each
        # target is also queued for the backward's recompute (RouterReplay's backward list).
        tokens = routes.transpose(0, 1).reshape(-1, *routes.shape[2:])
        for layer, replay in self._replays:
            replay.set_target_indices(tokens[:, layer].contiguous())
            replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        output = stage(microbatch.inputs, positions, mask)
        return _ReplayInBackward.apply(output, self._replays) if self.recompute else output

    def load_hf_state_dict(self, weights: dict[str, torch.Tensor]) -> None:
        """Copy HF-named whole tensors into this rank's parameters (its stage's, its TP box and
        EP experts of each), in place (the optimizer holds them). A tied model's
        ``lm_head.weight`` is ignored, as the engine's loader does. Names or (Megatron-side)
        shapes unlike the model's: ``CheckpointKeysError``."""
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
        """Every rank's shards gathered into whole HF-named tensors, on every rank (a
        collective): over TP and EP within each stage, then from each stage over PP. A tied
        model also lists ``lm_head.weight`` (the embedding), as the torch backend's state dict
        does."""
        stage: dict[str, torch.Tensor] = {}
        # Every rank of a stage walks its parameters in the same order (experts by local
        # index), so the TP and EP collectives pair up.
        for name, param in self.params.items():
            if not self.is_expert(name):
                stage[name] = self._gather(name, param.detach(), self.tp, self.group)
                continue
            whole = self._gather(name, param.detach(), self.etp, self.etp_group)
            grouped, expert = expert_index(name)
            pieces = [torch.empty_like(whole) for _ in range(self.ep)]
            dist.all_gather(pieces, whole, group=self.ep_group)
            for ep_rank, piece in enumerate(pieces):
                stage[per_expert_name(grouped, ep_rank * self.local_experts + expert % self.local_experts)] = piece
        out: dict[str, torch.Tensor] = {}
        for name, shape in self.shapes.items():  # one order on every rank
            whole = stage.get(name)
            if self.pp > 1:
                owner = self._stage_of(name)  # a tied model's last-stage copy is not sent
                if owner != self.pp_rank:
                    whole = torch.empty(shape, dtype=self.dtype, device=self.device)
                dist.broadcast(whole, src=dist.get_global_rank(self.pp_group, owner), group=self.pp_group)
            out.update(self.arch_map.to_hf(name, whole))
        if self.spec.tie_embeddings:
            # A copy, as the torch backend's: safetensors (weight buckets) refuses shared storage.
            out["lm_head.weight"] = out["model.embed_tokens.weight"].clone()
        return out

    def _gather(self, name: str, shard: torch.Tensor, size: int, group) -> torch.Tensor:
        """The whole tensor of ``name`` from its shards over ``group`` (TP, or expert TP)."""
        shape = self.shapes[name]
        whole_box = Box((0,) * len(shape), shape)
        if self._boxes(name, whole_box, 0) == [whole_box]:
            return shard.clone()  # replicated: every rank holds it whole
        shards = [torch.empty_like(shard) for _ in range(size)]
        dist.all_gather(shards, shard.contiguous(), group=group)
        whole = torch.empty(shape, dtype=shard.dtype, device=shard.device)
        for rank, piece in enumerate(shards):
            offset = 0
            for box in self._boxes(name, whole_box, rank):
                # Several boxes (SwiGLU fc1: gate rows, then up rows) sit one after another on dim 0.
                _region(whole, box).copy_(piece.narrow(0, offset, box.sizes[0]))
                offset += box.sizes[0]
        return whole
