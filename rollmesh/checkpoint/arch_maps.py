"""Declarative name and layout maps between Megatron-core and Hugging Face, per architecture.

Knows the Megatron-core (local and Transformer-Engine spec) and HF hub tensor names of the Llama,
Qwen2 (dense, GQA, QKV bias), Mixtral and Qwen3-MoE (per-expert SwiGLU, Qwen3's QK norms)
families, and the transforms of ``layout_transforms``; nothing of files. An ``ArchMap`` is a list
of ``Rule``s, one per canonical Megatron tensor: its HF tensors, and the transform each way. So
every mapping has its inverse (HF -> Megatron, to write test checkpoints or reshard back), and the
coverage is checkable: every Megatron tensor maps to HF tensors holding exactly its elements (less
vocabulary padding), with no HF name twice.

Canonical Megatron names are per layer and, for MoE, per expert: the local spec's names
(``input_layernorm``, ``pre_mlp_layernorm``, ``mlp.experts.local_experts.{E}.linear_fc{1,2}``)
with E the GLOBAL expert id. Readers bring what checkpoints store to these names:
``canonical_megatron_name`` folds in the Transformer-Engine spec's fused layer norms and
``TEGroupedMLP``'s per-gemm names (``mlp.experts.linear_fc1.weight{E}``); ``expert_index`` and
``per_expert_name`` go between a per-expert name and the grouped-experts tensor that torch_dist
checkpoints store (``mlp.experts.experts.linear_fc1.weight``, expert axis first, written alike by
``SequentialMLP``, ``GroupedMLP`` and ``TEGroupedMLP``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from rollmesh.checkpoint.layout_transforms import (
    deinterleave_qkv,
    interleave_qkv,
    join_gate_up,
    pad_vocab,
    split_gate_up,
    strip_vocab_padding,
)

Family = Literal["llama", "qwen2", "mixtral", "qwen3_moe"]
FAMILIES: tuple[Family, ...] = ("llama", "qwen2", "mixtral", "qwen3_moe")


@dataclass(frozen=True)
class ArchSpec:
    """The hyperparameters that decide names and shapes (from the checkpoint's saved args)."""

    family: Family
    num_layers: int
    hidden_size: int
    num_heads: int
    num_query_groups: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int  # the tokenizer's; Megatron pads its tables to padded_vocab_size
    padded_vocab_size: int
    tie_embeddings: bool = False
    num_experts: int = 0  # MoE families only
    moe_ffn_hidden_size: int = 0

    def __post_init__(self) -> None:
        moe = self.family in ("mixtral", "qwen3_moe")
        if moe != (self.num_experts > 0):
            raise ValueError(f"{self.family} {'needs' if moe else 'takes no'} experts")
        if self.num_heads % self.num_query_groups:
            raise ValueError(f"{self.num_heads} heads do not split into {self.num_query_groups} groups")
        if self.padded_vocab_size < self.vocab_size:
            raise ValueError("padded_vocab_size is below vocab_size")

    @property
    def expert_ffn(self) -> int:
        return self.moe_ffn_hidden_size or self.ffn_hidden_size


Forward = Callable[[torch.Tensor], Sequence[torch.Tensor]]
Inverse = Callable[[Sequence[torch.Tensor]], torch.Tensor]


@dataclass(frozen=True)
class Rule:
    """One Megatron tensor <-> its HF tensors (in ``hf_names`` order)."""

    megatron_name: str
    hf_names: tuple[str, ...]
    forward: Forward
    inverse: Inverse


def _same() -> tuple[Forward, Inverse]:
    return (lambda t: (t,)), (lambda ts: ts[0])


class ArchMap:
    def __init__(self, spec: ArchSpec, rules: list[Rule]) -> None:
        self.spec = spec
        self.rules = rules
        self._by_megatron = {rule.megatron_name: rule for rule in rules}
        if len(self._by_megatron) != len(rules):
            raise ValueError("a Megatron name appears in two rules")

    def megatron_names(self) -> list[str]:
        return [rule.megatron_name for rule in self.rules]

    def hf_names(self) -> list[str]:
        return [name for rule in self.rules for name in rule.hf_names]

    def rule(self, megatron_name: str) -> Rule:
        try:
            return self._by_megatron[canonical_megatron_name(megatron_name)]
        except KeyError:
            raise KeyError(f"{megatron_name!r} is not a tensor of a {self.spec.family} checkpoint") from None

    def to_hf(self, megatron_name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        rule = self.rule(megatron_name)
        return dict(zip(rule.hf_names, rule.forward(tensor), strict=True))

    def to_megatron(self, hf_tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Every Megatron tensor from a whole HF state dict (the inverse direction)."""
        return {rule.megatron_name: rule.inverse([hf_tensors[name] for name in rule.hf_names])
                for rule in self.rules}


# Transformer-Engine spec names -> local spec names (TE fuses each pre-norm into the next linear;
# TEGroupedMLP keeps expert E's weights as ``linear_fc1.weight{E}`` of one grouped linear).
_TE_NAMES = [
    (re.compile(r"^(decoder\.layers\.\d+)\.self_attention\.linear_qkv\.layer_norm_weight$"), r"\1.input_layernorm.weight"),
    (re.compile(r"^(decoder\.layers\.\d+)\.mlp\.linear_fc1\.layer_norm_weight$"), r"\1.pre_mlp_layernorm.weight"),
    (re.compile(r"^(decoder\.layers\.\d+\.mlp\.experts)\.(linear_fc[12])\.weight(\d+)$"),
     r"\1.local_experts.\3.\2.weight"),
]
_LOCAL_EXPERT = re.compile(r"^(decoder\.layers\.\d+\.mlp\.experts)\.local_experts\.(\d+)\.(linear_fc[12]\.weight)$")
_GROUPED_EXPERTS = re.compile(r"^(decoder\.layers\.\d+\.mlp\.experts)\.experts\.(linear_fc[12]\.weight)$")


def canonical_megatron_name(name: str) -> str:
    """The canonical name of a per-layer Megatron tensor name: TE's fused layer norms renamed to
    the local spec's, TE grouped-gemm expert weights (``experts.linear_fc1.weight{E}``) to
    ``experts.local_experts.{E}.linear_fc1.weight``. E is kept as given: TE numbers a rank's
    gemms locally, names only seen in per-rank files, whose reader renumbers them globally
    (torch_dist stores TE experts grouped, under the global ids of ``expert_index``)."""
    for pattern, replacement in _TE_NAMES:
        if pattern.match(name):
            return pattern.sub(replacement, name)
    return name


def expert_index(name: str) -> tuple[str, int] | None:
    """``...mlp.experts.local_experts.{E}.linear_fc1.weight`` -> (the grouped-experts tensor
    ``...mlp.experts.experts.linear_fc1.weight``, E): where a per-expert tensor sits on the
    leading expert axis of the grouped one torch_dist stores; None for any other name."""
    match = _LOCAL_EXPERT.match(name)
    if match is None:
        return None
    return f"{match.group(1)}.experts.{match.group(3)}", int(match.group(2))


def per_expert_name(grouped: str, expert: int) -> str | None:
    """The inverse of ``expert_index``: (``...mlp.experts.experts.linear_fc1.weight``, E) ->
    ``...mlp.experts.local_experts.{E}.linear_fc1.weight``; None when ``grouped`` is not a
    per-layer grouped-experts name."""
    match = _GROUPED_EXPERTS.match(grouped)
    if match is None:
        return None
    return f"{match.group(1)}.local_experts.{expert}.{match.group(2)}"


def build_arch_map(spec: ArchSpec) -> ArchMap:
    rules = [_vocab_rule("embedding.word_embeddings.weight", "model.embed_tokens.weight", spec)]
    for layer in range(spec.num_layers):
        rules += _attention_rules(spec, layer)
        rules += _mlp_rules(spec, layer)
    forward, inverse = _same()
    rules.append(Rule("decoder.final_layernorm.weight", ("model.norm.weight",), forward, inverse))
    if not spec.tie_embeddings:
        rules.append(_vocab_rule("output_layer.weight", "lm_head.weight", spec))
    return ArchMap(spec, rules)


def _vocab_rule(megatron: str, hf: str, spec: ArchSpec) -> Rule:
    return Rule(megatron, (hf,), lambda t: (strip_vocab_padding(t, spec.vocab_size),),
                lambda ts: pad_vocab(ts[0], spec.padded_vocab_size))


def _attention_rules(spec: ArchSpec, layer: int) -> list[Rule]:
    m, h = f"decoder.layers.{layer}", f"model.layers.{layer}"
    geometry = dict(groups=spec.num_query_groups, heads=spec.num_heads, head_dim=spec.head_dim)
    forward, inverse = _same()
    qkv_forward: Forward = lambda t: deinterleave_qkv(t, **geometry)  # noqa: E731
    qkv_inverse: Inverse = lambda ts: interleave_qkv(*ts, **geometry)  # noqa: E731
    rules = [
        Rule(f"{m}.input_layernorm.weight", (f"{h}.input_layernorm.weight",), forward, inverse),
        Rule(f"{m}.self_attention.linear_qkv.weight",
             tuple(f"{h}.self_attn.{p}_proj.weight" for p in "qkv"), qkv_forward, qkv_inverse),
        Rule(f"{m}.self_attention.linear_proj.weight", (f"{h}.self_attn.o_proj.weight",), forward, inverse),
        Rule(f"{m}.pre_mlp_layernorm.weight", (f"{h}.post_attention_layernorm.weight",), forward, inverse),
    ]
    if spec.family == "qwen2":  # QKV bias
        rules.append(Rule(f"{m}.self_attention.linear_qkv.bias",
                          tuple(f"{h}.self_attn.{p}_proj.bias" for p in "qkv"), qkv_forward, qkv_inverse))
    if spec.family == "qwen3_moe":  # per-head RMSNorm of q and k
        rules += [Rule(f"{m}.self_attention.q_layernorm.weight", (f"{h}.self_attn.q_norm.weight",), forward, inverse),
                  Rule(f"{m}.self_attention.k_layernorm.weight", (f"{h}.self_attn.k_norm.weight",), forward, inverse)]
    return rules


def _mlp_rules(spec: ArchSpec, layer: int) -> list[Rule]:
    m, h = f"decoder.layers.{layer}", f"model.layers.{layer}"
    forward, inverse = _same()
    if spec.num_experts == 0:
        return [
            Rule(f"{m}.mlp.linear_fc1.weight", (f"{h}.mlp.gate_proj.weight", f"{h}.mlp.up_proj.weight"),
                 split_gate_up, lambda ts: join_gate_up(*ts)),
            Rule(f"{m}.mlp.linear_fc2.weight", (f"{h}.mlp.down_proj.weight",), forward, inverse),
        ]
    if spec.family == "mixtral":
        ffn, gate, up, down = f"{h}.block_sparse_moe", "w1", "w3", "w2"
    else:
        ffn, gate, up, down = f"{h}.mlp", "gate_proj", "up_proj", "down_proj"
    rules = [Rule(f"{m}.mlp.router.weight", (f"{ffn}.gate.weight",), forward, inverse)]
    for e in range(spec.num_experts):
        expert = f"{m}.mlp.experts.local_experts.{e}"
        rules += [
            Rule(f"{expert}.linear_fc1.weight", (f"{ffn}.experts.{e}.{gate}.weight", f"{ffn}.experts.{e}.{up}.weight"),
                 split_gate_up, lambda ts: join_gate_up(*ts)),
            Rule(f"{expert}.linear_fc2.weight", (f"{ffn}.experts.{e}.{down}.weight",), forward, inverse),
        ]
    return rules


def megatron_shapes(spec: ArchSpec) -> dict[str, tuple[int, ...]]:
    """The global shape of every Megatron tensor (what a checkpoint of ``spec`` holds)."""
    hidden, d = spec.hidden_size, spec.head_dim
    qkv_rows = (spec.num_heads + 2 * spec.num_query_groups) * d
    shapes: dict[str, tuple[int, ...]] = {"embedding.word_embeddings.weight": (spec.padded_vocab_size, hidden),
                                          "decoder.final_layernorm.weight": (hidden,)}
    if not spec.tie_embeddings:
        shapes["output_layer.weight"] = (spec.padded_vocab_size, hidden)
    for layer in range(spec.num_layers):
        m = f"decoder.layers.{layer}"
        shapes[f"{m}.input_layernorm.weight"] = (hidden,)
        shapes[f"{m}.self_attention.linear_qkv.weight"] = (qkv_rows, hidden)
        shapes[f"{m}.self_attention.linear_proj.weight"] = (hidden, spec.num_heads * d)
        shapes[f"{m}.pre_mlp_layernorm.weight"] = (hidden,)
        if spec.family == "qwen2":
            shapes[f"{m}.self_attention.linear_qkv.bias"] = (qkv_rows,)
        if spec.family == "qwen3_moe":
            shapes[f"{m}.self_attention.q_layernorm.weight"] = (d,)
            shapes[f"{m}.self_attention.k_layernorm.weight"] = (d,)
        if spec.num_experts == 0:
            shapes[f"{m}.mlp.linear_fc1.weight"] = (2 * spec.ffn_hidden_size, hidden)
            shapes[f"{m}.mlp.linear_fc2.weight"] = (hidden, spec.ffn_hidden_size)
        else:
            shapes[f"{m}.mlp.router.weight"] = (spec.num_experts, hidden)
            for e in range(spec.num_experts):
                shapes[f"{m}.mlp.experts.local_experts.{e}.linear_fc1.weight"] = (2 * spec.expert_ffn, hidden)
                shapes[f"{m}.mlp.experts.local_experts.{e}.linear_fc2.weight"] = (hidden, spec.expert_ffn)
    return shapes
