"""Second-turn time to first token, with and without session KV reuse.

A multi-turn agent's second prompt is its first prompt, the tokens it generated and a tool's
output. With a ``session_id`` the engine keeps the first turn's KV parked while the "tool runs"
and the second turn computes only the new tokens; without one it prefills the whole history.
Same ~22M Llama, the same prompts, turns alternated; median of ``--repeats``. ``ratio`` = TTFT
without reuse / TTFT with reuse.

    python benchmarks/prefix_reuse.py [--repeats 5] [--history 700] [--tool-output 48]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time

from common import NoEos, build_hf_llama, print_result, random_prompt, setup_threads
from rollmesh.config import InferenceConfig, ModelConfig
from rollmesh.engine.local_engine import LocalEngine
from rollmesh.engine.models import load_hf_model
from rollmesh.engine.protocols import GenerateOptions
from rollmesh.messages.base import SamplingParams

FIRST_TURN_TOKENS = 32


async def second_turn_ttft(engine: LocalEngine, first_prompt, tool_output, tag: str, reuse: bool) -> tuple[float, int]:
    options = GenerateOptions(session_id=tag) if reuse else GenerateOptions()
    first = await engine.generate(first_prompt, SamplingParams(temperature=0.0, max_new_tokens=FIRST_TURN_TOKENS),
                                  request_id=f"{tag}-1", options=options)
    second_prompt = first_prompt + first.token_ids + tool_output
    start = time.perf_counter()
    second = await engine.generate(second_prompt, SamplingParams(temperature=0.0, max_new_tokens=1),
                                   request_id=f"{tag}-2", options=options)
    return time.perf_counter() - start, second.cached_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--history", type=int, default=700)
    parser.add_argument("--tool-output", type=int, default=48)
    args = parser.parse_args()
    setup_threads()
    _, directory = build_hf_llama()
    model = load_hf_model(directory)
    rng = random.Random(11)

    async def measure():
        with_reuse, without = [], []
        cached = 0
        async with LocalEngine(ModelConfig(), InferenceConfig(max_batch=8), model=model,
                               tokenizer=NoEos()) as engine:
            await second_turn_ttft(engine, random_prompt(rng, 32), random_prompt(rng, 8), "warm", True)
            for repeat in range(args.repeats):
                first_prompt = random_prompt(rng, args.history)
                tool_output = random_prompt(rng, args.tool_output)
                seconds, cached = await second_turn_ttft(engine, first_prompt, tool_output, f"s{repeat}", True)
                with_reuse.append(seconds)
                seconds, _ = await second_turn_ttft(engine, first_prompt, tool_output, f"n{repeat}", False)
                without.append(seconds)
                print(f"repeat {repeat}: reuse {with_reuse[-1] * 1e3:.1f} ms ({cached} cached tokens), "
                      f"full prefill {without[-1] * 1e3:.1f} ms", flush=True)
        return statistics.median(with_reuse), statistics.median(without), cached

    ours, baseline, cached = asyncio.run(measure())
    print_result("prefix_reuse", ours * 1e3, baseline * 1e3, "second-turn TTFT ms (lower is better)",
                 baseline / ours, cached_tokens=cached,
                 second_turn_prompt_tokens=args.history + FIRST_TURN_TOKENS + args.tool_output)


if __name__ == "__main__":
    main()
