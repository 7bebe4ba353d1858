"""The planned, parallel, memory-bounded converter (``convert_executor``) on a real megatron-core
TP=2 ``torch_dist`` checkpoint: shards within a budget, identical output whatever the workers
or backend, a crash mid-conversion then a rerun that resumes, errors before writing, and the
resharder reacting to ``CheckpointSaved`` for a Megatron checkpoint."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from rollmesh.checkpoint.convert_executor import convert_planned, plan_conversion
from rollmesh.checkpoint.convert_planner import TaskTooLargeError
from rollmesh.checkpoint.errors import CheckpointReadError, CheckpointWriteError
from rollmesh.checkpoint.hf_writer import INDEX_FILE, MANIFEST_FILE, read_hf_checkpoint
from rollmesh.checkpoint.megatron_export import ExportOptions, export_to_hf, inspect_source
from rollmesh.checkpoint.resharder import ResharderLogic
from rollmesh.config import ResharderConfig
from rollmesh.messages.checkpoint import CheckpointSaved
from conftest import REPO_ROOT

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

# Small enough to split the tiny model's vocabulary tables into row blocks and give many shards.
TIGHT = ExportOptions(memory_budget_bytes=300_000, workers=2, max_shard_bytes=1 << 30)


@pytest.fixture(scope="session")
def whole_export(dense_tp2, tmp_path_factory) -> Path:
    """One shard, one worker, a budget that never splits anything: the reference output."""
    out = tmp_path_factory.mktemp("convert_ref") / "hf"
    export_to_hf(dense_tp2, out, ExportOptions(workers=1, memory_budget_bytes=1 << 30))
    return out


def assert_same_tensors(directory: Path, reference: Path) -> None:
    ours, theirs = read_hf_checkpoint(directory), read_hf_checkpoint(reference)
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[name], theirs[name]) for name in ours)


def manifest(directory: Path) -> dict[str, str]:
    return json.loads((directory / MANIFEST_FILE).read_text())


def test_a_tight_budget_splits_the_work_yet_writes_the_same_tensors(dense_tp2, whole_export, tmp_path):
    source = inspect_source(dense_tp2)
    plan = plan_conversion(source.folder, source.model.spec, max_shard_bytes=TIGHT.max_shard_bytes,
                           memory_budget_bytes=TIGHT.memory_budget_bytes, workers=TIGHT.workers)
    assert len(plan.jobs) > 2 and all(job.memory_bytes <= TIGHT.memory_budget_bytes // 2 for job in plan.jobs)
    blocks = [unit.rows for job in plan.jobs for unit in job.units if unit.name == "embedding.word_embeddings.weight"]
    assert len(blocks) > 1  # the vocabulary table went in blocks of rows
    seen: list[int] = []
    files = export_to_hf(dense_tp2, tmp_path / "hf", TIGHT, progress=lambda done, total: seen.append(done))
    assert seen[-1] == plan.total_bytes and seen == sorted(seen)
    out = tmp_path / "hf"
    assert files[-1] == INDEX_FILE and len(manifest(out)) == len(plan.jobs)
    assert_same_tensors(out, whole_export)

    for file, digest in manifest(out).items():
        assert hashlib.sha256((out / file).read_bytes()).hexdigest() == digest
    with safe_open(str(out / files[0]), "pt") as shard:
        assert shard.metadata() == {"format": "pt"}  # transformers refuses shards without it
    assert not list(tmp_path.glob(".hf.convert-*"))  # the staging directory became the export


def test_ray_tasks_write_the_same_bytes_as_threads_and_report_errors_typed(dense_tp2, tmp_path, ray_session):
    on_ray = ExportOptions(**{**TIGHT.__dict__, "backend": "ray"})
    export_to_hf(dense_tp2, tmp_path / "threads", TIGHT)
    export_to_hf(dense_tp2, tmp_path / "ray", on_ray)
    assert manifest(tmp_path / "ray") == manifest(tmp_path / "threads")
    broken = tmp_path / "broken"
    shutil.copytree(dense_tp2, broken)
    victim = sorted(broken.glob("*.distcp"))[0]
    victim.write_bytes(b"\0" * victim.stat().st_size)
    with pytest.raises(CheckpointReadError, match=f"shard file {victim.name} is corrupt"):
        export_to_hf(broken, tmp_path / "broken_hf", on_ray)  # raised in a Ray worker, typed here


_KILLED_AFTER_FIRST_SHARD = textwrap.dedent("""
    import os, sys
    from rollmesh.checkpoint.megatron_export import ExportOptions, export_to_hf

    def progress(done, total):
        if done:  # the first shard is durable: die as a SIGKILL would, with the rest mid-flight
            os._exit(17)

    export_to_hf(sys.argv[1], sys.argv[2], ExportOptions(memory_budget_bytes=300_000, workers=2,
                                                         max_shard_bytes=1 << 30), progress=progress)
