"""Writes real Megatron-core checkpoints on CPU, for the checkpoint tests and benchmarks.

Run as a script (``python tests/support/megatron_checkpoints.py OUT --tp 2 [--ep 2 --moe] [--legacy]
[--legacy-out OUT2]``): it spawns one process per rank (tensor parallel x expert parallel) under
gloo, builds a tiny GPTModel with megatron-core's local layer spec (dense Llama-like, or with ``--moe`` a
Qwen3-MoE-like one: QK layer norms, softmax router whose top-k probabilities are renormalised,
SwiGLU experts run by ``SequentialMLP``), saves it with ``dist_checkpointing.save`` (or as
Megatron-LM's legacy per-rank files) and writes megatron-core's own logits for ``PROBE_IDS``
next to it (``OUT.logits.pt``), the reference a converted model must reproduce.
``write_checkpoint`` runs that script in a child process, so the test process never initialises
torch.distributed or megatron's global state. Size options (``--layers --hidden --ffn --vocab
--dtype --no-logits``) let a benchmark write a large dense checkpoint.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TINY_DENSE = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128,
                  vocab_size=300)
# Qwen3-MoE-like: every layer an MoE layer of 4 experts, top 2, QK norms. ffn_hidden_size is
# only what Megatron-LM's args carry (no dense MLP is built).
TINY_MOE = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128,
                vocab_size=300, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32)
PROBE_IDS = [[5, 17, 42, 99, 7, 250, 3, 11, 64, 128]]


def logits_path(checkpoint: Path) -> Path:
    return checkpoint.with_name(checkpoint.name + ".logits.pt")


def write_checkpoint(out: Path, *, tp: int = 2, ep: int = 1, moe: bool = False, legacy: bool = False,
                     legacy_out: Path | None = None, layers: int | None = None, hidden: int | None = None, ffn: int | None = None,
                     vocab: int | None = None, dtype: str = "float32", logits: bool = True,
                     timeout_s: float = 240.0) -> Path:
    """Write ``out`` (torch_dist, or with ``legacy`` per-rank files); ``legacy_out`` also writes
    the same model's per-rank files there, in the same run (one process start for both)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")]), "MASTER_PORT": str(port)}
    command = [sys.executable, __file__, str(out), "--tp", str(tp), "--ep", str(ep), "--dtype", dtype]
    command += ["--moe"] * moe + ["--legacy"] * legacy + ["--no-logits"] * (not logits)
    command += ["--legacy-out", str(legacy_out)] if legacy_out is not None else []
    for flag, value in (("--layers", layers), ("--hidden", hidden), ("--ffn", ffn), ("--vocab", vocab)):
        if value is not None:
            command += [flag, str(value)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"writing a megatron checkpoint failed:\n{done.stderr[-4000:]}")
    return out


def model_sizes(options: argparse.Namespace) -> dict:
    """The model's hyperparameters: the tiny defaults, overridden by the size options."""
    sizes = dict(TINY_MOE if options.moe else TINY_DENSE)
    for key, value in (("num_layers", options.layers), ("hidden_size", options.hidden),
                       ("ffn_hidden_size", options.ffn), ("vocab_size", options.vocab)):
        if value is not None:
            sizes[key] = value
    return sizes


def _save(rank: int, world: int, options: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from rollmesh.training.megatron_cpu_shims import install_cpu_shims

    os.environ.update(MASTER_ADDR="127.0.0.1", RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    install_cpu_shims()
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    tp, ep = options.tp, options.ep
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep)
    sizes = model_sizes(options)
    dtype = getattr(torch, options.dtype)
    torch.manual_seed(1234)  # the same full model whatever the TP degree
    moe_fields = {}
    if options.moe:
        # What makes megatron-core's MoE layer compute what HF's Qwen3MoeSparseMoeBlock computes:
        # top-k of the router logits, then softmax over those k (= softmax over all experts, top-k,
        # renormalised: norm_topk_prob), no load-balancing term, experts one after the other.
        moe_fields = dict(
            num_moe_experts=sizes["num_experts"], moe_router_topk=sizes["moe_router_topk"],
            moe_ffn_hidden_size=sizes["moe_ffn_hidden_size"], moe_router_pre_softmax=False,
            moe_router_score_function="softmax", moe_router_load_balancing_type="none",
            moe_token_dispatcher_type="allgather", moe_grouped_gemm=False, qk_layernorm=True,
            expert_model_parallel_size=ep)
    config = TransformerConfig(
        num_layers=sizes["num_layers"], hidden_size=sizes["hidden_size"],
        num_attention_heads=sizes["num_attention_heads"], num_query_groups=sizes["num_query_groups"],
        ffn_hidden_size=sizes["ffn_hidden_size"], use_cpu_initialization=True, gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, normalization="RMSNorm", add_bias_linear=False,
        tensor_model_parallel_size=tp, params_dtype=dtype, bf16=dtype == torch.bfloat16, **moe_fields)
    spec = get_gpt_layer_local_spec(num_experts=sizes.get("num_experts") if options.moe else None,
                                    moe_grouped_gemm=False, qk_layernorm=options.moe)
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=sizes["vocab_size"],
                     max_sequence_length=64, position_embedding_type="rope",
                     share_embeddings_and_output_weights=False)
    if options.moe:
        _distinct_experts(model, sizes, tp_rank=parallel_state.get_tensor_model_parallel_rank(), tp=tp,
                          ep_rank=parallel_state.get_expert_model_parallel_rank(), ep=ep)
    # What Megatron-LM saves with every checkpoint (common.pt): the converter reads the model from it.
    args = argparse.Namespace(
        num_layers=config.num_layers, hidden_size=config.hidden_size, num_attention_heads=config.num_attention_heads,
        group_query_attention=True, num_query_groups=config.num_query_groups, kv_channels=config.kv_channels,
        ffn_hidden_size=config.ffn_hidden_size, padded_vocab_size=sizes["vocab_size"],
        untie_embeddings_and_output_weights=True, normalization="RMSNorm", norm_epsilon=config.layernorm_epsilon,
        rotary_base=10000, swiglu=True, add_qkv_bias=False, qk_layernorm=options.moe, num_experts=None,
        max_position_embeddings=64, params_dtype=dtype, tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=1, expert_model_parallel_size=ep)
    if options.moe:
        args.__dict__.update(
            num_experts=sizes["num_experts"], moe_router_topk=sizes["moe_router_topk"],
            moe_ffn_hidden_size=sizes["moe_ffn_hidden_size"], moe_router_pre_softmax=False,
            moe_router_score_function="softmax", moe_router_load_balancing_type="none",
            moe_token_dispatcher_type="allgather", moe_grouped_gemm=False, expert_tensor_parallel_size=tp)
    outputs = [Path(options.out)] + ([Path(options.legacy_out)] if options.legacy_out else [])
    for legacy, out in zip((options.legacy, True), outputs):
        if legacy:
            # Megatron-LM's legacy format (checkpointing.get_checkpoint_name): one file per
            # mp_rank_{tp:02d}[_{pp:03d}][_{ep:03d}] folder, written by expert-data-parallel rank 0.
            if parallel_state.get_expert_data_parallel_rank() == 0:
                name = f"mp_rank_{parallel_state.get_tensor_model_parallel_rank():02d}"
                if ep > 1:
                    name += f"_{parallel_state.get_expert_model_parallel_rank():03d}"
                (out / name).mkdir(parents=True, exist_ok=True)
                torch.save({"model": model.state_dict(), "args": args, "iteration": 10, "checkpoint_version": 3.0},
                           out / name / "model_optim_rng.pt")
        else:
            state = model.sharded_state_dict()
            state["args"] = args
            dist_checkpointing.save(state, str(out))
    if options.logits:
        _save_logits(model, rank, outputs)
    dist.barrier()
    dist.destroy_process_group()


