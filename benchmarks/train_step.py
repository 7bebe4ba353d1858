"""Policy-step throughput: the torch backend against the megatron-core backend, same model and batch.

The ~22M-parameter Llama of the engine benchmarks (6 layers, hidden 384, 6 query / 2 KV heads,
32k vocabulary, tied), as a Hugging Face directory both backends load. One fixed batch of 16
samples x 128 tokens (the last 96 trained), one PPO epoch per step. The torch backend runs in
this process on 2 threads; the megatron backend runs tensor-parallel on 2 gloo processes of one
thread each (the machine's 2 cores either way), as the trainer runs it (``MegatronRanks``),
started and warmed before the clock; PP=2 and DP=2 with the distributed optimizer are reported
too. Tokens/s counts every token the step's forward and backward process. ``ratio`` =
megatron TP=2 / torch.

    python benchmarks/train_step.py [--steps 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from common import build_hf_llama, print_result, setup_threads
from rollmesh.config import ModelConfig, TrainerConfig
from rollmesh.training.grpo import PolicySample

SAMPLES, LENGTH, TRAINED = 16, 128, 96
TRAINER = dict(lr=1e-5, ppo_epochs=1, n_samples_per_prompt=2, groups_per_step=8)


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

    # The machine's 2 cores: 2 threads here, 1 thread in each of the megatron backend's 2 ranks.
    torch_backend = TorchTrainerBackend(ModelConfig(path=str(directory)),
                                        TrainerConfig(**TRAINER, torch_threads=2))
    torch_seconds = timed_steps(torch_backend, samples, args.steps)
    layouts = {"TP=2": dict(tensor_parallel=2), "PP=2": dict(pipeline_parallel=2),
               "DP=2 distributed optimizer": dict(data_parallel=2, distributed_optimizer=True)}
    megatron_seconds = {name: _megatron_steps(directory, samples, args.steps, **layout)
                        for name, layout in layouts.items()}
    tokens = SAMPLES * (LENGTH - 1)
    per_layout = {name: round(tokens / statistics.median(seconds), 1) for name, seconds in megatron_seconds.items()}
    ours, baseline = per_layout["TP=2"], tokens / statistics.median(torch_seconds)
    print(f"torch: {[round(s, 3) for s in torch_seconds]} s/step", flush=True)
    for name, seconds in megatron_seconds.items():
        print(f"megatron {name}: {[round(s, 3) for s in seconds]} s/step, {per_layout[name]} tokens/s", flush=True)
    print_result("train_step", ours, baseline, "tokens/s (megatron-core TP=2 vs torch backend)", ours / baseline,
                 torch_step_s=round(statistics.median(torch_seconds), 3),
                 megatron_step_s=round(statistics.median(megatron_seconds["TP=2"]), 3),
                 megatron_tokens_per_s=per_layout, tokens_per_step=tokens, samples=SAMPLES, length=LENGTH)


def _megatron_steps(directory: Path, samples: list[PolicySample], steps: int, **layout: int) -> list[float]:
    """Seconds per step of the megatron backend as the trainer runs it: its rank processes
    (``MegatronRanks``, one thread each), started and warmed before the clock."""
    from rollmesh.config import MegatronConfig
    from rollmesh.training.megatron_ranks import MegatronRanks

    config = TrainerConfig(**TRAINER, backend="megatron", megatron=MegatronConfig(**layout))
    ranks = MegatronRanks(ModelConfig(path=str(directory)), config)
    try:
        return timed_steps(ranks, samples, steps)
    finally:
        ranks.close()


if __name__ == "__main__":
    main()
