"""Weight versions through shared memory (``trainer.weight_sync = "memory"``): the same buckets and
sha256 checks as the files, read from buffers; the follower's choice between memory and files;
and (integration) the real Ray object store between a holder actor and this process."""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Sequence
from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch
from safetensors.torch import load as load_safetensors

from support.fakes import RecordingPublisher, StagingEngine
from rollmesh.engine.errors import WeightsChecksumError, WeightsFileError, WeightsUnavailableError
from rollmesh.engine.weight_buckets import (
    SerializedWeights,
    decode_bucket,
    decode_bucket_parts,
    encode_bucket,
    load_published,
    serialize_buckets,
    write_serialized,
)
from rollmesh.engine.weight_follower import WeightFollower
from rollmesh.engine.weight_memory import (
    MemoryLocation,
    load_from_memory,
    resolve_weight_sync,
    serialize_into_memory,
)
from rollmesh.messages import WeightsPublished
from rollmesh.messages.subjects import WEIGHTS_ACTIVATED

pytestmark = pytest.mark.timeout(60)
RAY_TIMEOUT_S = 300  # starting Ray on a loaded 2-core machine


@pytest.fixture
def state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {"embed": torch.randn(64, 16), "layer.0.w": torch.randn(16, 16), "layer.0.b": torch.randn(16),
            "layer.1.w": torch.randn(16, 16).to(torch.bfloat16), "steps": torch.arange(5),
            "mask": torch.tensor([True, False]), "empty": torch.zeros(0, 4)}


class DictBuckets:
    """The two memory seams over a dict: ``put`` keeps copies of the manifest and of each
    bucket's parts as numpy arrays (read-only, as Ray hands them out), ``fetch`` returns them;
    ``node`` is where they live."""

    def __init__(self, node: str = "node-a") -> None:
        self.node = node
        self.held: dict[int, list] = {}
        self.early: dict[int, list] = {}  # put_buckets' copies, before the manifest
        self.fetches = 0

    def put_buckets(self, version: int, buckets) -> None:
        self.early[version] = [[part.copy() for part in parts] for parts in buckets]

    def put(self, serialized: SerializedWeights) -> MemoryLocation:
        held = [np.frombuffer(serialized.manifest, np.uint8)]
        held += self.early.pop(serialized.version, None) or [[part.copy() for part in parts]
                                                              for _, parts in serialized.buckets]
        for array in (held[0], *(part for parts in held[1:] for part in parts)):
            array.flags.writeable = False  # as Ray hands them out
        self.held[serialized.version] = held
        return MemoryLocation("trainer", self.node)

    def reachable(self, message: WeightsPublished) -> bool:
        return bool(message.memory_holder) and message.memory_node == self.node

    def fetch(self, message: WeightsPublished) -> tuple[object, Sequence[object]]:
        self.fetches += 1
        if message.version not in self.held:
            raise WeightsUnavailableError(message.version, "not held")
        arrays = self.held[message.version]
        return arrays[0], arrays[1:]


def announce(serialized: SerializedWeights, location: MemoryLocation, weights_dir: Path) -> WeightsPublished:
    return WeightsPublished(version=serialized.version, path=str(weights_dir / f"v{serialized.version:06d}" /
                                                                 "manifest.json"),
                            sha256=serialized.manifest_sha256, num_bytes=serialized.total_bytes,
                            memory_holder=location.holder, memory_node=location.node)


@pytest.mark.unit
def test_a_bucket_written_and_read_here_is_what_safetensors_reads(state):
    serialized = serialize_buckets(state, version=1, bucket_bytes=1 << 20)
    ((bucket, parts),) = serialized.buckets
    data = b"".join(part.tobytes() for part in parts)
    assert data == encode_bucket(state).tobytes()
    tensors = decode_bucket(data, bucket, where="test")
    assert all(torch.equal(tensors[k], t) for k, t in decode_bucket_parts(parts, bucket, where="test").items())
    expected = load_safetensors(data)  # what safetensors itself reads from the same bytes
    assert tensors.keys() == expected.keys()
    for name, tensor in expected.items():
        assert tensors[name].dtype == tensor.dtype and torch.equal(tensors[name], tensor), name


