"""Weight update while decoding: total update time vs the generation pause inside it.

A LocalEngine decodes 16 concurrent requests with the ~22M Llama while a new version is published
as a rollmesh weights file (safetensors + sha256). The update reads and verifies the file and
stages a checked copy on a worker thread (decoding continues), then swaps it in at the next step
boundary. ``total_ms``: from the start of the update until the new version is active.
``pause_ms``: how long the swap held the model, i.e. how long generation stopped. ``ratio`` =
total / pause (the issue's target: at least 10). Also: update bytes/s against a plain in-memory
copy of the same state dict (the file holds every state-dict entry, tied ones twice), and that
no request was aborted (every one finishes with all the
tokens it asked for, versions changing mid-sequence).

    python benchmarks/weight_swap.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import torch

from common import NoEos, build_hf_llama, concurrent_workload, print_result, setup_threads, timed
from rollmesh.config import InferenceConfig, ModelConfig
from rollmesh.engine.local_engine import LocalEngine
from rollmesh.engine.models import load_hf_model
from rollmesh.engine.weights import load_weights, save_weights
from rollmesh.messages.base import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    setup_threads()
    _, directory = build_hf_llama()
    model = load_hf_model(directory)
    weights_dir = Path(tempfile.mkdtemp(prefix="rollmesh-bench-weights-"))
    files = []
    for version in range(1, args.repeats + 1):
        state = {k: v + 0.001 * version for k, v in model.state_dict().items()}
        path = weights_dir / f"v{version}.safetensors"
        sha256, _ = save_weights(state, path)
        files.append((path, sha256))
    nbytes = sum(t.nbytes for t in model.state_dict().values())
    workload = [(ids[:64], 200) for ids, _ in concurrent_workload(16)]

    async def one_update(engine: LocalEngine, version: int, path: str, sha256: str) -> tuple[float, float]:
        requests = [asyncio.create_task(engine.generate(ids, SamplingParams(temperature=0.0, max_new_tokens=n),
                                                        request_id=f"v{version}-{i}"))
                    for i, (ids, n) in enumerate(workload)]
        await asyncio.sleep(0.5)  # let decoding get going
        start = time.perf_counter()
        await asyncio.to_thread(lambda: engine.stage_weights(load_weights(path, sha256), version))
        await engine.wait_weights_activated(version)
        total = time.perf_counter() - start
        pause = engine.decode_engine.weights.last_swap_seconds
        results = await asyncio.gather(*requests)
        assert all(len(r.token_ids) == n for r, (_, n) in zip(results, workload)), "a request lost tokens"
        assert any(len(set(r.versions)) == 2 for r in results), "no request spanned the swap"
        return total, pause

    async def measure():
        totals, pauses, copies = [], [], []
        async with LocalEngine(ModelConfig(), InferenceConfig(max_batch=32), model=model,
                               tokenizer=NoEos()) as engine:
            for version, (path, sha256) in enumerate(files, start=1):
                total, pause = await one_update(engine, version, str(path), sha256)
                state = model.state_dict()
                copy_seconds, _ = timed(lambda: {k: v.clone() for k, v in state.items()})
                totals.append(total)
                pauses.append(pause)
                copies.append(copy_seconds)
                print(f"v{version}: total {total * 1e3:.1f} ms, pause {pause * 1e3:.3f} ms, "
                      f"memory copy {copy_seconds * 1e3:.1f} ms", flush=True)
        return totals, pauses, copies

    totals, pauses, copies = asyncio.run(measure())
    total, pause, copy = statistics.median(totals), statistics.median(pauses), statistics.median(copies)
    # ours: the generation pause; baseline: the whole update it sits in; ratio: total / pause.
    print_result(
        "weight_swap", pause * 1e3, total * 1e3, "ms (pause vs total update)", total / pause,
        total_ms=round(total * 1e3, 2), pause_ms=round(pause * 1e3, 3),
        bytes=nbytes, bytes_per_s=round(nbytes / total), memcpy_bytes_per_s=round(nbytes / copy),
        vs_memcpy=round(copy / total, 3), in_flight_requests=len(workload), aborted=0,
    )


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
