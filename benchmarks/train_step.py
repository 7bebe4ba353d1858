"""Policy-step throughput: the torch backend against the megatron-core backend, same model and batch.

The ~22M-parameter Llama of the engine benchmarks (6 layers, hidden 384, 6 query / 2 KV heads,
32k vocabulary, tied), as a Hugging Face directory both backends load. One fixed batch of 16
samples x 128 tokens (the last 96 trained), one PPO epoch per step. The torch backend runs in
this process on 2 threads; the megatron backend runs tensor-parallel on 2 gloo processes of one
thread each (the machine's 2 cores either way), started and warmed before the clock. Tokens/s
counts every token the step's forward and backward process. ``ratio`` = megatron / torch.

    python benchmarks/train_step.py [--steps 5]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from common import build_hf_llama, print_result, setup_threads
from rollmesh.config import ModelConfig, TrainerConfig
from rollmesh.training.grpo import PolicySample

SAMPLES, LENGTH, TRAINED = 16, 128, 96
TRAINER = dict(lr=1e-5, ppo_epochs=1, group_size=2, groups_per_step=8)


def batch(vocab: int) -> list[PolicySample]:
    rng = torch.Generator().manual_seed(0)
    samples = []
    for index in range(SAMPLES):
        tokens = torch.randint(0, vocab, (LENGTH,), generator=rng).tolist()
        mask = [0] * (LENGTH - TRAINED) + [1] * TRAINED
        samples.append(PolicySample(tokens, mask, [-10.0] * LENGTH, 1.0 if index % 2 else -1.0))
    return samples


def timed_steps(backend, samples: list[PolicySample], steps: int, sync=lambda: None) -> list[float]:
    backend.policy_step(samples)  # warm-up: allocations, first-call paths
    seconds = []
    for _ in range(steps):
        sync()
        start = time.perf_counter()
        backend.policy_step(samples)
        sync()
        seconds.append(time.perf_counter() - start)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    setup_threads()
    _, directory = build_hf_llama()
    vocab = json.loads((directory / "config.json").read_text())["vocab_size"]
    samples = batch(vocab)
    from rollmesh.training.torch_backend import TorchTrainerBackend

    torch_backend = TorchTrainerBackend(ModelConfig(family="hf", hf_path=str(directory)), TrainerConfig(**TRAINER))
    torch_seconds = timed_steps(torch_backend, samples, args.steps)
    megatron_seconds = _megatron_steps(directory, samples, args.steps)
    tokens = SAMPLES * (LENGTH - 1)
    ours, baseline = tokens / statistics.median(megatron_seconds), tokens / statistics.median(torch_seconds)
    print(f"torch: {[round(s, 3) for s in torch_seconds]} s/step; megatron TP=2: "
          f"{[round(s, 3) for s in megatron_seconds]} s/step", flush=True)
    print_result("train_step", ours, baseline, "tokens/s (megatron-core TP=2 vs torch backend)", ours / baseline,
                 torch_step_s=round(statistics.median(torch_seconds), 3),
                 megatron_step_s=round(statistics.median(megatron_seconds), 3),
                 tokens_per_step=tokens, samples=SAMPLES, length=LENGTH, tensor_parallel=2)


def _megatron_steps(directory: Path, samples: list[PolicySample], steps: int) -> list[float]:
    with tempfile.TemporaryDirectory() as scratch:
        job, out = Path(scratch) / "job.pt", Path(scratch) / "out.json"
        torch.save({"hf_path": str(directory), "samples": samples, "steps": steps}, job)
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        repo = Path(__file__).resolve().parent.parent
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(repo), str(repo / "benchmarks")]),
               "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
        subprocess.run([sys.executable, __file__, "--ranks", str(job), str(out)], env=env, check=True)
        return json.loads(out.read_text())["seconds"]


def _rank(rank: int, world: int, job_path: str, out_path: str) -> None:
    import torch.distributed as dist

    from rollmesh.training.megatron_cpu_shims import install_cpu_shims

    os.environ.update(MASTER_ADDR="127.0.0.1", RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    install_cpu_shims()
    torch.set_num_threads(1)
    from megatron.core import parallel_state

    from rollmesh.training.megatron_backend import MegatronTrainerBackend

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    job = torch.load(job_path, weights_only=False)
    backend = MegatronTrainerBackend(ModelConfig(family="hf", hf_path=job["hf_path"]), TrainerConfig(**TRAINER))
    seconds = timed_steps(backend, job["samples"], job["steps"], sync=dist.barrier)
    if rank == 0:
        Path(out_path).write_text(json.dumps({"seconds": seconds}))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--ranks":
        import torch.multiprocessing as mp

        mp.spawn(_rank, args=(2, sys.argv[2], sys.argv[3]), nprocs=2)
    else:
        main()
