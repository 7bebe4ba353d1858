"""Weight publication, trainer to decoding engine, by phase, against a memory copy of the same bytes.

The ~22M-parameter Llama (87 MB fp32) decodes 16 concurrent requests in a LocalEngine while a new
version is published the way the trainer publishes it (``engine/weight_buckets.py``) and taken up
the way an inference worker takes it up (``WeightFollower``):

- ``gather``: the state dict copied off the model, contiguous on the CPU;
- ``write``: serialised into safetensors buckets of ``--bucket-mb``, each hashed, written and
  synced, the manifest last;
- ``load``: the manifest and every bucket read and checked against their sha256, decoded and
  staged as a checked copy, while decoding goes on;
- ``pause``: the swap at the next step boundary, the only time generation stops.

``ours`` is publish -> activated (the sum); ``baseline`` is one in-memory copy of the same state
dict (``clone`` of every tensor); ``ratio`` = baseline / ours, the share of memory-copy speed the
whole path reaches. No request may lose a token, and some must carry both versions.

    python benchmarks/weight_publish.py [--repeats 3] [--bucket-mb 16]
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
from rollmesh.engine.weight_buckets import load_published, read_manifest, write_buckets
from rollmesh.messages.base import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--bucket-mb", type=int, default=16)
    args = parser.parse_args()
    setup_threads()
    _, directory = build_hf_llama()
    model = load_hf_model(directory)
    trainer_model = load_hf_model(directory)  # the trainer's copy, which the versions come from
    weights_dir = Path(tempfile.mkdtemp(prefix="rollmesh-bench-publish-"))
    nbytes = sum(t.nbytes for t in model.state_dict().values())
    workload = [(ids[:64], 200) for ids, _ in concurrent_workload(16)]

    async def one_update(engine: LocalEngine, version: int) -> dict[str, float]:
        with torch.no_grad():
            for parameter in trainer_model.parameters():
                parameter.add_(0.001)  # a new version, the model still sane
        requests = [asyncio.create_task(engine.generate(ids, SamplingParams(temperature=0.0, max_new_tokens=n),
                                                        request_id=f"v{version}-{i}"))
                    for i, (ids, n) in enumerate(workload)]
        await asyncio.sleep(0.5)  # let decoding get going
        start = time.perf_counter()
        published = await asyncio.to_thread(write_buckets, trainer_model.state_dict(), weights_dir,
                                            version=version, bucket_bytes=args.bucket_mb << 20)
        loaded = time.perf_counter()
        await asyncio.to_thread(lambda: engine.stage_weights(
            load_published(published.manifest_path, published.manifest_sha256), version))
        staged = time.perf_counter()
        await engine.wait_weights_activated(version)
        total = time.perf_counter() - start
        results = await asyncio.gather(*requests)
        assert all(len(r.token_ids) == n for r, (_, n) in zip(results, workload)), "a request lost tokens"
        assert any(len(set(r.versions)) == 2 for r in results), "no request spanned the swap"
        buckets = len(read_manifest(published.manifest_path, published.manifest_sha256).buckets)
        return {"total": total, "gather": published.gather_s, "write": published.write_s,
                "load": staged - loaded, "pause": engine.decode_engine.weights.last_swap_seconds,
                "buckets": buckets, "bytes": published.total_bytes}

    async def measure() -> tuple[list[dict[str, float]], list[float]]:
        phases, copies = [], []
        async with LocalEngine(ModelConfig(path=str(directory)), InferenceConfig(max_batch=32), model=model,
                               tokenizer=NoEos()) as engine:
            for version in range(1, args.repeats + 1):
                phase = await one_update(engine, version)
                state = trainer_model.state_dict()
                copy_seconds, _ = timed(lambda: {k: v.clone() for k, v in state.items()})
                phases.append(phase)
                copies.append(copy_seconds)
                print(f"v{version}: total {phase['total'] * 1e3:.1f} ms = gather {phase['gather'] * 1e3:.1f} + write "
                      f"{phase['write'] * 1e3:.1f} + load {phase['load'] * 1e3:.1f} (+ wait for the step boundary); "
                      f"pause {phase['pause'] * 1e3:.2f} ms; {phase['buckets']} buckets; memory copy "
                      f"{copy_seconds * 1e3:.1f} ms", flush=True)
        return phases, copies

    phases, copies = asyncio.run(measure())
    median = {key: statistics.median(p[key] for p in phases) for key in phases[0]}
    copy = statistics.median(copies)
    print_result(
        "weight_publish", median["total"] * 1e3, copy * 1e3, "ms (publish -> activated vs memory copy)",
        copy / median["total"], gather_ms=round(median["gather"] * 1e3, 2), write_ms=round(median["write"] * 1e3, 2),
        load_ms=round(median["load"] * 1e3, 2), pause_ms=round(median["pause"] * 1e3, 3),
        buckets=int(median["buckets"]), bucket_mb=args.bucket_mb, bytes=nbytes,
        bytes_per_s=round(nbytes / median["total"]), memcpy_bytes_per_s=round(nbytes / copy),
        in_flight_requests=len(workload), aborted=0,
    )


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