def _distinct_experts(model, sizes: dict, *, tp_rank: int, tp: int, ep_rank: int, ep: int) -> None:
    """Give every expert its own weights, drawn from its global id, and the router weights large
    enough that top-k choices are not near ties.

    megatron-core draws each rank's local experts from the same CPU seed, so expert e of EP rank 1
    would equal expert e of rank 0, and a converter that put experts in the wrong order would
    still pass. Here each global expert's full weight is drawn, then this rank's TP slice taken
    the way megatron shards it: ``linear_fc1`` = [gate rows of rank r; up rows of rank r],
    ``linear_fc2`` = columns of rank r."""
    import torch

    hidden, ffn, experts = sizes["hidden_size"], sizes["moe_ffn_hidden_size"], sizes["num_experts"]
    local, step = experts // ep, ffn // tp
    rows = slice(tp_rank * step, (tp_rank + 1) * step)
    with torch.no_grad():
        for layer, block in enumerate(model.decoder.layers):
            mlp = block.mlp
            draw = torch.Generator().manual_seed(10_000 + layer)
            mlp.router.weight.copy_(torch.randn(experts, hidden, generator=draw))
            for index, expert in enumerate(mlp.experts.local_experts):
                draw = torch.Generator().manual_seed(100 * (layer + 1) + ep_rank * local + index)
                gate = torch.randn(ffn, hidden, generator=draw) * 0.1
                up = torch.randn(ffn, hidden, generator=draw) * 0.1
                down = torch.randn(hidden, ffn, generator=draw) * 0.1
                expert.linear_fc1.weight.copy_(torch.cat([gate[rows], up[rows]]))
                expert.linear_fc2.weight.copy_(down[:, rows])


def _save_logits(model, rank: int, outputs: list[Path]) -> None:
    import torch
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    model.eval()
    ids = torch.tensor(PROBE_IDS)
    causal = torch.triu(torch.ones(1, 1, ids.shape[1], ids.shape[1]), diagonal=1).bool()  # True: masked
    with torch.no_grad():
        logits = gather_from_tensor_model_parallel_region(model(ids, torch.arange(ids.shape[1])[None], causal))
    if rank == 0:
        for out in outputs:
            torch.save(logits, logits_path(out))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--ep", type=int, default=1, help="expert-parallel degree (with --moe)")
    parser.add_argument("--moe", action="store_true", help="a Qwen3-MoE-like model, not a dense one")
    parser.add_argument("--legacy", action="store_true", help="per-rank model_optim_rng.pt files, not torch_dist")
    parser.add_argument("--legacy-out", help="also write the per-rank files of the same model here")
    parser.add_argument("--layers", type=int)
    parser.add_argument("--hidden", type=int)
    parser.add_argument("--ffn", type=int)
    parser.add_argument("--vocab", type=int)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--no-logits", dest="logits", action="store_false", help="skip the reference forward")
    options = parser.parse_args()
    if options.ep > 1 and not options.moe:
        parser.error("--ep needs --moe")
    for folder in (options.out, options.legacy_out):
        if folder:
            Path(folder).mkdir(parents=True, exist_ok=True)
    import torch.multiprocessing as mp

    mp.spawn(_save, args=(options.tp * options.ep, options), nprocs=options.tp * options.ep)
