"""A megatron-core GPTModel (local layer spec) built from a Hugging Face Llama-family directory,
and its tensor-parallel weights moved to and from HF names.

Knows megatron-core (model, parallel state), the checkpoint package's maps (``arch_maps``: HF <->
canonical Megatron tensors; ``tp_reshard.rank_boxes``: which box of each global tensor a TP rank
holds) and torch.distributed; nothing of losses, optimizers, Ray or NATS. Runs inside one process
per TP rank, with torch.distributed and ``parallel_state`` already initialised by the caller.

Dense families only (Llama, Qwen2 without QKV bias: no MoE, no QKV bias, no QK norms), which is
what ``megatron_config`` builds. Vocabulary: padded only to a multiple of the TP degree (not to
Megatron-LM's 128), and the padded logits are cut off (``MegatronLlama.logits``): a padded row's
logit (0) would otherwise enter the softmax and change every logprob.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
import torch.distributed as dist

from rollmesh.checkpoint.arch_maps import ArchMap, ArchSpec, build_arch_map, canonical_megatron_name, megatron_shapes
from rollmesh.checkpoint.chunk_geometry import Box
from rollmesh.checkpoint.tp_reshard import rank_boxes
from rollmesh.engine.models import CheckpointKeysError, read_hf_config
from rollmesh.engine.models.hf_config import HFModelConfig
from rollmesh.training.megatron_checkpoint import describe_hf_model


class UnsupportedMegatronModelError(ValueError):
    """An HF model this backend does not build: ``field`` is the HF config field in the way."""

    def __init__(self, reason: str, *, field: str, path: str) -> None:
        super().__init__(f"{path}: {field}: {reason}")
        self.field = field
        self.path = path


def megatron_spec(config: HFModelConfig, *, tp: int, path: str = "") -> ArchSpec:
    """The ``ArchSpec`` of ``config`` with the vocabulary padded to a multiple of ``tp`` only."""
    for field, bad in (("moe", config.moe is not None), ("attention_bias", config.qkv_bias or config.o_proj_bias),
                       ("mlp_bias", config.mlp_bias), ("qk_norm", config.qk_norm),
                       ("sliding_window", config.sliding_window is not None)):
        if bad:
            raise UnsupportedMegatronModelError("dense Llama-family models only", field=field, path=path)
    if config.num_key_value_heads % tp:
        raise UnsupportedMegatronModelError(f"{config.num_key_value_heads} query groups do not split over {tp} ranks",
                                            field="num_key_value_heads", path=path)
    spec = describe_hf_model(config, path=path).spec
    return dataclasses.replace(spec, padded_vocab_size=-(-spec.vocab_size // tp) * tp)


def build_gpt_model(config: HFModelConfig, spec: ArchSpec, *, tp: int):
    """A float32, CPU-initialised local-spec GPTModel shaped like ``config`` (random weights)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    transformer = TransformerConfig(
        num_layers=spec.num_layers, hidden_size=spec.hidden_size, num_attention_heads=spec.num_heads,
        num_query_groups=spec.num_query_groups, kv_channels=spec.head_dim, ffn_hidden_size=spec.ffn_hidden_size,
        normalization="RMSNorm", layernorm_epsilon=config.rms_norm_eps, gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, add_bias_linear=False, add_qkv_bias=False,
        # megatron's defaults are 0.1: HF Llama trains without dropout, and CPU runs have no
        # model-parallel RNG to draw it from (megatron_cpu_shims).
        hidden_dropout=0.0, attention_dropout=0.0,
        params_dtype=torch.float32, use_cpu_initialization=True, tensor_model_parallel_size=tp)
    # The local spec's rotary embedding is non-interleaved (rotate_half), as HF Llama's is.
    return GPTModel(config=transformer, transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
                    vocab_size=spec.padded_vocab_size, max_sequence_length=config.max_position_embeddings,
                    position_embedding_type="rope", rotary_base=config.rope_theta,
                    share_embeddings_and_output_weights=spec.tie_embeddings)


def _region(tensor: torch.Tensor, box: Box) -> torch.Tensor:
    return tensor[tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes, strict=True))]


class MegatronLlama:
    """One TP rank's GPTModel of an HF directory, with HF-named weights in and out."""

    def __init__(self, hf_path: str | Path) -> None:
        from megatron.core import parallel_state

        self.hf_path = str(hf_path)
        self.hf_config = read_hf_config(hf_path)
        self.tp = parallel_state.get_tensor_model_parallel_world_size()
        self.rank = parallel_state.get_tensor_model_parallel_rank()
        self.group = parallel_state.get_tensor_model_parallel_group()
        self.spec = megatron_spec(self.hf_config, tp=self.tp, path=self.hf_path)
        self.arch_map: ArchMap = build_arch_map(self.spec)
        self.shapes = megatron_shapes(self.spec)
        self.model = build_gpt_model(self.hf_config, self.spec, tp=self.tp)
        self.params = {canonical_megatron_name(name): p for name, p in self.model.named_parameters()}
        if self.params.keys() != self.shapes.keys():
            raise UnsupportedMegatronModelError(
                f"megatron-core built {sorted(self.params.keys() ^ self.shapes.keys())} unlike the map",
                field="$", path=self.hf_path)

    def logits(self, inputs: torch.Tensor) -> torch.Tensor:
        """[B, T, vocab] full-vocabulary logits (gathered over TP; differentiable: the backward
        keeps each rank's vocabulary slice), causal attention, padded vocabulary rows cut off."""
        from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

        length = inputs.shape[1]
        positions = torch.arange(length)[None].expand_as(inputs)
        # True = masked. Passed explicitly: megatron's default causal mask is built on "cuda".
        causal = torch.triu(torch.ones(1, 1, length, length, dtype=torch.bool), diagonal=1)
        sharded = self.model(inputs, positions, causal)
        return gather_from_tensor_model_parallel_region(sharded)[..., : self.spec.vocab_size]

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
                boxes = rank_boxes(name, Box((0,) * whole.dim(), tuple(whole.shape)), self.rank, self.tp)
                # Several boxes (SwiGLU fc1: rank r's gate rows, then its up rows) stack on dim 0.
                param.copy_(torch.cat([_region(whole, box) for box in boxes]).reshape(param.shape))

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """Every rank's shards gathered into whole HF-named tensors (every rank gets them all; a
        collective: every rank must call it). A tied model also lists ``lm_head.weight`` (the
        embedding), as the torch backend's state dict does."""
        out: dict[str, torch.Tensor] = {}
        for name, param in self.params.items():
            out.update(self.arch_map.to_hf(name, self._gather(name, param.detach())))
        if self.spec.tie_embeddings:
            out["lm_head.weight"] = out["model.embed_tokens.weight"]
        return out

    def _gather(self, name: str, shard: torch.Tensor) -> torch.Tensor:
        shape = self.shapes[name]
        whole_box = Box((0,) * len(shape), shape)
        if rank_boxes(name, whole_box, 0, self.tp) == [whole_box]:
            return shard.clone()  # replicated: every rank holds it whole
        shards = [torch.empty_like(shard) for _ in range(self.tp)]
        dist.all_gather(shards, shard.contiguous(), group=self.group)
        whole = torch.empty(shape, dtype=shard.dtype)
        for rank, piece in enumerate(shards):
            offset = 0
            for box in rank_boxes(name, whole_box, rank, self.tp):
                # Several boxes (SwiGLU fc1: gate rows, then up rows) sit one after another on dim 0.
                _region(whole, box).copy_(piece.narrow(0, offset, box.sizes[0]))
                offset += box.sizes[0]
        return whole
