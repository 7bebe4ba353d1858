"""Runs megatron-core's pipeline schedules, DDP and distributed optimizer (``megatron_pipeline``,
``megatron_optimizer``) on ranks under gloo, for their tests.

Run as a script (``python tests/megatron_parallel_worker.py JOB.pt OUT.pt --world 2``): spawns
``world`` processes, and for every case in ``JOB.pt`` ({name: {"hf_path", "tp", "pp",
"distributed_optimizer", "samples", "microbatch_size", "trainer"}}) sets up that layout (DP =
world / (TP x PP)), builds this rank's stage from the HF directory, records the logits of a
forward-only pass, runs ``ppo_epochs`` times one forward/backward of the policy loss
(``losses.policy_loss``, its mean turned into megatron's (sum, count) form) and one AdamW step,
and gathers the weights after them. Each DP rank trains a contiguous slice of the samples. Rank 0 writes
{name: results} to ``OUT.pt``; ``run_worker`` starts the script in a child process, so the test
process never initialises torch.distributed or megatron's global state.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def run_worker(job: Path, out: Path, *, world: int, timeout_s: float = 240.0) -> dict:
    import torch

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(REPO), "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, __file__, str(job), str(out), "--world", str(world)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"the megatron parallel worker failed:\n{done.stderr[-8000:]}")
    return torch.load(out, weights_only=False)


def _rows(batch, rows: slice):
    """The ``rows`` of every per-sample tensor of a PolicyBatch."""
    return dataclasses.replace(batch, **{f.name: getattr(batch, f.name)[rows] for f in dataclasses.fields(batch)
                                         if getattr(batch, f.name) is not None})


def _run_case(case: dict) -> dict:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from rollmesh.checkpoint.arch_maps import build_arch_map, megatron_shapes
    from rollmesh.config import TrainerConfig
    from rollmesh.engine.models import read_hf_config, read_safetensors
    from rollmesh.training.grpo import PolicyBatch
    from rollmesh.training.losses import LossSettings, policy_loss, token_logprobs
    from rollmesh.training.megatron_model import megatron_spec
    from rollmesh.training.megatron_optimizer import build_adamw, describe, step, wrap_data_parallel, zero_grads
    from rollmesh.training.megatron_pipeline import (Microbatch, build_stage_model, forward_backward,
                                                     gather_stage_weights, load_stage_weights)

    started = time.perf_counter()
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=case["tp"],
                                             pipeline_model_parallel_size=case["pp"])
    hf_config = read_hf_config(case["hf_path"])
    spec = megatron_spec(hf_config, tp=case["tp"], path=case["hf_path"])
    arch_map = build_arch_map(spec)
    torch.manual_seed(0)
    stage = build_stage_model(hf_config, spec)
    load_stage_weights(stage, spec, arch_map.to_megatron(read_safetensors(case["hf_path"], dtype=torch.float32)))
    model = wrap_data_parallel(stage, distributed_optimizer=case["distributed_optimizer"])
    trainer = TrainerConfig(**case["trainer"])
    optimizer = build_adamw([model], lr=trainer.lr, weight_decay=trainer.weight_decay, clip_grad=trainer.grad_clip,
                            distributed_optimizer=case["distributed_optimizer"])

    eos = hf_config.eos_token_id
    batch = PolicyBatch.collate(case["samples"], pad_id=eos if eos is not None else 0)
    dp, dp_rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    per_rank = batch.inputs.shape[0] // dp
    mine = _rows(batch, slice(dp_rank * per_rank, (dp_rank + 1) * per_rank))
    size = case["microbatch_size"]
    microbatches = [Microbatch(sub.inputs, sub) for sub in
                    (_rows(mine, slice(i, i + size)) for i in range(0, per_rank, size))]
    settings = LossSettings.from_config(trainer)
    seen_logits: list[torch.Tensor] = []

    def loss_fn(logits, microbatch):
        sub = microbatch.extra
        seen_logits.append(logits.detach().clone())
        loss, stats = policy_loss(token_logprobs(logits, sub.targets), sub, settings,
                                  logits=logits if settings.entropy_coef > 0 else None)
        # policy_loss's means are sum / max(count, 1): times count, the sum (0 when count is 0).
        # Its count: trained tokens for the token mean, samples with one for GRPO's sample mean.
        count = stats["trained_tokens"] if settings.loss == "ppo_clip" else stats["samples_trained"]
        return loss * count, int(count), stats

    model.eval()
    with torch.no_grad():
        forward_backward(model, microbatches, loss_fn, vocab_size=spec.vocab_size, forward_only=True)
    logits = torch.cat(seen_logits) if seen_logits else None
    model.train()
    for _ in range(trainer.ppo_epochs):  # stats of the last epoch, as policy_epochs reports
        zero_grads([model], optimizer)
        result = forward_backward(model, microbatches, loss_fn, vocab_size=spec.vocab_size)
        grad_norm = step(optimizer)

    # Weights after the step: each stage's whole tensors (TP-gathered) to global rank 0.
    stage_weights = gather_stage_weights(model, spec, megatron_shapes(spec))
    every_logits = [None] * dist.get_world_size()
    every_stage = [None] * dist.get_world_size()
    dist.all_gather_object(every_logits, (dp_rank, logits if parallel_state.get_tensor_model_parallel_rank() == 0
                                          else None))
    dist.all_gather_object(every_stage, stage_weights)
    gpt = model.module
    layout = dict(rank=dist.get_rank(), pre_process=gpt.pre_process, post_process=gpt.post_process,
                  layers=[layer.layer_number for layer in gpt.decoder.layers],
                  parameters=sum(p.numel() for p in gpt.parameters()), **describe(optimizer))
    layouts = [None] * dist.get_world_size()
    dist.all_gather_object(layouts, layout)
    canonical, tied_copy_diff = {}, 0.0
    for weights in every_stage:
        for name, tensor in weights.items():
            if name in canonical:  # another DP/TP rank's copy, or a tied model's last-stage copy
                tied_copy_diff = max(tied_copy_diff, (canonical[name] - tensor).abs().max().item())
            else:
                canonical[name] = tensor
    after = {}
    for name, tensor in canonical.items():
        after.update(arch_map.to_hf(name, tensor))
    if spec.tie_embeddings:
        after["lm_head.weight"] = after["model.embed_tokens.weight"]
    by_dp = dict(sorted((rank, lg) for rank, lg in every_logits if lg is not None))
    return dict(logits=torch.cat(list(by_dp.values())), loss=result.loss, count=result.count,
                microbatch_stats=result.microbatch_stats, grad_norm=grad_norm, after=after,
                copies_max_diff=tied_copy_diff, layouts=layouts, schedule=get_forward_backward_func().__name__,
                seconds=time.perf_counter() - started)


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


if __name__ == "__main__":
    import argparse

    import torch.multiprocessing as mp

    parser = argparse.ArgumentParser()
    parser.add_argument("job")
    parser.add_argument("out")
    parser.add_argument("--world", type=int, default=2)
    options = parser.parse_args()
    mp.spawn(_rank, args=(options.world, options.job, options.out), nprocs=options.world)
