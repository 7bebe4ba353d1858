"""Decode throughput: rollmesh's paged continuous-batching engine vs transformers ``generate``.

Same ~22M Llama weights, greedy, KV cache on both sides, end-of-sequence disabled. Three figures:
- ``single_ratio``: one request (64-token prompt, 128 new tokens), tokens/s ours / generate's;
- ``ratio``: 32 concurrent requests, prompt and output lengths uniform in [16, 256] (fixed seed);
  our aggregate generated tokens/s against ``generate`` serving them one at a time;
- ``vs_static_batch``: the same 32 against one left-padded static batch of ``generate`` run to
  the longest requested output, counting only the tokens each request asked for.
Runs alternate ours / baseline and keep each side's best of ``--repeats``.

    python benchmarks/decode_throughput.py [--repeats 2]
"""

from __future__ import annotations

import argparse
import asyncio
import random

import torch

from common import (
    NoEos, build_hf_llama, concurrent_workload, parameter_count, print_result, random_prompt,
    setup_threads, timed,
)
from rollmesh.config import InferenceConfig, ModelConfig
from rollmesh.engine.local_engine import LocalEngine
from rollmesh.engine.models import load_hf_model
from rollmesh.messages.base import SamplingParams

SINGLE_PROMPT, SINGLE_NEW = 64, 128


def greedy(max_new_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens)


async def ours_run(engine: LocalEngine, workload) -> int:
    results = await asyncio.gather(*(
        engine.generate(ids, greedy(n), request_id=f"r{i}") for i, (ids, n) in enumerate(workload)
    ))
    for (_, n), result in zip(workload, results):
        assert len(result.token_ids) == n, (len(result.token_ids), n)
    return sum(len(r.token_ids) for r in results)


@torch.no_grad()
def hf_one_at_a_time(model, workload) -> int:
    total = 0
    for ids, n in workload:
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             use_cache=True, eos_token_id=None, pad_token_id=0)
        total += out.shape[1] - len(ids)
    return total


@torch.no_grad()
def hf_static_batch(model, workload) -> int:
    longest = max(len(ids) for ids, _ in workload)
    input_ids = torch.zeros(len(workload), longest, dtype=torch.long)
    attention = torch.zeros_like(input_ids)
    for row, (ids, _) in enumerate(workload):  # left padding, as decoder-only batching needs
        input_ids[row, longest - len(ids):] = torch.tensor(ids)
        attention[row, longest - len(ids):] = 1
    max_new = max(n for _, n in workload)
    out = model.generate(input_ids, attention_mask=attention, max_new_tokens=max_new,
                         min_new_tokens=max_new, do_sample=False, use_cache=True,
                         eos_token_id=None, pad_token_id=0)
    assert out.shape[1] == longest + max_new
    return sum(n for _, n in workload)  # only what each request asked for


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    threads = setup_threads()
    hf_model, directory = build_hf_llama()
    ours_model = load_hf_model(directory)
    workload = concurrent_workload()
    single = [(random_prompt(random.Random(7), SINGLE_PROMPT), SINGLE_NEW)]
    print(f"model: Llama, {parameter_count(hf_model) / 1e6:.1f}M parameters, {threads} torch threads")
    print(f"32 requests: {sum(len(p) for p, _ in workload)} prompt tokens, "
          f"{sum(n for _, n in workload)} generated tokens")

    async def measure() -> dict[str, float]:
        best = {"ours_single": 0.0, "hf_single": 0.0, "ours_batch": 0.0, "hf_sequential": 0.0,
                "hf_static": 0.0}
        inference = InferenceConfig(max_batch=32, kv_block_size=16)
        async with LocalEngine(ModelConfig(), inference, model=ours_model, tokenizer=NoEos()) as engine:
            await ours_run(engine, [(single[0][0], 8)])  # warm-up
            hf_one_at_a_time(hf_model, [(single[0][0], 8)])
            for repeat in range(args.repeats):
                start = asyncio.get_running_loop().time()
                tokens = await ours_run(engine, single)
                rate = tokens / (asyncio.get_running_loop().time() - start)
                best["ours_single"] = max(best["ours_single"], rate)
                seconds, tokens = timed(lambda: hf_one_at_a_time(hf_model, single))
                best["hf_single"] = max(best["hf_single"], tokens / seconds)
                start = asyncio.get_running_loop().time()
                tokens = await ours_run(engine, workload)
                best["ours_batch"] = max(best["ours_batch"], tokens / (asyncio.get_running_loop().time() - start))
                seconds, tokens = timed(lambda: hf_static_batch(hf_model, workload))
                best["hf_static"] = max(best["hf_static"], tokens / seconds)
                if repeat == 0:  # ~30 s a run: once is enough for a 4x question
                    seconds, tokens = timed(lambda: hf_one_at_a_time(hf_model, workload))
                    best["hf_sequential"] = tokens / seconds
                print({k: round(v, 1) for k, v in best.items()}, flush=True)
        return best

    best = asyncio.run(measure())
    print_result(
        "decode_throughput", best["ours_batch"], best["hf_sequential"], "generated tokens/s",
        best["ours_batch"] / best["hf_sequential"],
        single_ours=round(best["ours_single"], 1), single_baseline=round(best["hf_single"], 1),
        single_ratio=round(best["ours_single"] / best["hf_single"], 3),
        static_batch_baseline=round(best["hf_static"], 1),
        vs_static_batch=round(best["ours_batch"] / best["hf_static"], 3),
        requests=len(workload), threads=threads,
    )


if __name__ == "__main__":
    main()