@pytest.mark.unit
def test_memory_buckets_are_byte_for_byte_the_files_buckets(state, tmp_path):
    serialized = serialize_buckets(state, version=3, bucket_bytes=2048)
    manifest_path = write_serialized(serialized, tmp_path)
    assert manifest_path.read_bytes() == serialized.manifest
    for bucket, parts in serialized.buckets:
        assert (manifest_path.parent / bucket.file).read_bytes() == b"".join(part.tobytes() for part in parts)
    from_files = load_published(manifest_path, serialized.manifest_sha256)
    holder = DictBuckets()
    message = announce(serialized, holder.put(serialized), tmp_path)
    from_memory = load_from_memory(message, holder).state_dict
    assert from_memory.keys() == from_files.keys()
    assert all(torch.equal(from_memory[k], from_files[k]) for k in from_files)


@pytest.mark.unit
def test_a_version_serialised_into_memory_has_its_buckets_copied_while_hashed_then_its_manifest(state, tmp_path):
    holder = DictBuckets()
    serialized, location = serialize_into_memory(state, holder, version=2, bucket_bytes=2048)
    assert holder.early == {} and len(holder.held[2]) == 1 + len(serialized.buckets)  # used, not put twice
    loaded = load_from_memory(announce(serialized, location, tmp_path), holder).state_dict
    assert all(torch.equal(loaded[k], t) for k, t in state.items())


@pytest.mark.unit
def test_a_damaged_bucket_in_memory_is_refused_by_name(state, tmp_path):
    serialized = serialize_buckets(state, version=1, bucket_bytes=2048)
    holder = DictBuckets()
    message = announce(serialized, holder.put(serialized), tmp_path)
    damaged = holder.held[1][2][-1].copy()
    damaged[-1] ^= 0xFF
    holder.held[1][2][-1] = damaged
    with pytest.raises(WeightsChecksumError, match=serialized.buckets[1][0].file):
        load_from_memory(message, holder)


@pytest.mark.unit
def test_a_manifest_that_does_not_match_the_announced_sha256_is_refused(state, tmp_path):
    serialized = serialize_buckets(state, version=1, bucket_bytes=2048)
    holder = DictBuckets()
    message = msgspec.structs.replace(announce(serialized, holder.put(serialized), tmp_path), sha256="0" * 64)
    with pytest.raises(WeightsChecksumError):
        load_from_memory(message, holder)


@pytest.mark.unit
def test_bucket_parts_split_otherwise_than_their_header_says_are_a_file_error(state):
    serialized = serialize_buckets({"a": torch.ones(4), "b": torch.zeros(2)}, version=1, bucket_bytes=1 << 20)
    ((bucket, (head, a, b)),) = serialized.buckets
    joined = np.concatenate([a, b])  # the same bytes, so the sha256 passes; the split does not
    with pytest.raises(WeightsFileError, match="one part of its own"):
        decode_bucket_parts([head, joined], bucket, where="test")


@pytest.mark.unit
def test_a_bucket_whose_header_points_outside_it_is_a_file_error(state):
    serialized = serialize_buckets({"w": torch.ones(4)}, version=1, bucket_bytes=1 << 20)
    ((bucket, parts),) = serialized.buckets
    truncated = b"".join(part.tobytes() for part in parts)[:-4]
    bucket = msgspec.structs.replace(bucket, sha256=hashlib.sha256(truncated).hexdigest())
    with pytest.raises(WeightsFileError, match="outside"):
        decode_bucket(truncated, bucket, where="test")


@pytest.mark.unit
@pytest.mark.parametrize(("setting", "cuda", "sglang", "expected"), [
    ("auto", False, False, "files"), ("auto", True, False, "memory"), ("auto", True, True, "nccl"),
    ("auto", False, True, "files"), ("memory", False, False, "memory"), ("files", True, True, "files"),
    ("nccl", False, True, "nccl"), ("ipc", True, True, "ipc")])
def test_auto_weight_sync_is_nccl_with_sglang_memory_on_cuda_and_files_on_cpu(setting, cuda, sglang, expected):
    assert resolve_weight_sync(setting, cuda=cuda, sglang=sglang) == expected


# -- the follower's choice --------------------------------------------------------------------


def follower(engine: StagingEngine, bus: RecordingPublisher, memory: DictBuckets) -> WeightFollower:
    return WeightFollower(engine, bus, worker="decode-0", role="decode", memory=memory)


@pytest.mark.unit
async def test_a_worker_on_the_trainers_node_stages_from_memory_without_touching_the_files(state, tmp_path):
    serialized = serialize_buckets(state, version=1, bucket_bytes=2048)
    memory = DictBuckets()
    message = announce(serialized, memory.put(serialized), tmp_path)  # no files written at all
    engine, bus = StagingEngine(), RecordingPublisher()
    await follower(engine, bus, memory).handle_weights_published(message)
    ((version, staged),) = engine.staged
    assert version == 1 and all(torch.equal(staged[k], state[k]) for k in state)
    (activated,) = bus.messages(WEIGHTS_ACTIVATED)
    assert (activated.version, activated.source) == (1, "memory")


