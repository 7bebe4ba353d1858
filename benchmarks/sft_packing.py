"""SFT tokens per second with sequence packing (ours) against padding each sample to the batch's
longest (baseline), through the same trainer backend (``TorchTrainerBackend.sft_step``).

Data, generated here (fixed seed): chat examples whose lengths are lognormal (median 200 tokens,
sigma 1.0), capped at 2,048 and at least 8; random token ids; an assistant loss mask (the first
third of each example, the system and user turns, masked out; the rest, the assistant's answer,
trained). Steps take examples in order until they hold about 8K real tokens (``--step-tokens``);
both sides train the same examples at every step. Ours packs each step's examples
(``pack_sequences``, first-fit decreasing into rows of ``--max-seq-len``) and runs them with reset
positions and a block-diagonal causal mask; the baseline runs one row per example, right-padded to
the step's longest, plain causal. Each side has its own backend from the same weights (its own
optimizer), the sides alternate step by step, and the first ``--warmup`` steps of each are not
timed. Tokens per second = real (non-padding) tokens / wall seconds of the timed steps.

Model: a transformers ``LlamaForCausalLM`` config with random weights built here (4 layers, hidden
256, 4 heads, vocabulary 4,096, context 4,096), loaded by rollmesh's loader as the trainer loads
any model; fp32, 2 torch threads.

    python benchmarks/sft_packing.py [--steps 4] [--warmup 1] [--max-seq-len 2048] [--step-tokens 8192]
"""

from __future__ import annotations

import argparse
import math
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from common import print_result, setup_threads
from rollmesh.config import ModelConfig, TrainerConfig
from rollmesh.training.packing import PackedRow, pack_sequences
from rollmesh.training.torch_backend import TorchTrainerBackend

MODEL = dict(vocab_size=4096, hidden_size=256, intermediate_size=688, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=4096,
             tie_word_embeddings=True, eos_token_id=2)
MEDIAN, SIGMA, CAP, FLOOR = 200, 1.0, 2048, 8
SEED = 1234


def build_model(directory: Path) -> Path:
    import transformers

    torch.manual_seed(SEED)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**MODEL)).save_pretrained(directory)
    return directory


def chat_examples(count: int, rng: np.random.Generator) -> list[tuple[list[int], list[int]]]:
    """(ids, assistant loss mask) pairs, lengths as the module docstring says."""
    lengths = np.clip(np.round(rng.lognormal(math.log(MEDIAN), SIGMA, count)), FLOOR, CAP).astype(int)
    out = []
    for length in lengths:
        prompt = length // 3
        out.append((rng.integers(3, MODEL["vocab_size"], length).tolist(), [0] * prompt + [1] * (length - prompt)))
    return out


def steps_of(examples, step_tokens: int, steps: int) -> list[list[tuple[list[int], list[int]]]]:
    """Consecutive examples, each step until it holds ``step_tokens`` real tokens or more."""
    out, current, held = [], [], 0
    for example in examples:
        current.append(example)
        held += len(example[0])
        if held >= step_tokens:
            out.append(current)
            current, held = [], 0
            if len(out) == steps:
                return out
    raise ValueError("not enough examples for the steps asked")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4, help="timed steps per side")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--max-seq-len", type=int, default=2048)
    parser.add_argument("--step-tokens", type=int, default=8192)
    args = parser.parse_args()
    threads = setup_threads()
    rng = np.random.default_rng(SEED)
    directory = build_model(Path(tempfile.mkdtemp(prefix="rollmesh-sft-packing-")))
    trainer = TrainerConfig(lr=1e-4, seed=SEED, torch_threads=threads)
    ours = TorchTrainerBackend(ModelConfig(path=str(directory)), trainer)
    baseline = TorchTrainerBackend(ModelConfig(path=str(directory)), trainer)
    steps = steps_of(chat_examples(4000, rng), args.step_tokens, args.warmup + args.steps)

    totals = {"ours": [0, 0.0, 0], "baseline": [0, 0.0, 0]}  # real tokens, seconds, computed positions
    for index, batch in enumerate(steps):
        timed = index >= args.warmup
        for side, backend in (("ours", ours), ("baseline", baseline)):
            start = time.perf_counter()
            if side == "ours":
                rows = pack_sequences(batch, args.max_seq_len)
            else:
                rows = [PackedRow.single(ids, mask) for ids, mask in batch]
            stats = backend.sft_step(rows, lr=trainer.lr)
            seconds = time.perf_counter() - start
            computed = len(rows) * max(len(row.ids) for row in rows)
            print(f"step {index}{'' if timed else ' (warm-up)'} {side}: {len(batch)} examples, "
                  f"{int(stats['tokens'])} real tokens in {len(rows)} rows x {max(len(r.ids) for r in rows)} "
                  f"({computed} positions), loss {stats['loss']:.4f}, {seconds:.2f} s, "
                  f"{stats['tokens'] / seconds:.0f} tok/s", flush=True)
            if timed:
                totals[side][0] += int(stats["tokens"])
                totals[side][1] += seconds
                totals[side][2] += computed

    rate = {side: tokens / seconds for side, (tokens, seconds, _) in totals.items()}
    padding = {side: 1 - tokens / computed for side, (tokens, _, computed) in totals.items()}
    print_result("sft_packing", rate["ours"], rate["baseline"], "real tokens/s", rate["ours"] / rate["baseline"],
                 steps=args.steps, warmup=args.warmup, max_seq_len=args.max_seq_len,
                 real_tokens_per_step=round(totals["ours"][0] / args.steps),
                 padding_fraction_ours=round(padding["ours"], 3),
                 padding_fraction_baseline=round(padding["baseline"], 3),
                 seconds_ours=round(totals["ours"][1], 2), seconds_baseline=round(totals["baseline"][1], 2),
                 threads=threads, model="llama 2x256, vocab 4096, fp32")


if __name__ == "__main__":
    main()
