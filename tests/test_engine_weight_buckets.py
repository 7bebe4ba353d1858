"""Weight versions published as sha256-checked safetensors buckets under a manifest written last:
round trip, bucket sizes, damaged or swapped files named, the single-file format still read."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from rollmesh.engine.errors import WeightsChecksumError, WeightsFileError
from rollmesh.engine.weight_buckets import (
    MANIFEST_FILE,
    load_published,
    read_buckets,
    read_manifest,
    remove_published,
    write_buckets,
)
from rollmesh.engine.weights import save_weights

pytestmark = pytest.mark.unit


@pytest.fixture
def state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {"embed": torch.randn(64, 16), "layer.0.w": torch.randn(16, 16), "layer.0.b": torch.randn(16),
            "layer.1.w": torch.randn(16, 16).to(torch.bfloat16), "big": torch.randn(128, 32)}


def test_a_version_round_trips_in_buckets_of_at_most_the_limit(state, tmp_path):
    published = write_buckets(state, tmp_path, version=7, bucket_bytes=4096)
    manifest = read_manifest(published.manifest_path, published.manifest_sha256)
    assert published.manifest_path == tmp_path / "v000007" / MANIFEST_FILE
    assert manifest.version == 7 and len(manifest.buckets) >= 3
    sizes = {name: t.numel() * t.element_size() for name, t in state.items()}
    for bucket in manifest.buckets:  # a tensor over the limit (big: 16 KiB) gets a bucket alone
        held = sum(sizes[name] for name in bucket.tensors)
        assert held <= 4096 or len(bucket.tensors) == 1
    assert published.total_bytes == sum((published.manifest_path.parent / b.file).stat().st_size
                                        for b in manifest.buckets)
    loaded = load_published(published.manifest_path, published.manifest_sha256)
    assert loaded.keys() == state.keys() and all(torch.equal(loaded[k], state[k]) for k in state)
    assert [len(tensors) for tensors in read_buckets(published.manifest_path)] == [len(b.tensors) for b in manifest.buckets]


def test_a_damaged_bucket_or_manifest_is_refused_by_name(state, tmp_path):
    published = write_buckets(state, tmp_path, version=1, bucket_bytes=4096)
    with pytest.raises(WeightsChecksumError):
        load_published(published.manifest_path, "0" * 64)  # not the manifest that was announced
    manifest = json.loads(published.manifest_path.read_text())
    victim = published.manifest_path.parent / manifest["buckets"][1]["file"]
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF
    victim.write_bytes(bytes(data))
    with pytest.raises(WeightsChecksumError, match=victim.name):
        load_published(published.manifest_path, published.manifest_sha256)
    victim.unlink()
    with pytest.raises(WeightsFileError, match=victim.name):
        load_published(published.manifest_path, published.manifest_sha256)
    manifest["buckets"][0]["file"] = "../escape.safetensors"
    forged = json.dumps(manifest).encode()
    published.manifest_path.write_bytes(forged)
    with pytest.raises(WeightsFileError, match="bad bucket name"):
        load_published(published.manifest_path, hashlib.sha256(forged).hexdigest())


def test_the_single_file_format_still_loads_and_versions_are_removed_either_way(state, tmp_path):
    single = tmp_path / "v000001.safetensors"
    sha256, _ = save_weights(state, single)
    assert torch.equal(load_published(single, sha256)["big"], state["big"])
    published = write_buckets(state, tmp_path, version=2, bucket_bytes=1 << 20)
    remove_published(published.manifest_path)
    remove_published(single)
    assert list(tmp_path.iterdir()) == []


def test_a_failed_publication_leaves_no_version_directory(tmp_path):
    with pytest.raises(WeightsFileError, match="cannot publish"):  # safetensors has no complex dtype
        write_buckets({"a": torch.zeros(4), "b": torch.zeros(2, dtype=torch.complex64)}, tmp_path, version=3,
                      bucket_bytes=1 << 20)
    assert not (tmp_path / "v000003").exists()
    assert not [p for p in tmp_path.iterdir() if not p.name.startswith(".")]
