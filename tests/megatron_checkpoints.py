"""Writes real Megatron-core ``torch_dist`` checkpoints on CPU, for the checkpoint tests.

Run as a script (``python tests/megatron_checkpoints.py OUT --tp 2``): it spawns one process per
tensor-parallel rank under gloo, builds a tiny GPTModel with megatron-core's local layer spec,
saves it with ``dist_checkpointing.save`` and writes megatron-core's own logits for
``PROBE_IDS`` next to it (``OUT.logits.pt``), the reference a converted model must reproduce. ``write_checkpoint`` runs that script in a child
process, so the test process never initialises torch.distributed or megatron's global state.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TINY_DENSE = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128,
                  vocab_size=300)
PROBE_IDS = [[5, 17, 42, 99, 7, 250, 3, 11, 64, 128]]


def logits_path(checkpoint: Path) -> Path:
    return checkpoint.with_name(checkpoint.name + ".logits.pt")


def write_checkpoint(out: Path, *, tp: int = 2, legacy: bool = False, timeout_s: float = 240.0) -> Path:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(REPO), "MASTER_PORT": str(port)}
    command = [sys.executable, __file__, str(out), "--tp", str(tp)] + (["--legacy"] if legacy else [])
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"writing a megatron checkpoint failed:\n{done.stderr[-4000:]}")
    return out


def _save(rank: int, world: int, out: str, legacy: bool) -> None:
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

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    torch.manual_seed(1234)  # the same full model whatever the TP degree
    config = TransformerConfig(
        num_layers=TINY_DENSE["num_layers"], hidden_size=TINY_DENSE["hidden_size"],
        num_attention_heads=TINY_DENSE["num_attention_heads"], num_query_groups=TINY_DENSE["num_query_groups"],
        ffn_hidden_size=TINY_DENSE["ffn_hidden_size"], use_cpu_initialization=True, gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, normalization="RMSNorm", add_bias_linear=False,
        tensor_model_parallel_size=world, params_dtype=torch.float32)
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(),
                     vocab_size=TINY_DENSE["vocab_size"], max_sequence_length=64, position_embedding_type="rope",
                     share_embeddings_and_output_weights=False)
    state = model.sharded_state_dict()
    # What Megatron-LM saves with every checkpoint (common.pt): the converter reads the model from it.
    state["args"] = argparse.Namespace(
        num_layers=config.num_layers, hidden_size=config.hidden_size, num_attention_heads=config.num_attention_heads,
        group_query_attention=True, num_query_groups=config.num_query_groups, kv_channels=config.kv_channels,
        ffn_hidden_size=config.ffn_hidden_size, padded_vocab_size=TINY_DENSE["vocab_size"],
        untie_embeddings_and_output_weights=True, normalization="RMSNorm", norm_epsilon=config.layernorm_epsilon,
        rotary_base=10000, swiglu=True, add_qkv_bias=False, qk_layernorm=False, num_experts=None,
        max_position_embeddings=64, params_dtype=torch.float32, tensor_model_parallel_size=world)
    if legacy:
        # Megatron-LM's legacy format: each rank saves its local shards (mp_rank_XX/model_optim_rng.pt).
        rank_dir = Path(out) / f"mp_rank_{rank:02d}"
        rank_dir.mkdir(parents=True, exist_ok=True)
        torch.save({"model": model.state_dict(), "args": state["args"], "iteration": 10},
                   rank_dir / "model_optim_rng.pt")
    else:
        dist_checkpointing.save(state, out)
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    model.eval()
    ids = torch.tensor(PROBE_IDS)
    causal = torch.triu(torch.ones(1, 1, ids.shape[1], ids.shape[1]), diagonal=1).bool()  # True: masked
    with torch.no_grad():
        logits = gather_from_tensor_model_parallel_region(model(ids, torch.arange(ids.shape[1])[None], causal))
    if rank == 0:
        torch.save(logits, logits_path(Path(out)))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--legacy", action="store_true", help="per-rank model_optim_rng.pt files, not torch_dist")
    args = parser.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    import torch.multiprocessing as mp

    mp.spawn(_save, args=(args.tp, args.out, args.legacy), nprocs=args.tp)
