"""Weight publication without files: trainer -> shared memory -> decoding engine, against the files.

The ~22M-parameter Llama decodes 16 concurrent requests in a LocalEngine (this process, the
inference worker) while a trainer (a Ray actor, another process on this node) publishes a new
version, alternately by the two paths rollmesh has (``trainer.weight_sync``):

- ``ours`` (``"memory"``): the trainer serialises the version into safetensors buckets, hashes
  them, ``ray.put``s them into the node's shared memory (``ObjectStoreWeightHolder``) and
  announces; the worker's ``WeightFollower`` fetches them zero-copy (``ObjectStoreWeightFetcher``),
  checks the manifest and every bucket against their sha256, stages a copy and waits for the swap.
  As in the trainer, the same bytes are then written to disk in the background (durability), and
  that write competes for the machine while the worker loads;
- ``baseline`` (``"files"``): the trainer writes the buckets and manifest durably (fsync) and
  announces; the same ``WeightFollower`` reads and checks the files, stages and waits.

Both figures are publish -> activated: from the trainer starting the publication to the version
being active in the engine, medians over ``--repeats`` of each path after one untimed round. ``ratio`` = baseline / ours.
``memcpy_ms`` is one plain in-memory copy of the same state dict, for scale; ``pause_ms`` the swap
itself, the only time generation stops. No request may lose a token, and some must carry both
versions.

The floor (``floor_*``, measured in the same run once decoding is over, each part alone, best of
3): the work neither path can skip on this machine. Both hash every byte twice (the trainer for
the manifest, the worker to check it) and stage one copy; ours also copies the bytes once into
shared memory, the files write them into the page cache, fsync them and read them back.
``floor_ratio`` is the best ``ratio`` those allow with every part on one core;
``floor_ratio_2core`` with every CPU part split evenly over 2 cores (fsync cannot be).

    python benchmarks/weight_publish.py [--repeats 3] [--bucket-mb 16]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

import ray
import torch

from common import NoEos, build_hf_llama, concurrent_workload, print_result, setup_threads, timed
from rollmesh.actors.weight_object_store import ObjectStoreWeightFetcher, ObjectStoreWeightHolder
from rollmesh.config import InferenceConfig, ModelConfig
from rollmesh.engine.local_engine import LocalEngine
from rollmesh.engine.models import load_hf_model
from rollmesh.engine.weight_buckets import (
    MANIFEST_FILE,
    read_manifest,
    version_directory,
    write_buckets,
    write_serialized,
)
from rollmesh.engine.weight_follower import WeightFollower
from rollmesh.engine.weight_memory import serialize_into_memory
from rollmesh.local_ray import LocalRayEnvironment, write_ray_auth_token
from rollmesh.messages import WeightsPublished
from rollmesh.messages.subjects import WEIGHTS_ACTIVATED

HOLDER = "bench-trainer"


class TrainerSide:
    """The trainer's part: its own copy of the model, a new version per call, either path."""

    def __init__(self, directory: str, weights_dir: str, bucket_bytes: int) -> None:
        torch.set_num_threads(1)
        self.model = load_hf_model(directory)
        self.weights_dir = Path(weights_dir)
        self.bucket_bytes = bucket_bytes
        self.holder = ObjectStoreWeightHolder(HOLDER)
        self._writer: threading.Thread | None = None

    def _next_version(self) -> None:
        if self._writer is not None:
            self._writer.join()  # the previous version's background write
        with torch.no_grad():
            for parameter in self.model.parameters():
                parameter.add_(0.001)  # a new version, the model still sane

    def publish_memory(self, version: int) -> WeightsPublished:
        self._next_version()
        started = time.perf_counter()
        serialized, location = serialize_into_memory(self.model.state_dict(), self.holder, version=version,
                                                     bucket_bytes=self.bucket_bytes)
        self.actor_s = time.perf_counter() - started
        # Durable after the announcement, as TrainerLogic does it: in the background here.
        self._writer = threading.Thread(target=write_serialized, args=(serialized, self.weights_dir))
        self._writer.start()
        return WeightsPublished(
            version=version, path=str(version_directory(self.weights_dir, version) / MANIFEST_FILE),
            sha256=serialized.manifest_sha256, num_bytes=serialized.total_bytes, gather_s=serialized.gather_s,
            write_s=serialized.serialize_s, memory_holder=location.holder, memory_node=location.node)

    def publish_files(self, version: int) -> WeightsPublished:
        self._next_version()
        started = time.perf_counter()
        published = write_buckets(self.model.state_dict(), self.weights_dir, version=version,
                                  bucket_bytes=self.bucket_bytes)
        self.actor_s = time.perf_counter() - started
        return WeightsPublished(version=version, path=str(published.manifest_path), sha256=published.manifest_sha256,
                                num_bytes=published.total_bytes, gather_s=published.gather_s,
                                write_s=published.write_s)

    def last_publish_s(self) -> float:
        """How long the last publication took inside this actor (the rest is the call's way back)."""
        return self.actor_s

    def ready(self) -> None:
        """Returns once the model is loaded (the constructor ran)."""

    def weight_bucket_refs(self, version: int):
        return self.holder.refs(version)

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.join()


