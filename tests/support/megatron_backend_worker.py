"""Runs ``MegatronTrainerBackend`` on ranks under gloo, for its tests; and compares an AdamW step
with the torch backend's (``record_step_grads``, ``adam_step_diffs``).

Run as a script (``python tests/support/megatron_backend_worker.py JOB.pt OUT.pt --world 2``): spawns
``world`` processes, and for every case in ``JOB.pt`` ({name: {"hf_path", "trainer", "samples",
"layout"}}, ``layout`` {"tp", "pp", "ep"}: DP = world / (TP x PP); optionally "probe",
"save_root", "sft", "recompute", "replay_probe" and "grads") sets up that layout, builds the
backend from the HF directory (``trainer`` holds the ``MegatronConfig``: which optimizer),
records its logits on ``probe`` (every DP rank runs the whole probe), checks the HF state-dict
round trip (load, gather) bit for bit, runs one ``policy_step`` on ``samples``, gathers the
weights after it, given ``sft`` sequences runs one ``sft_step`` on them (its loss, the weights
after it) and, given a ``save_root``, saves a checkpoint there. It also reports every rank's stage and
optimizer (``layouts``), the schedule megatron ran, and how far apart the copies of one tensor
on different ranks are (DP replicas, a tied model's first- and last-stage embedding). MoE cases
may also ask for:
- ``replay_probe`` (inputs, rows per sample): the logits of a forward replaying those rows and
  the experts its routers actually chose, seen by hooks on the routers ("chosen" [B, T, layers,
  k], each row sorted);
- ``grads``: before the step, the gradients of the samples' summed target logprobs (replaying
  their routes when they carry them), each DP rank its share, reduced by megatron's DDP and
  gathered into whole HF-named tensors, and how many times the routers of all stages ran during
  that backward (activation recompute runs them again, once per layer and microbatch) with the
  number of microbatches. Needs the plain (all-reduced) optimizer.
Rank 0 writes {name: results} to ``OUT.pt``; the tests compare them with the torch backend and
transformers in their own process. ``run_worker`` starts the script in a child process, so the
test process never initialises torch.distributed or megatron's global state; one run serves
every case of one world size.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run_worker(job: Path, out: Path, *, world: int, timeout_s: float = 240.0) -> dict:
    import torch

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")]), "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, __file__, str(job), str(out), "--world", str(world)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"the megatron backend worker failed:\n{done.stderr[-8000:]}")
    return torch.load(out, weights_only=False)


def record_step_grads(backend, optimizer=None) -> list[dict]:
    """A list that every later step of a ``TorchTrainerBackend``'s AdamW (``optimizer``, else its
    RL one) appends its (clipped) gradients to, HF-named (a tied model's ``lm_head.weight``: the
    embedding's)."""
    steps: list[dict] = []
    optimizer = optimizer or backend.optimizer
    adamw_step = optimizer.step

    def recorded(*args, **kwargs):
        grads = {key: p.grad.clone() for key, p in backend.model.named_parameters()}
        grads.setdefault("lm_head.weight", grads["model.embed_tokens.weight"])
        steps.append(grads)
        return adamw_step(*args, **kwargs)

    optimizer.step = recorded
    return steps


def adam_step_diffs(after: dict, reference: dict, step_grads: list[dict]) -> tuple[float, float, float]:
    """(max |weight diff| where the gradient was settled, max |weight diff| anywhere, the
    fraction of unsettled elements) between two backends' weights after AdamW steps, given the
    reference's gradients at each step (``record_step_grads``).

    Adam's first step is lr x g / (|g| + eps) plus the decay: where |g| nears eps (1e-8), float
    reduction-order noise in g (sums split over other microbatches and ranks) moves the step by
    up to 2 lr (measured: 8.9e-5 at |g| = 5e-10, 6.6e-6 below 1e-7, 1.1e-6 below 1e-6). So an
    element is settled where |g| >= 1e-6 or g = 0 (an unused embedding row) at every step."""
    import torch

    settled = {k: torch.stack([(g[k].abs() >= 1e-6) | (g[k] == 0) for g in step_grads]).all(0) for k in reference}
    diffs = {k: (after[k] - reference[k]).abs() for k in reference}
    settled_diff = max(diffs[k][settled[k]].max().item() for k in reference)
    noisy_diff = max(diffs[k].max().item() for k in reference)
    unsettled = sum(int((~mask).sum()) for mask in settled.values()) / sum(mask.numel() for mask in settled.values())
    return settled_diff, noisy_diff, unsettled


def _rank(rank: int, world: int, job_path: str, out_path: str) -> None:
    import torch
    import torch.distributed as dist

    from rollmesh.training.megatron_cpu_shims import install_cpu_shims

    os.environ.update(MASTER_ADDR="127.0.0.1", RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    install_cpu_shims()
    torch.set_num_threads(1)
    job = torch.load(job_path, weights_only=False)
    results = {name: _run_case(case) for name, case in job.items()}
    if rank == 0:
        torch.save(results, out_path)
    dist.barrier()
    dist.destroy_process_group()


def _run_case(case: dict) -> dict:
    import torch
    from megatron.core import parallel_state

    from rollmesh.config import ModelConfig, TrainerConfig
    from rollmesh.engine.models import read_safetensors
    from rollmesh.training.megatron_backend import MegatronTrainerBackend

    started = time.perf_counter()
    layout = case["layout"]
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=layout["tp"],
                                             pipeline_model_parallel_size=layout.get("pp", 1),
                                             expert_model_parallel_size=layout.get("ep", 1))
    backend = MegatronTrainerBackend(ModelConfig(path=case["hf_path"]),
                                     TrainerConfig(**case["trainer"]), recompute=case.get("recompute", False))
    extra = {}
    if "probe" in case:
        extra["logits"] = _forward(backend, case["probe"])[0]
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
    if "sft" in case:  # then one supervised step on (tokens, loss mask) pairs
        extra["sft_loss"] = backend.sft_step(case["sft"], lr=backend.config.lr)
        extra["after_sft"] = backend.state_dict()
    saved = backend.save_checkpoint(Path(case["save_root"]), iteration=3) if case.get("save_root") else None
    return dict(first_gather_exact=first_gather_exact, round_trip_exact=round_trip_exact, stats=stats, after=after,
                saved=saved, copies_max_diff=_copies_max_diff(backend), layouts=_layouts(backend),
                schedule=_schedule_name(), seconds=time.perf_counter() - started, **extra)


def _schedule_name() -> str:
    from megatron.core.pipeline_parallel import get_forward_backward_func

    return get_forward_backward_func().__name__


def _everyone(value):
    """Every rank's ``value``, in global rank order."""
    import torch.distributed as dist

    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def _forward(backend, inputs, rows=None):
    """(full-vocabulary logits [B, T, V] of a forward-only pass of ``inputs`` on every DP rank,
    replaying ``rows`` when given, from the last stage; every rank's router outputs)."""
    import torch

    from rollmesh.training.megatron_pipeline import Microbatch

    net = backend.net
    length = inputs.shape[1]
    padded = torch.nn.functional.pad(inputs, (0, net.padded_length(length) - length))
    routes = None if rows is None else net.replay_targets(rows, padded.shape[1])
    seen = []

    def record(logits, microbatch):
        seen.append(logits[:, :length].detach().clone())
        return torch.zeros(()), 0, {}

    maps, handles = _router_outputs(backend)
    backend._pass([Microbatch(padded, None, routes)], record, forward_only=True)
    for handle in handles:
        handle.remove()
    found = [logits for logits in _everyone(seen[0] if seen else None) if logits is not None]
    return found[0], maps


def _router_outputs(backend) -> tuple[list, list]:
    """Hooks on every router of this stage: (the list each forward's routing maps [tokens,
    experts] land in, the hook handles)."""
    maps: list = []
    handles = [block.mlp.router.register_forward_hook(lambda _m, _i, out: maps.append(out[1]))
               for block in backend.net.model.decoder.layers if hasattr(block.mlp, "router")]
    return maps, handles


def _replayed_forward(backend, inputs, rows) -> dict:
    """Logits replaying ``rows`` and the experts the routers of every stage chose (module
    docstring)."""
    import torch
    import torch.distributed as dist

    net = backend.net
    logits, maps = _forward(backend, inputs, rows)
    batch, length = inputs.shape
    top_k = net.routing_shape[1]
    chosen = {}
    for layer, routing_map in zip((block.layer_number - 1 for block in net.model.decoder.layers), maps, strict=True):
        if net.sequence_parallel:  # each TP rank routed its contiguous 1/TP of the positions
            routing_map = routing_map.to(torch.uint8)  # gloo gathers no bools
            shards = [torch.empty_like(routing_map) for _ in range(net.tp)]
            dist.all_gather(shards, routing_map.contiguous(), group=net.group)
            routing_map = torch.cat(shards)
        per_token = routing_map.view(-1, batch, routing_map.shape[-1]).transpose(0, 1)[:, :length]
        chosen[layer] = per_token.float().topk(top_k, dim=-1).indices.sort(-1).values
    every_stage = {layer: choice for stage in _everyone(chosen) for layer, choice in stage.items()}
    return dict(replay_logits=logits, chosen=torch.stack([every_stage[k] for k in sorted(every_stage)], dim=2))


def _replayed_grads(backend, samples) -> dict:
    """The gradients of the samples' summed target logprobs, whole and HF-named, replaying
    their routes, and the router calls during the backward (module docstring)."""
    from rollmesh.training.grpo import PolicyBatch
    from rollmesh.training.losses import token_logprobs
    from rollmesh.training.megatron_optimizer import zero_grads

    net = backend.net
    microbatches = backend._microbatches(PolicyBatch.collate(samples, pad_id=backend.pad_id),
                                         backend.replay_rows(samples))

    def loss_fn(logits, microbatch):
        piece = microbatch.extra.batch
        # Count 1 per microbatch: megatron divides by the sum over microbatches and DP ranks.
        return (token_logprobs(logits[:, : piece.targets.shape[1]], piece.targets) * piece.mask).sum(), 1, {}

    zero_grads([backend.model], backend.optimizer)
    maps, handles = _router_outputs(backend)
    backend._pass(microbatches, loss_fn)
    for handle in handles:
        handle.remove()
    # Router calls beyond the forwards' (one per layer and microbatch), over every stage.
    extra_calls = dict(_everyone((net.pp_rank, len(maps) - len(net.model.decoder.layers) * len(microbatches))))
    scale = len(microbatches) * backend.dp
    # Gather the (all-reduced) gradients as if they were the weights: swap them in, gather, swap back.
    params = list(net.params.values())
    weights = [p.data for p in params]
    for p in params:
        p.data = p.main_grad.view_as(p) * scale
    grads = backend.state_dict()
    for p, weight in zip(params, weights):
        p.data = weight
    zero_grads([backend.model], backend.optimizer)
    return dict(grads=grads, backward_router_calls=sum(extra_calls.values()), microbatches=len(microbatches))


def _copies_max_diff(backend) -> float:
    """How far apart the copies of one whole tensor on different ranks are: DP replicas, and a
    tied model's last-stage copy of the embedding (each gathered over its TP group)."""
    net = backend.net
    mine = {}
    for name, param in net.params.items():
        size, group = (net.etp, net.etp_group) if net.is_expert(name) else (net.tp, net.group)
        mine[name] = net._gather(name, param.detach(), size, group)
    first, worst = {}, 0.0
    for tensors in _everyone(mine):
        for name, tensor in tensors.items():
            if name in first:
                worst = max(worst, (first[name] - tensor).abs().max().item())
            else:
                first[name] = tensor
    return worst


def _layouts(backend) -> list[dict]:
    """Every rank's stage (first/last, global layer numbers, parameter count) and optimizer."""
    import torch.distributed as dist

    from rollmesh.training.megatron_optimizer import describe

    gpt = backend.net.model
    return _everyone(dict(rank=dist.get_rank(), pre_process=gpt.pre_process, post_process=gpt.post_process,
                          layers=[layer.layer_number for layer in gpt.decoder.layers],
                          parameters=sum(p.numel() for p in gpt.parameters()), **describe(backend.optimizer)))


if __name__ == "__main__":
    import argparse

    import torch.multiprocessing as mp

    parser = argparse.ArgumentParser()
    parser.add_argument("job")
    parser.add_argument("out")
    parser.add_argument("--world", type=int, default=2)
    options = parser.parse_args()
    mp.spawn(_rank, args=(options.world, options.job, options.out), nprocs=options.world)
