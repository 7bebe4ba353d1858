"""Prefill -> decode KV hand-off through the Ray object store vs a plain in-memory copy.

Two Ray actors hold the ~22M Llama: a prefill worker that prefills a prompt and returns its KV
pages (a PrefillResult), and a decode worker that stores handed-over pages in its paged pool.
The prefill result is made first and waited for, so the timed part is the hand-off alone: the
ObjectRef passed to the decode actor, Ray moving the pages to it, and the pages written into its
blocks. Baseline: ``copy_`` of the same number of bytes between two tensors in one process.
``ratio`` = copy time / hand-off time (below 1: the hand-off is slower than a memcpy, by the
actor call and the object store). Also reported: the cost of an empty actor call, and GB/s.

    python benchmarks/kv_handoff.py [--repeats 7] [--tokens 128,512,1000]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time

import ray
import torch

from common import build_hf_llama, print_result, random_prompt, setup_threads
from rollmesh.local_ray import LocalRayEnvironment, write_ray_auth_token


class PrefillSide:
    def __init__(self, directory: str) -> None:
        from rollmesh.engine.models import load_hf_model
        from rollmesh.engine.prefill import PrefillEngine

        torch.set_num_threads(1)
        self.engine = PrefillEngine(load_hf_model(directory), block_size=16)

    def prefill(self, input_ids):
        return self.engine.prefill(input_ids)


class DecodeSide:
    def __init__(self, directory: str) -> None:
        from rollmesh.engine.decode import DecodeEngine
        from rollmesh.engine.models import load_hf_model

        torch.set_num_threads(1)
        self.engine = DecodeEngine(load_hf_model(directory), max_batch=4, block_size=16)

    def accept(self, prefill) -> float:
        """Store the pages in freshly allocated blocks, free them; seconds spent storing."""
        start = time.perf_counter()
        blocks = self.engine.pool.allocate(prefill.pages.shape[2])
        self.engine.pool.write_pages(blocks, prefill.pages)
        self.engine.pool.free(blocks)
        return time.perf_counter() - start

    def ping(self, _payload=None) -> float:
        return 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--tokens", default="128,512,1000")
    args = parser.parse_args()
    setup_threads()
    _, directory = build_hf_llama()
    # A Ray kept to this machine as rollmesh keeps its own: loopback, token auth (docs/security.md).
    token_dir = tempfile.TemporaryDirectory(prefix="rollmesh-bench-ray-")  # 0700, removed at the end
    local_ray = LocalRayEnvironment(token_file=write_ray_auth_token(token_dir.name), node_ip_address="127.0.0.1")
    local_ray.apply()
    try:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(
                     [os.path.dirname(os.path.abspath(__file__)), os.getcwd()])}},
                 **local_ray.init_options())
        prefill = ray.remote(PrefillSide).options(num_cpus=0).remote(str(directory))
        decode = ray.remote(DecodeSide).options(num_cpus=0).remote(str(directory))
        rng = random.Random(3)
        ray.get(decode.ping.remote())
        overhead = statistics.median(
            _seconds(lambda: ray.get(decode.ping.remote())) for _ in range(20))
        figures = {}
        for tokens in (int(t) for t in args.tokens.split(",")):
            handoffs, copies, stores = [], [], []
            for _ in range(args.repeats):
                ref = prefill.prefill.remote(random_prompt(rng, tokens))
                ray.wait([ref], fetch_local=False)  # prefilled, still in the prefill worker
                start = time.perf_counter()
                store = ray.get(decode.accept.remote(ref))
                handoffs.append(time.perf_counter() - start)
                stores.append(store)
                pages = ray.get(ref).pages.clone()
                target = torch.empty_like(pages)
                target.copy_(pages)  # touch the target's pages first: time the copy alone
                copies.append(_seconds(lambda: [target.copy_(pages) for _ in range(10)]) / 10)
            nbytes = pages.nbytes
            handoff, copy = statistics.median(handoffs), statistics.median(copies)
            figures[tokens] = (handoff, copy, nbytes, statistics.median(stores))
            print(f"{tokens} tokens, {nbytes / 2**20:.1f} MiB of KV: hand-off {handoff * 1e3:.2f} ms "
                  f"({nbytes / handoff / 1e9:.2f} GB/s, of which storing in blocks "
                  f"{figures[tokens][3] * 1e3:.2f} ms), memory copy {copy * 1e3:.3f} ms", flush=True)
    finally:
        ray.shutdown()
        local_ray.restore()
        token_dir.cleanup()
    largest = max(figures)
    handoff, copy, nbytes, store = figures[largest]
    print_result(
        "kv_handoff", handoff * 1e3, copy * 1e3, f"ms for {largest} tokens' KV (lower is better)",
        copy / handoff, kv_bytes=nbytes, handoff_gb_per_s=round(nbytes / handoff / 1e9, 3),
        memcpy_gb_per_s=round(nbytes / copy / 1e9, 3), empty_call_ms=round(overhead * 1e3, 3),
        store_in_blocks_ms=round(store * 1e3, 3),
        by_tokens={t: {"handoff_ms": round(h * 1e3, 3), "memcpy_ms": round(c * 1e3, 3)}
                   for t, (h, c, _, _) in figures.items()},
    )


def _seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


if __name__ == "__main__":
    main()