class EngineWeights:
    """The LocalEngine as the follower sees an engine (``StagesWeights``)."""

    def __init__(self, engine: LocalEngine) -> None:
        self.engine = engine

    @property
    def current_version(self) -> int:
        return self.engine.current_version

    def stage_weights(self, state_dict, version: int) -> bool:
        return self.engine.stage_weights(state_dict, version)

    async def wait_weights_activated(self, version: int) -> int:
        return await self.engine.wait_weights_activated(version)

    def num_active(self) -> int:
        return self.engine.decode_engine.num_active()

    @property
    def last_swap_seconds(self) -> float:
        return self.engine.decode_engine.weights.last_swap_seconds


class Activations:
    """The follower's publisher: keeps the WeightsActivated it announces."""

    def __init__(self) -> None:
        self.activated = []

    async def publish(self, subject, message) -> None:
        if subject is WEIGHTS_ACTIVATED:
            self.activated.append(message)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--bucket-mb", type=int, default=16)
    args = parser.parse_args()
    setup_threads()
    _, directory = build_hf_llama()
    model = load_hf_model(directory)
    weights_dir = Path(tempfile.mkdtemp(prefix="rollmesh-bench-publish-"))
    nbytes = sum(t.nbytes for t in model.state_dict().values())
    workload = [(ids[:64], 200) for ids, _ in concurrent_workload(16)]
    token_dir = tempfile.TemporaryDirectory(prefix="rollmesh-bench-ray-")
    local_ray = LocalRayEnvironment(token_file=write_ray_auth_token(token_dir.name), node_ip_address="127.0.0.1")
    local_ray.apply()
    try:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(
                     [os.path.dirname(os.path.abspath(__file__)), os.getcwd()])}},
                 **local_ray.init_options())
        trainer = ray.remote(TrainerSide).options(name=HOLDER, num_cpus=0).remote(
            str(directory), str(weights_dir), args.bucket_mb << 20)
        ray.get(trainer.ready.remote())
        results = asyncio.run(measure(trainer, model, directory, workload, args.repeats))
        ray.get(trainer.flush.remote())
        floor = measure_floor(model.state_dict(), weights_dir / "floor")
        buckets = len(read_manifest(version_directory(weights_dir, 1) / MANIFEST_FILE, None).buckets)
    finally:
        ray.shutdown()
        local_ray.restore()
        token_dir.cleanup()
    ours, baseline, copies = results
    med = {path: {key: statistics.median(r[key] for r in runs) for key in runs[0]}
           for path, runs in (("ours", ours), ("baseline", baseline))}
    copy = statistics.median(copies)
    print_result(
        "weight_publish", med["ours"]["total"] * 1e3, med["baseline"]["total"] * 1e3,
        "ms (publish -> activated: shared memory vs files)", med["baseline"]["total"] / med["ours"]["total"],
        memcpy_ms=round(copy * 1e3, 2),
        ours_publish_ms=round(med["ours"]["publish"] * 1e3, 2), ours_load_ms=round(med["ours"]["load"] * 1e3, 2),
        baseline_publish_ms=round(med["baseline"]["publish"] * 1e3, 2),
        baseline_load_ms=round(med["baseline"]["load"] * 1e3, 2),
        pause_ms=round(statistics.median([r["pause"] for r in ours + baseline]) * 1e3, 3),
        buckets=buckets, bucket_mb=args.bucket_mb, bytes=nbytes,
        in_flight_requests=len(workload), aborted=0, sha256_checked=True,
        ours_in_actor_ms=round(med["ours"]["actor"] * 1e3, 2),
        baseline_in_actor_ms=round(med["baseline"]["actor"] * 1e3, 2),
        **floor,
    )