@pytest.mark.unit
@pytest.mark.parametrize("case", ["other node", "holder lost it"])
async def test_a_worker_reads_the_files_when_the_memory_copy_cannot_serve(state, tmp_path, case):
    serialized = serialize_buckets(state, version=1, bucket_bytes=2048)
    write_serialized(serialized, tmp_path)
    trainer_side = DictBuckets(node="node-a")
    message = announce(serialized, trainer_side.put(serialized), tmp_path)
    worker_side = DictBuckets(node="node-b") if case == "other node" else trainer_side
    if case == "holder lost it":
        trainer_side.held.clear()
    engine, bus = StagingEngine(), RecordingPublisher()
    await follower(engine, bus, worker_side).handle_weights_published(message)
    ((_, staged),) = engine.staged
    assert all(torch.equal(staged[k], state[k]) for k in state)
    assert bus.messages(WEIGHTS_ACTIVATED)[0].source == "files"
    assert worker_side.fetches == (0 if case == "other node" else 1)


# -- the real object store ------------------------------------------------------------------


@pytest.mark.integration
@pytest.mark.timeout(RAY_TIMEOUT_S)
def test_buckets_put_by_a_holder_actor_are_read_here_from_shared_memory(ray_session, state, tmp_path):
    import ray

    from rollmesh.actors.weight_object_store import ObjectStoreWeightFetcher, ObjectStoreWeightHolder

    @ray.remote(num_cpus=0)
    class Holder:  # the trainer actor's part in this: put, and answer weight_bucket_refs
        def __init__(self, name: str) -> None:
            self.holder = ObjectStoreWeightHolder(name, keep=1)

        def publish(self, tensors, version: int):
            serialized = serialize_buckets(tensors, version=version, bucket_bytes=2048)
            return self.holder.put(serialized), serialized.manifest_sha256, serialized.total_bytes

        def weight_bucket_refs(self, version: int):
            return self.holder.refs(version)

    name = f"weights-holder-{uuid.uuid4().hex[:8]}"
    holder = Holder.options(name=name).remote(name)
    fetcher = ObjectStoreWeightFetcher(timeout_s=60)

    def published(version: int) -> WeightsPublished:
        location, sha256, num_bytes = ray.get(holder.publish.remote(state, version), timeout=60)
        return WeightsPublished(version=version, path=str(tmp_path / "missing"), sha256=sha256,
                                num_bytes=num_bytes, memory_holder=location.holder, memory_node=location.node)

    first = published(1)
    assert fetcher.reachable(first)
    loaded = load_from_memory(first, fetcher).state_dict
    assert all(torch.equal(loaded[k], state[k]) for k in state)
    del loaded

    published(2)  # keep=1: version 1 is let go of
    with pytest.raises(WeightsUnavailableError, match="no longer holds"):
        load_from_memory(first, fetcher)

    ray.kill(holder)
    with pytest.raises(WeightsUnavailableError):
        load_from_memory(first, fetcher)


@pytest.mark.unit
async def test_a_worker_reading_files_waits_for_a_memory_announced_versions_files(state, tmp_path):
    import asyncio
    import threading

    serialized = serialize_buckets(state, version=1, bucket_bytes=2048)
    message = announce(serialized, DictBuckets(node="node-a").put(serialized), tmp_path)  # files not yet written
    engine, bus = StagingEngine(), RecordingPublisher()
    elsewhere = WeightFollower(engine, bus, worker="decode-0", role="decode", memory=DictBuckets(node="node-b"))
    handler = asyncio.create_task(elsewhere.handle_weights_published(message))
    writer = threading.Thread(target=write_serialized, args=(serialized, tmp_path))  # the trainer, after announcing
    writer.start()
    await asyncio.wait_for(handler, 30)
    writer.join()
    ((version, staged),) = engine.staged
    assert version == 1 and all(torch.equal(staged[k], state[k]) for k in state)


@pytest.mark.unit
async def test_files_that_never_follow_a_memory_announcement_are_a_file_error(state, tmp_path):
    serialized = serialize_buckets(state, version=1, bucket_bytes=2048)
    message = announce(serialized, DictBuckets(node="node-a").put(serialized), tmp_path)
    elsewhere = WeightFollower(StagingEngine(), RecordingPublisher(), worker="decode-0", role="decode",
                               files_timeout_s=0.1)
    with pytest.raises(WeightsFileError, match="not written within"):
        await elsewhere.handle_weights_published(message)
