"""Megatron torch_dist -> Hugging Face conversion against ``cp -r`` and a naive converter.

One run, on a checkpoint of at least 1 GB in the real ``torch_dist`` layout, written by
megatron-core itself (tensor parallel 2, bf16, by ``tests/support/megatron_checkpoints.py``; cached
under ``--cache``). Each measurement is a fresh child process that times only the conversion
(imports, and with ``--backend ray`` connecting to the already running Ray and warming its
workers, come before the clock starts); every timing includes flushing the output to disk
(``cp -r`` then ``sync``; the converters fsync every file). The source is in the page cache for
all of them (it is read once first), and ``sync`` runs before each so no earlier run's writeback
is counted against the next. The three alternate, ``--repeats`` times; medians are reported.

- ``ratio`` = cp time / our time (the issue's target: at least 0.67, i.e. at most 1.5x cp).
- ``vs_naive`` = naive time / our time. The naive converter loads the whole checkpoint into one
  process with torch's own DCP loader, maps it and saves it (``write_hf_checkpoint``: the same
  shards, manifest and fsyncs).
- Peak RSS of the converter against the checkpoint's size: with worker threads (the default)
  the converter is the child process alone and its own high-water mark is exact; with Ray
  tasks the child and every Ray worker are sampled every 20 ms and summed; and a run with the memory budget at a quarter of the checkpoint, whose peak
  must stay within that budget plus the fixed overhead, measured by converting an (almost)
  empty checkpoint, the tiny 0.4 MB model, the same way.

    python benchmarks/convert_throughput.py [--repeats 3] [--workers 2] [--backend threads|ray]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO / "benchmarks"), str(REPO / "tests"), str(REPO)]

from common import print_result  # noqa: E402
from rollmesh.local_ray import LocalRayEnvironment, write_ray_auth_token  # noqa: E402

# About 1.2 GB in bf16: 10 layers of hidden 2048 and SwiGLU 5632, a 32k vocabulary, untied.
BIG = dict(layers=10, hidden=2048, ffn=5632, vocab=32000)
LOOPBACK = "127.0.0.1"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--backend", choices=("threads", "ray"), default="threads")
    parser.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "rollmesh-bench-convert")
    args = parser.parse_args()
    big, empty = _checkpoints(args.cache)
    size = sum(f.stat().st_size for f in big.iterdir())
    _read_all(big)
    scratch = Path(tempfile.mkdtemp(prefix="rollmesh-bench-convert-out-", dir=args.cache))
    # A Ray kept to this machine as rollmesh keeps its own: loopback, token auth (docs/security.md);
    # its token in a directory of this user's only (mkdtemp: 0700), removed at the end.
    ray_dir = Path(tempfile.mkdtemp(prefix="rollmesh-bench-ray-")) if args.backend == "ray" else None
    ray_env = None if ray_dir is None else LocalRayEnvironment(
        token_file=write_ray_auth_token(ray_dir), node_ip_address=LOOPBACK).subprocess_env()
    ray_address = None
    try:
        if ray_env is not None:
            ray_address = _start_ray(args.workers, ray_env)
        ours_s, cp_s, naive_s, ours_rss, naive_rss = [], [], [], [], []
        for repeat in range(args.repeats):
            cp_s.append(_cp(big, scratch / "cp"))
            seconds, rss = _child("ours", big, scratch / "ours", budget=4 << 30, workers=args.workers,
                                  backend=args.backend, ray_address=ray_address, env=ray_env)
            ours_s.append(seconds)
            ours_rss.append(rss)
            seconds, rss = _child("naive", big, scratch / "naive")
            naive_s.append(seconds)
            naive_rss.append(rss)
            print(f"repeat {repeat}: cp {cp_s[-1]:.2f} s, ours {ours_s[-1]:.2f} s (peak {ours_rss[-1] / 2**20:.0f} "
                  f"MiB), naive {naive_s[-1]:.2f} s (peak {naive_rss[-1] / 2**20:.0f} MiB)", flush=True)
        # The memory budget run and its fixed overhead: threads, so the converter is one process.
        overhead_s, overhead = _child("ours", empty, scratch / "empty", budget=size // 4, workers=args.workers)
        budget_s, budget_peak = _child("ours", big, scratch / "budget", budget=size // 4, workers=args.workers)
        print(f"budget {size // 4 / 2**20:.0f} MiB: {budget_s:.2f} s, peak {budget_peak / 2**20:.0f} MiB; "
              f"fixed overhead (empty checkpoint) {overhead / 2**20:.0f} MiB", flush=True)
    finally:
        if ray_dir is not None:
            subprocess.run(["ray", "stop", "--force"], capture_output=True, env=ray_env)
            shutil.rmtree(ray_dir, ignore_errors=True)
        shutil.rmtree(scratch, ignore_errors=True)
    ours, cp, naive = statistics.median(ours_s), statistics.median(cp_s), statistics.median(naive_s)
    print_result(
        "convert_throughput", ours, cp, "s (ours vs cp -r + sync, same bytes)", cp / ours,
        vs_naive=round(naive / ours, 3), naive_s=round(naive, 3), checkpoint_bytes=size,
        ours_gb_per_s=round(size / ours / 1e9, 3), cp_gb_per_s=round(size / cp / 1e9, 3),
        workers=args.workers, backend=args.backend,
        peak_rss_mib=round(max(ours_rss) / 2**20), naive_peak_rss_mib=round(max(naive_rss) / 2**20),
        budget_mib=round(size / 4 / 2**20), budget_run_s=round(budget_s, 3),
        budget_run_peak_rss_mib=round(budget_peak / 2**20), fixed_overhead_mib=round(overhead / 2**20),
        within_budget=budget_peak <= size // 4 + overhead,
    )


def _checkpoints(cache: Path) -> tuple[Path, Path]:
    """The big and the (almost) empty checkpoint, written once by megatron-core and kept."""
    from support.megatron_checkpoints import write_checkpoint

    cache.mkdir(parents=True, exist_ok=True)
    big, empty = cache / "dense_bf16_10_layers", cache / "tiny"
    if not (big / ".metadata").is_file():
        print("writing the ~1.2 GB megatron-core checkpoint (once)...", flush=True)
        shutil.rmtree(big, ignore_errors=True)
        write_checkpoint(big, tp=2, dtype="bfloat16", logits=False, timeout_s=1200, **BIG)
    if not (empty / ".metadata").is_file():
        shutil.rmtree(empty, ignore_errors=True)
        write_checkpoint(empty, tp=2, dtype="bfloat16", logits=False)
    return big, empty


def _read_all(folder: Path) -> None:
    for file in folder.iterdir():
        with open(file, "rb") as handle:
            while handle.read(1 << 24):
                pass


def _cp(src: Path, dst: Path) -> float:
    shutil.rmtree(dst, ignore_errors=True)
    os.sync()
    start = time.perf_counter()
    subprocess.run(["cp", "-r", str(src), str(dst)], check=True)
    os.sync()
    seconds = time.perf_counter() - start
    shutil.rmtree(dst)
    return seconds


def _child(mode: str, src: Path, dst: Path, *, budget: int = 0, workers: int = 1, backend: str = "threads",
           ray_address: str | None = None, env: dict[str, str] | None = None) -> tuple[float, int]:
    """(conversion seconds, as the child timed it; peak RSS of the converter's processes);
    ``env``: the child's environment (with ``ray_address``, what joining that Ray needs)."""
    shutil.rmtree(dst, ignore_errors=True)
    os.sync()
    command = [sys.executable, __file__, "--child", mode, str(src), str(dst), str(budget), str(workers), backend,
               ray_address or ""]
    child = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=env)
    sampled = _sample_tree_rss(child) if backend == "ray" else None
    out, _ = child.communicate()
    if child.returncode != 0:
        raise RuntimeError(f"{mode} conversion failed ({child.returncode})")
    shutil.rmtree(dst, ignore_errors=True)
    report = json.loads(out.strip().splitlines()[-1])
    # On threads the converter is the child alone: its own high-water mark is exact. Ray tasks run
    # in the cluster's worker processes, sampled with the child (slower, and approximate).
    return report["seconds"], sampled() if sampled is not None else report["peak_rss"]


