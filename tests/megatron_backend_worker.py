"""Runs ``MegatronTrainerBackend`` on tensor-parallel ranks under gloo, for its tests.

Run as a script (``python tests/megatron_backend_worker.py JOB.pt OUT.pt --tp 2``): spawns one
process per TP rank, and for every case in ``JOB.pt`` ({name: {"hf_path", "trainer", "probe",
"samples", "save_root"}}) builds the backend from the HF directory, records its logits on
``probe``, checks the HF state-dict round trip (load, gather) bit for bit, runs one
``policy_step`` on ``samples``, gathers the weights after it and, given a ``save_root``, saves a
checkpoint there. Rank 0 writes {name: results} to ``OUT.pt``; the tests compare them with the
torch backend and transformers in their own process. ``run_worker`` starts the script in a child
process, so the test process never initialises torch.distributed or megatron's global state.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def run_worker(job: Path, out: Path, *, tp: int = 2, timeout_s: float = 240.0) -> dict:
    import torch

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(REPO), "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, __file__, str(job), str(out), "--tp", str(tp)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"the megatron backend worker failed:\n{done.stderr[-6000:]}")
    return torch.load(out, weights_only=False)


def _rank(rank: int, world: int, job_path: str, out_path: str) -> None:
    import torch
    import torch.distributed as dist

    from rollmesh.training.megatron_cpu_shims import install_cpu_shims

    os.environ.update(MASTER_ADDR="127.0.0.1", RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    install_cpu_shims()
    from megatron.core import parallel_state

    from rollmesh.config import ModelConfig, TrainerConfig
    from rollmesh.engine.models import read_safetensors
    from rollmesh.training.megatron_backend import MegatronTrainerBackend

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    job = torch.load(job_path, weights_only=False)
    results = {}
    for name, case in job.items():
        started = time.perf_counter()
        backend = MegatronTrainerBackend(ModelConfig(family="hf", hf_path=case["hf_path"]),
                                         TrainerConfig(**case["trainer"]))
        with torch.no_grad():
            logits = backend.net.logits(case["probe"])
        original = read_safetensors(case["hf_path"], dtype=torch.float32)
        gathered = backend.state_dict()
        first_gather_exact = all(torch.equal(gathered[key], original[key]) for key in original)
        # Load other weights, gather them back, then restore the original ones.
        noise = torch.Generator().manual_seed(7)
        perturbed = {key: t + 0.01 * torch.randn(t.shape, generator=noise) for key, t in original.items()}
        backend.load_state_dict(perturbed)
        regathered = backend.state_dict()
        round_trip_exact = all(torch.equal(regathered[key], perturbed[key]) for key in perturbed)
        backend.load_state_dict(original)
        stats = backend.policy_step(case["samples"], current_version=0)
        after = backend.state_dict()
        saved = backend.save_checkpoint(Path(case["save_root"]), iteration=3) if case.get("save_root") else None
        results[name] = dict(logits=logits, first_gather_exact=first_gather_exact, round_trip_exact=round_trip_exact,
                             stats=stats, after=after, saved=saved, seconds=time.perf_counter() - started)
    if rank == 0:
        torch.save(results, out_path)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    import argparse

    import torch.multiprocessing as mp

    parser = argparse.ArgumentParser()
    parser.add_argument("job")
    parser.add_argument("out")
    parser.add_argument("--tp", type=int, default=2)
    options = parser.parse_args()
    mp.spawn(_rank, args=(options.tp, options.job, options.out), nprocs=options.tp)
