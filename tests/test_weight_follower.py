"""``WeightFollower``: one inference worker following the trainer's weight versions, with real
weight files, an engine faked at its staging seam and a recording bus."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from support.fakes import RecordingPublisher, StagingEngine
from rollmesh.engine.errors import WeightsChecksumError
from rollmesh.engine.weight_follower import WeightFollower
from rollmesh.engine.weights import save_weights
from rollmesh.messages import WeightsPublished
from rollmesh.messages.subjects import WEIGHTS_ACTIVATED

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

WAIT_S = 10.0  # a guard against a hang, never a timing assertion


def weights_file(tmp_path: Path, version: int) -> tuple[WeightsPublished, dict[str, torch.Tensor]]:
    tensors = {"embed.weight": torch.full((4, 3), float(version)), "head.bias": torch.arange(3.0) + version}
    path = tmp_path / f"v{version:06d}.safetensors"
    sha256, num_bytes = save_weights(tensors, path)
    return WeightsPublished(version=version, path=str(path), sha256=sha256, num_bytes=num_bytes), tensors


def follower(engine: StagingEngine, bus: RecordingPublisher) -> WeightFollower:
    return WeightFollower(engine, bus, worker="decode-0", role="decode", clock=lambda: 123.0)


async def test_a_newer_version_is_loaded_staged_and_announced_once_active(tmp_path):
    engine, bus = StagingEngine(current_version=0, in_flight=3), RecordingPublisher()
    message, tensors = weights_file(tmp_path, 1)
    await follower(engine, bus).handle_weights_published(message)

    ((version, staged),) = engine.staged
    assert version == 1
    assert staged.keys() == tensors.keys() and all(torch.equal(staged[k], tensors[k]) for k in tensors)
    (activated,) = bus.messages(WEIGHTS_ACTIVATED)
    assert (activated.version, activated.worker, activated.role, activated.in_flight, activated.activated_at) == \
        (1, "decode-0", "decode", 3, 123.0)
    assert engine.current_version == 1


@pytest.mark.parametrize("version", [4, 5])
async def test_an_older_or_equal_version_is_ignored_without_reading_the_file(tmp_path, version):
    engine, bus = StagingEngine(current_version=5), RecordingPublisher()
    message = WeightsPublished(version=version, path=str(tmp_path / "missing.safetensors"), sha256="0" * 64,
                               num_bytes=1)
    await follower(engine, bus).handle_weights_published(message)
    assert engine.staged == [] and bus.published == []


async def test_weights_activated_is_published_only_after_the_engine_activated_them(tmp_path):
    engine, bus = StagingEngine(), RecordingPublisher()
    engine.hold_activation()
    message, _ = weights_file(tmp_path, 1)
    handler = asyncio.create_task(follower(engine, bus).handle_weights_published(message))

    await asyncio.wait_for(engine.waiting.wait(), WAIT_S)
    assert [version for version, _ in engine.staged] == [1]
    assert bus.messages(WEIGHTS_ACTIVATED) == []

    engine.activate()
    await asyncio.wait_for(handler, WAIT_S)
    assert [m.version for m in bus.messages(WEIGHTS_ACTIVATED)] == [1]


async def test_a_burst_of_versions_is_staged_one_at_a_time_in_order(tmp_path):
    engine, bus = StagingEngine(), RecordingPublisher()
    engine.hold_activation()
    logic = follower(engine, bus)
    (first, _), (second, _) = weights_file(tmp_path, 1), weights_file(tmp_path, 2)
    handlers = [asyncio.create_task(logic.handle_weights_published(m)) for m in (first, second)]

    await asyncio.wait_for(engine.waiting.wait(), WAIT_S)
    assert [version for version, _ in engine.staged] == [1]  # v2 waits until v1 is live

    engine.activate()
    await asyncio.wait_for(asyncio.gather(*handlers), WAIT_S)
    assert [version for version, _ in engine.staged] == [1, 2]
    assert [m.version for m in bus.messages(WEIGHTS_ACTIVATED)] == [1, 2]


async def test_weights_the_engine_refuses_to_stage_are_not_announced(tmp_path):
    engine, bus = StagingEngine(accept=False), RecordingPublisher()
    message, _ = weights_file(tmp_path, 1)
    await follower(engine, bus).handle_weights_published(message)
    assert len(engine.staged) == 1 and bus.published == []
    assert engine.current_version == 0


async def test_a_file_that_does_not_match_its_checksum_is_never_staged(tmp_path):
    engine, bus = StagingEngine(), RecordingPublisher()
    message, _ = weights_file(tmp_path, 1)
    tampered = WeightsPublished(version=1, path=message.path, sha256="f" * 64, num_bytes=message.num_bytes)
    with pytest.raises(WeightsChecksumError):
        await follower(engine, bus).handle_weights_published(tampered)
    assert engine.staged == [] and bus.published == []


async def test_weights_activated_reports_the_source_and_the_engines_swap_pause(tmp_path):
    class TimedEngine(StagingEngine):
        last_swap_seconds = 0.004

    engine, bus = TimedEngine(), RecordingPublisher()
    message, _ = weights_file(tmp_path, 1)
    await follower(engine, bus).handle_weights_published(message)
    (activated,) = bus.messages(WEIGHTS_ACTIVATED)
    assert (activated.source, activated.pause_s) == ("files", 0.004)