""")


def test_a_conversion_killed_midway_resumes_on_rerun_and_gives_the_same_export(dense_tp2, tmp_path):
    out = tmp_path / "hf"
    killed = subprocess.run([sys.executable, "-c", _KILLED_AFTER_FIRST_SHARD, str(dense_tp2), str(out)],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert killed.returncode == 17, killed.stderr
    assert not out.exists()  # nothing half-published
    (staging,) = tmp_path.glob(".hf.convert-*")
    finished_before = sorted(p.name for p in staging.glob("model-*.safetensors"))
    assert finished_before
    seen: list[int] = []
    export_to_hf(dense_tp2, out, TIGHT, progress=lambda done, total: seen.append(done))
    assert seen[0] > 0  # the rerun started from the shards the killed run had finished
    export_to_hf(dense_tp2, tmp_path / "clean", TIGHT)
    assert manifest(out) == manifest(tmp_path / "clean")
    assert not staging.exists()


def test_a_budget_that_cannot_hold_a_tensor_is_refused_before_anything_is_written(dense_tp2, tmp_path):
    with pytest.raises(TaskTooLargeError, match="linear_qkv.weight: converting it holds 65536 bytes"):
        export_to_hf(dense_tp2, tmp_path / "hf", ExportOptions(memory_budget_bytes=50_000, workers=1))
    assert list(tmp_path.iterdir()) == []


def test_a_corrupt_shard_fails_naming_the_file_and_publishes_nothing(dense_tp2, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(dense_tp2, broken)
    victim = sorted(broken.glob("*.distcp"))[0]
    victim.write_bytes(b"\0" * victim.stat().st_size)
    with pytest.raises(CheckpointReadError, match=f"shard file {victim.name} is corrupt"):
        export_to_hf(broken, tmp_path / "hf", TIGHT)
    assert not (tmp_path / "hf").exists()


def test_two_converters_never_share_one_staging_directory(dense_tp2, tmp_path):
    source = inspect_source(dense_tp2)
    spec = source.model.spec
    entered = []

    def second_writer(done: int, total: int) -> None:
        if not entered:
            entered.append(True)
            with pytest.raises(CheckpointWriteError, match="another conversion is writing"):
                convert_planned(source.folder, tmp_path / "hf", spec, config={}, max_shard_bytes=1 << 30,
                                memory_budget_bytes=1 << 30)

    convert_planned(source.folder, tmp_path / "hf", spec, config={}, max_shard_bytes=1 << 30,
                    memory_budget_bytes=1 << 30, progress=second_writer)
    assert entered and (tmp_path / "hf" / INDEX_FILE).is_file()


async def test_the_resharder_converts_a_saved_megatron_checkpoint(dense_tp2, whole_export, tmp_path):
    resharder = ResharderLogic(ResharderConfig(max_shard_bytes=1 << 30, convert_workers=2),
                                    export_root=tmp_path / "exports")
    saved = CheckpointSaved(step=7, weight_version=3, path=str(dense_tp2), format="megatron_torch_dist")
    converted = await resharder.handle_checkpoint_saved(saved)
    assert (converted.step, converted.weight_version, converted.source_path) == (7, 3, str(dense_tp2))
    assert_same_tensors(Path(converted.hf_path), whole_export)
    assert await resharder.handle_checkpoint_saved(saved) == converted  # a redelivery reuses the export


def test_per_layer_keys_and_args_inside_the_checkpoint_convert_to_the_same_model(dense_tp2, whole_export, tmp_path):
    """Megatron's other torch_dist flavours: a key per layer (``decoder.layers.N.*``) rather than
    layer-stacked tensors, and the common state (``args``) saved inside the checkpoint rather
    than in common.pt (Megatron-LM's torch_dcp format)."""
    import re

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(dense_tp2, tmp_path / "whole.pt")
    stacked = torch.load(tmp_path / "whole.pt", weights_only=False)
    per_layer: dict[str, object] = {}
    for name, value in stacked.items():
        if not isinstance(value, torch.Tensor):
            continue  # _extra_state bytes
        match = re.match(r"^decoder\.layers\.(?!\d+\.)(.+)$", name)
        if match is None:
            per_layer[name] = value
        else:
            per_layer.update({f"decoder.layers.{layer}.{match.group(1)}": value[layer].clone()
                              for layer in range(value.shape[0])})
    per_layer["args"] = torch.load(dense_tp2 / "common.pt", weights_only=False)["args"]
    flavour = tmp_path / "per_layer"
    dcp.save(per_layer, checkpoint_id=str(flavour), no_dist=True)
    assert not (flavour / "common.pt").exists()
    export_to_hf(flavour, tmp_path / "hf", ExportOptions(workers=2))
    assert_same_tensors(tmp_path / "hf", whole_export)


async def test_the_resharder_actor_answers_checkpoint_saved_on_nats_converted_or_failed(dense_tp2, mesh):
    """Through the running mesh: a Megatron checkpoint saved -> CheckpointConverted; one that is
    not there -> CheckpointConversionFailed with the reason, once (no retry loop)."""
    import asyncio

    import nats

    from rollmesh.messages.subjects import CHECKPOINT_CONVERTED, CHECKPOINT_FAILED, CHECKPOINT_SAVED

    namespace = mesh.namespace
    nc = await nats.connect(mesh.info.nats_url)
    converted: asyncio.Queue = asyncio.Queue()
    failed: asyncio.Queue = asyncio.Queue()
    try:
        async def on_converted(msg) -> None:
            converted.put_nowait(CHECKPOINT_CONVERTED.decode(msg.data))

        async def on_failed(msg) -> None:
            failed.put_nowait(CHECKPOINT_FAILED.decode(msg.data))

        await nc.subscribe(CHECKPOINT_CONVERTED.format(namespace), cb=on_converted)
        await nc.subscribe(CHECKPOINT_FAILED.format(namespace), cb=on_failed)
        missing = dense_tp2.parent / "not_saved_yet"
        for step, path in ((9001, dense_tp2), (9002, missing)):
            saved = CheckpointSaved(step=step, weight_version=step, path=str(path), format="megatron_torch_dist")
            await nc.jetstream().publish(CHECKPOINT_SAVED.format(namespace), CHECKPOINT_SAVED.encode(saved))
        done = await asyncio.wait_for(converted.get(), timeout=120)
        assert done.step == 9001 and (Path(done.hf_path) / INDEX_FILE).is_file()
        refused = await asyncio.wait_for(failed.get(), timeout=60)
        assert (refused.step, refused.error_type) == (9002, "CheckpointReadError")
        assert "no such checkpoint directory" in refused.reason and str(missing) in refused.reason
        await asyncio.sleep(2.0)
        assert failed.empty() and converted.empty()  # answered once each, not retried
    finally:
        await nc.close()