def _sample_tree_rss(child: subprocess.Popen) -> Any:
    """Sample the RSS summed over ``child`` and the Ray workers every 20 ms; returns a function
    that stops sampling and gives the peak."""
    import psutil

    peak, done = 0, threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.is_set():
            try:
                tree = [psutil.Process(child.pid)] + [p for p in psutil.process_iter(["name", "cmdline"])
                                                      if "ray::" in " ".join(p.info["cmdline"] or [])]
                peak = max(peak, sum(p.memory_info().rss for p in tree))
            except psutil.Error:
                pass
            time.sleep(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()

    def stop() -> int:
        done.set()
        sampler.join()
        return peak

    return stop


def _start_ray(workers: int, env: dict[str, str]) -> str:
    """``ray start --head`` on loopback and a free port with ``env`` (token auth); its GCS address,
    for the children to join (named, not "auto", which finds whichever Ray here started last)."""
    port = _free_port(LOOPBACK)
    subprocess.run(["ray", "start", "--head", f"--node-ip-address={LOOPBACK}", f"--port={port}",
                    f"--num-cpus={workers}", "--include-dashboard=false", "--disable-usage-stats"],
                   check=True, capture_output=True, env=env)
    return f"{LOOPBACK}:{port}"


def _free_port(host: str) -> int:
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def run_child(mode: str, src: str, dst: str, budget: int, workers: int, backend: str, ray_address: str) -> None:
    """In the child: import, connect and warm up on the tiny checkpoint (process and worker
    start, imports, first calls), then time one conversion and print it."""
    import torch.distributed.checkpoint  # noqa: F401 - unpickling a DCP index imports it (0.7 s)

    tiny, warm = Path(src).parent / "tiny", Path(dst + ".warm")
    if mode == "naive":
        from naive_convert import naive_convert

        naive_convert(tiny, warm)
        shutil.rmtree(warm)
        start = time.perf_counter()
        naive_convert(Path(src), Path(dst))
    else:
        from rollmesh.checkpoint.megatron_export import ExportOptions, export_to_hf

        if backend == "ray":
            import ray

            ray.init(address=ray_address, log_to_driver=False)
        options = ExportOptions(memory_budget_bytes=budget, workers=workers, backend=backend)
        export_to_hf(tiny, warm, ExportOptions(memory_budget_bytes=1 << 30, workers=workers, backend=backend))
        shutil.rmtree(warm)
        start = time.perf_counter()
        export_to_hf(Path(src), Path(dst), options)
    seconds = time.perf_counter() - start
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    print(json.dumps({"seconds": seconds, "peak_rss": peak_rss}))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        mode, src, dst, budget, workers, backend, address = sys.argv[2:9]
        run_child(mode, src, dst, int(budget), int(workers), backend, address)
    else:
        main()