def measure_floor(state, directory: Path, repeats: int = 3) -> dict[str, float]:
    """Each unavoidable part of a publication alone, best of ``repeats``, in milliseconds."""
    directory.mkdir(parents=True, exist_ok=True)
    views = [t.detach().contiguous().reshape(-1).view(torch.uint8).numpy() for t in state.values() if t.numel()]

    def best(work) -> float:
        return min(timed(work)[0] for _ in range(repeats)) * 1e3

    def hash_once() -> None:
        digest = hashlib.sha256()
        for view in views:
            digest.update(view)

    sha = best(hash_once)
    copy = best(lambda: [view.copy() for view in views])
    writes, syncs, reads = [], [], []
    for attempt in range(repeats):
        path = directory / f"floor-{attempt}.bin"
        with open(path, "wb") as out:
            writes.append(timed(lambda: out.writelines(views))[0])
            syncs.append(timed(lambda: os.fsync(out.fileno()))[0])
        reads.append(timed(path.read_bytes)[0])  # from the page cache, as the worker reads
        path.unlink()
    write, fsync, read = (min(times) * 1e3 for times in (writes, syncs, reads))
    ours = 2 * sha + 2 * copy
    baseline = 2 * sha + write + fsync + read + copy
    return {"floor_sha256_ms": round(sha, 1), "floor_copy_ms": round(copy, 1), "floor_write_ms": round(write, 1),
            "floor_fsync_ms": round(fsync, 1), "floor_read_ms": round(read, 1), "floor_ours_ms": round(ours, 1),
            "floor_baseline_ms": round(baseline, 1), "floor_ratio": round(baseline / ours, 3),
            "floor_ratio_2core": round((baseline - fsync) / 2 / (ours / 2) + fsync / (ours / 2), 3)}


async def measure(trainer, model, directory: Path, workload, repeats: int):
    ours, baseline, copies = [], [], []
    async with LocalEngine(ModelConfig(path=str(directory)), InferenceConfig(max_batch=32), model=model,
                           tokenizer=NoEos()) as engine:
        bus = Activations()
        followers = {
            "ours": WeightFollower(EngineWeights(engine), bus, worker="decode-0", role="decode",
                                   memory=ObjectStoreWeightFetcher()),
            "baseline": WeightFollower(EngineWeights(engine), bus, worker="decode-0", role="decode"),
        }
        version = 0
        for repeat in range(repeats + 1):  # the first round warms both paths up, untimed
            # Alternate which path goes first, so neither always follows the other's disk writes.
            for path in (("ours", "baseline") if repeat % 2 == 0 else ("baseline", "ours")):
                version += 1
                figures = await one_update(engine, trainer, followers[path], bus, path, version, workload)
                if repeat == 0:
                    continue
                (ours if path == "ours" else baseline).append(figures)
                state = model.state_dict()
                copy_seconds, _ = timed(lambda: {k: v.clone() for k, v in state.items()})
                copies.append(copy_seconds)
                print(f"v{version} {path:8s}: publish -> activated {figures['total'] * 1e3:.1f} ms = trainer "
                      f"{figures['publish'] * 1e3:.1f} (in the actor {figures['actor'] * 1e3:.1f}) + worker load "
                      f"{figures['load'] * 1e3:.1f} "
                      f"(+ the step boundary); pause {figures['pause'] * 1e3:.2f} ms; "
                      f"memory copy {copy_seconds * 1e3:.1f} ms", flush=True)
    return ours, baseline, copies


async def one_update(engine, trainer, follower, bus, path, version, workload):
    from rollmesh.messages.base import SamplingParams

    requests = [asyncio.create_task(engine.generate(ids, SamplingParams(temperature=0.0, max_new_tokens=n),
                                                    request_id=f"v{version}-{i}"))
                for i, (ids, n) in enumerate(workload)]
    await asyncio.sleep(0.5)  # let decoding get going
    start = time.perf_counter()
    publish = trainer.publish_memory if path == "ours" else trainer.publish_files
    message = await publish.remote(version)
    published = time.perf_counter()
    await follower.handle_weights_published(message)
    total = time.perf_counter() - start
    actor_s = await trainer.last_publish_s.remote()
    activated = bus.activated[-1]
    assert activated.version == version and activated.source == ("memory" if path == "ours" else "files"), activated
    results = await asyncio.gather(*requests)
    assert all(len(r.token_ids) == n for r, (_, n) in zip(results, workload)), "a request lost tokens"
    assert any(len(set(r.versions)) == 2 for r in results), "no request spanned the swap"
    return {"total": total, "publish": published - start, "load": activated.load_s,
            "pause": activated.pause_s, "actor": actor_s}


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
