"""Runs ``MegatronTrainerBackend`` on tensor- and expert-parallel ranks under gloo, for its tests.

Run as a script (``python tests/megatron_backend_worker.py JOB.pt OUT.pt --tp 2 [--ep 2]``):
spawns one process per rank (TP x EP), and for every case in ``JOB.pt`` ({name: {"hf_path",
"trainer", "probe", "samples", "save_root"}}, optionally "recompute", "replay_probe" and
"grads") builds the backend from the HF directory, records its logits on ``probe``, checks the
HF state-dict round trip (load, gather) bit for bit, runs one ``policy_step`` on ``samples``,
gathers the weights after it and, given a ``save_root``, saves a checkpoint there. MoE cases
may also ask for:
- ``replay_probe`` (inputs, rows per sample): the logits of a forward replaying those rows and
  the experts its routers actually chose, seen by hooks on the routers ("chosen" [B, T, layers,
  k], each row sorted);
- ``grads``: before the step, the gradients of the samples' summed target logprobs (replaying
  their routes when they carry them), gathered into whole HF-named tensors, and how many times
  the routers ran during that backward (activation recompute runs them again).
Rank 0 writes {name: results} to ``OUT.pt``; the tests compare them with the torch backend and
transformers in their own process. ``run_worker`` starts the script in a child process, so the
test process never initialises torch.distributed or megatron's global state.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def run_worker(job: Path, out: Path, *, tp: int = 2, ep: int = 1, timeout_s: float = 240.0) -> dict:
    import torch

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(REPO), "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, __file__, str(job), str(out), "--tp", str(tp), "--ep", str(ep)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"the megatron backend worker failed:\n{done.stderr[-6000:]}")
    return torch.load(out, weights_only=False)


def _rank(rank: int, world: int, ep: int, job_path: str, out_path: str) -> None:
    import torch
    import torch.distributed as dist

    from rollmesh.training.megatron_cpu_shims import install_cpu_shims

    os.environ.update(MASTER_ADDR="127.0.0.1", RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    install_cpu_shims()
    from megatron.core import parallel_state

    from rollmesh.config import ModelConfig, TrainerConfig
    from rollmesh.engine.models import read_safetensors
    from rollmesh.training.megatron_backend import MegatronTrainerBackend

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world // ep, expert_model_parallel_size=ep)
    job = torch.load(job_path, weights_only=False)
    results = {}
    for name, case in job.items():
        started = time.perf_counter()
        backend = MegatronTrainerBackend(ModelConfig(family="hf", hf_path=case["hf_path"]),
                                         TrainerConfig(**case["trainer"]), recompute=case.get("recompute", False))
        with torch.no_grad():
            logits = backend.net.logits(case["probe"])
        extra = {}
        if "replay_probe" in case:
            extra.update(_replayed_forward(backend, *case["replay_probe"]))
        if case.get("grads"):
            extra.update(_replayed_grads(backend, case["samples"]))
        original = read_safetensors(case["hf_path"], dtype=torch.float32)
        gathered = backend.state_dict()
        first_gather_exact = all(torch.equal(gathered[key], original[key]) for key in original)
        # Load other weights, gather them back, then restore the original ones.
        noise = torch.Generator().manual_seed(7)
        perturbed = {key: t + 0.01 * torch.randn(t.shape, generator=noise) for key, t in original.items()}
        backend.load_state_dict(perturbed)
        regathered = backend.state_dict()
        round_trip_exact = all(torch.equal(regathered[key], perturbed[key]) for key in perturbed)
        backend.load_state_dict(original)
        stats = backend.policy_step(case["samples"], current_version=0)
        after = backend.state_dict()
        saved = backend.save_checkpoint(Path(case["save_root"]), iteration=3) if case.get("save_root") else None
        results[name] = dict(logits=logits, first_gather_exact=first_gather_exact, round_trip_exact=round_trip_exact,
                             stats=stats, after=after, saved=saved, seconds=time.perf_counter() - started, **extra)
    if rank == 0:
        torch.save(results, out_path)
    dist.barrier()
    dist.destroy_process_group()


def _router_outputs(backend) -> tuple[list, list]:
    """Hooks on every router: (the list each forward's routing maps [tokens, experts] land in,
    the hook handles)."""
    maps: list = []
    handles = [block.mlp.router.register_forward_hook(lambda _m, _i, out: maps.append(out[1]))
               for block in backend.net.model.decoder.layers]
    return maps, handles


def _replayed_forward(backend, inputs, rows) -> dict:
    """Logits replaying ``rows`` and the experts the routers chose (module docstring)."""
    import torch
    import torch.distributed as dist

    net = backend.net
    maps, handles = _router_outputs(backend)
    with torch.no_grad():
        logits = net.logits(inputs, rows)
    for handle in handles:
        handle.remove()
    batch, length = inputs.shape
    top_k = net.routing_shape[1]
    chosen = []
    for routing_map in maps:
        if net.sequence_parallel:  # each TP rank routed its contiguous 1/TP of the positions
            routing_map = routing_map.to(torch.uint8)  # gloo gathers no bools
            shards = [torch.empty_like(routing_map) for _ in range(net.tp)]
            dist.all_gather(shards, routing_map.contiguous(), group=net.group)
            routing_map = torch.cat(shards)
        per_token = routing_map.view(-1, batch, routing_map.shape[-1]).transpose(0, 1)[:, :length]
        chosen.append(per_token.float().topk(top_k, dim=-1).indices.sort(-1).values)
    return dict(replay_logits=logits, chosen=torch.stack(chosen, dim=2))


def _replayed_grads(backend, samples) -> dict:
    """The gradients of the samples' summed target logprobs, whole and HF-named, replaying
    their routes, and the router calls during the backward (module docstring)."""
    from rollmesh.training.grpo import PolicyBatch
    from rollmesh.training.losses import token_logprobs

    net = backend.net
    batch = PolicyBatch.collate(samples, pad_id=backend.pad_id)
    logits = net.logits(batch.inputs, backend.replay_rows(samples))
    loss = (token_logprobs(logits, batch.targets) * batch.mask).sum()
    backend.optimizer.zero_grad(set_to_none=True)
    net.prepare_backward()
    maps, handles = _router_outputs(backend)
    loss.backward()
    for handle in handles:
        handle.remove()
    backend._finalize_gradients()
    # Gather the gradients as if they were the weights: swap them in, gather, swap back.
    params = list(net.params.values())
    weights = [p.data for p in params]
    for p in params:
        p.data = p.grad
    grads = backend.state_dict()
    for p, weight in zip(params, weights):
        p.data = weight
    backend.optimizer.zero_grad(set_to_none=True)
    return dict(grads=grads, backward_router_calls=len(maps))


if __name__ == "__main__":
    import argparse

    import torch.multiprocessing as mp

    parser = argparse.ArgumentParser()
    parser.add_argument("job")
    parser.add_argument("out")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--ep", type=int, default=1, help="expert-parallel degree (MoE cases only)")
    options = parser.parse_args()
    world = options.tp * options.ep
    mp.spawn(_rank, args=(world, options.ep, options.job, options.out), nprocs=world)
