"""What every engine benchmark shares: one ~22M-parameter Llama built locally, the same prompts,
and the JSON last line.

The model is a transformers ``LlamaForCausalLM`` with random weights (nothing is downloaded),
saved as sharded safetensors and loaded by rollmesh's own loader, so both sides run the same
weights. Random weights make greedy outputs arbitrary but deterministic, which is all a speed
comparison needs; end-of-sequence is disabled on both sides so every request produces exactly the
number of tokens it asked for.
"""

from __future__ import annotations

import json
import os
import random
import tempfile
import time
from pathlib import Path


MODEL_CONFIG = dict(
    vocab_size=32000, hidden_size=384, intermediate_size=1024, num_hidden_layers=6,
    num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=1024,
    tie_word_embeddings=True,
)
SEED = 1234


def setup_threads() -> int:
    import torch  # here, not at the top: the sandbox benchmarks need no torch

    threads = int(os.environ.get("ROLLMESH_BENCH_THREADS", "2"))
    torch.set_num_threads(threads)
    return threads


def build_hf_llama(directory: Path | None = None):
    """(the transformers model, the safetensors directory it was saved to)."""
    import torch
    import transformers

    torch.manual_seed(SEED)
    config = transformers.LlamaConfig(**MODEL_CONFIG)
    model = transformers.LlamaForCausalLM(config).eval()
    directory = Path(directory or tempfile.mkdtemp(prefix="rollmesh-bench-"))
    model.save_pretrained(directory, max_shard_size="40MB")
    return model, directory


def parameter_count(model) -> int:
    return sum(p.numel() for p in model.parameters())


def random_prompt(rng: random.Random, length: int) -> list[int]:
    # Ids from 3 up: 0-2 are Llama's special ids.
    return [rng.randrange(3, MODEL_CONFIG["vocab_size"]) for _ in range(length)]


def concurrent_workload(count: int = 32, low: int = 16, high: int = 256) -> list[tuple[list[int], int]]:
    """``count`` (prompt, output length) pairs, both lengths uniform in [low, high], fixed seed."""
    rng = random.Random(SEED)
    return [(random_prompt(rng, rng.randint(low, high)), rng.randint(low, high)) for _ in range(count)]


class NoEos:
    """The engine's ``Detokenizer`` for the random Llama: no end-of-turn id, so generation runs to
    max_new_tokens; every id of the vocabulary may be sampled; no text (no stop strings)."""

    end_of_turn_ids: frozenset[int] = frozenset()
    vocab_size = MODEL_CONFIG["vocab_size"]

    def decode(self, ids) -> str:
        return ""


def percentile(samples: list[float], q: float) -> float:
    """The ``q`` quantile (0 to 1) of ``samples``, nearest rank."""
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def atimed_ms(call) -> tuple[float, object]:
    """(milliseconds, value) of awaiting ``call``."""
    start = time.perf_counter()
    value = await call
    return (time.perf_counter() - start) * 1000, value


def timed(fn):
    start = time.perf_counter()
    value = fn()
    return time.perf_counter() - start, value


def print_result(benchmark: str, ours: float, baseline: float, unit: str, ratio: float, **extra) -> None:
    print(json.dumps({"benchmark": benchmark, "ours": round(ours, 3), "baseline": round(baseline, 3),
                      "unit": unit, "ratio": round(ratio, 3), **extra}))
