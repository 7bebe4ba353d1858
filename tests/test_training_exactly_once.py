"""Exactly-once into training across trainer restarts: the ledger, and a trainer rebuilt on the
same run directory (what a killed and restarted trainer actor does) with the real torch backend.

A "crash" here is a trainer object dropped mid-way: what it had not made durable (its ledger line)
is gone, what it had is read back by its successor."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import msgspec
import pytest
import torch

from support.fakes import RecordingPublisher
from rollmesh.engine.weight_buckets import load_published
from rollmesh.messages.subjects import TRAINER_STEPPED, WEIGHTS_PUBLISHED
from rollmesh.training.ledger import LedgerEntry, TrainingLedger
from rollmesh.config import ModelConfig
from test_training_trainer_logic import STEP_TIMEOUT_S, build_trainer, completed, context, deliver, failed

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


@pytest.fixture
def trainer(demo_model_dir: Path):
    """``trainer(run_dir, bus, **trainer_config)``: a TrainerLogic on the demo model; the same run
    directory again is what a restarted trainer actor gets."""
    return lambda run_dir, bus, **config: build_trainer(run_dir, bus, ModelConfig(path=str(demo_model_dir)), **config)


def test_ledger_reads_back_every_consumed_key_and_ignores_a_line_torn_by_a_crash(tmp_path):
    ledger = TrainingLedger(tmp_path / "ledger.jsonl")
    assert ledger.read() is None
    ledger.append(LedgerEntry(step=1, weight_version=1, weights_path="w1", keys=["a", "b"]))
    ledger.append(LedgerEntry(step=2, weight_version=2, weights_path="w2", keys=["c"]))
    with open(ledger.path, "a") as handle:
        handle.write('{"step": 3, "weight_ver')  # killed mid-write
    state = ledger.read()
    assert (state.last.step, state.last.weights_path, state.consumed) == (2, "w2", frozenset("abc"))

    ledger.append(LedgerEntry(step=3, weight_version=3, weights_path="w3", keys=["d"]))
    state = ledger.read()
    assert state.last.step == 3 and state.consumed == frozenset("abcd") and state.entries == 3


async def test_a_restarted_trainer_resumes_from_the_last_durable_step_and_never_retrains_its_trajectories(tmp_path, trainer):
    bus = RecordingPublisher()
    first = trainer(tmp_path, bus)
    await first.start()
    await deliver(first, completed("a", "g1", 1.0), completed("b", "g1", 0.0))
    (published,) = bus.messages(WEIGHTS_PUBLISHED)
    trained_weights = load_published(published.path)

    # The trainer dies after its step's ledger line: its successor gets the same two trajectories
    # again (never acked) and one new group.
    bus2 = RecordingPublisher()
    second = trainer(tmp_path, bus2)
    await second.start()
    assert (second.step, second.version) == (1, 1)
    for name, tensor in second.backend.state_dict().items():
        assert torch.equal(tensor, trained_weights[name]), f"{name} was not restored"
    # Announced again from the ledger, which keeps where the version is, not how long it took.
    again = msgspec.structs.replace(published, gather_s=0.0, write_s=0.0)
    assert bus2.messages(WEIGHTS_PUBLISHED) == [again], "the last version is announced again"

    results = await deliver(second, completed("a", "g1", 1.0), completed("b", "g1", 0.0))
    assert results == [None, None], "redelivered and acked"
    assert second.step == 1 and second.stats()["duplicates"] == 2
    await deliver(second, completed("c", "g2", 1.0), completed("d", "g2", 0.0, version=1))
    assert second.step == 2 and second.version == 2
    (stepped,) = bus2.messages(TRAINER_STEPPED)
    assert stepped.num_samples == 2
    assert stepped.generation_lag_histogram == {0: 1, 1: 1} and stepped.max_generation_lag == 1, (
        "the lag distribution of the step's trajectories is reported")

    keys = [key for line in (tmp_path / "trainer" / "ledger.jsonl").read_text().splitlines()
            for key in json.loads(line)["keys"]]
    assert sorted(keys) == ["a", "b", "c", "d"], "each trajectory in exactly one durable step"


async def test_trajectories_of_a_step_lost_with_the_trainer_are_trained_again_exactly_once(tmp_path, trainer):
    bus = RecordingPublisher()
    first = trainer(tmp_path, bus, n_samples_per_prompt=3)
    await first.start()
    # Two of a group of three arrive; the trainer dies before the group (and so the step) exists.
    waiting = [asyncio.create_task(first.handle_completed(m, context()))
               for m in (completed("a", "g", 1.0), completed("b", "g", 0.0))]
    await asyncio.sleep(0)
    for task in waiting:
        task.cancel()
    await asyncio.gather(*waiting, return_exceptions=True)
    assert not (tmp_path / "trainer" / "ledger.jsonl").exists()

    bus2 = RecordingPublisher()
    second = trainer(tmp_path, bus2, n_samples_per_prompt=3)
    await second.start()
    assert second.step == 0
    await asyncio.wait_for(deliver(second, completed("a", "g", 1.0), completed("b", "g", 0.0),
                                   failed("c", "g")), STEP_TIMEOUT_S)
    (stepped,) = bus2.messages(TRAINER_STEPPED)
    assert (stepped.step, stepped.num_samples) == (1, 2), "the failed member is masked out of the group"
    assert TrainingLedger(tmp_path / "trainer" / "ledger.jsonl").read().consumed == {"a", "b", "c"}


async def test_the_idempotency_key_not_the_rollout_id_decides_what_counts_as_a_repeat(tmp_path, trainer):
    bus = RecordingPublisher()
    logic = trainer(tmp_path, bus)
    first = completed("a", "g", 1.0)
    again = msgspec.structs.replace(first, idempotency_key="a")
    other = msgspec.structs.replace(completed("a2", "g", 0.0), idempotency_key="k2")
    await deliver(logic, first, again, other)
    assert logic.stats()["duplicates"] == 1 and logic.step == 1
    assert TrainingLedger(tmp_path / "trainer" / "ledger.jsonl").read().consumed == {"a", "k2"}



async def test_a_trainer_restarted_from_a_checkpointed_step_trains_the_next_step_bit_for_bit_as_if_never_stopped(tmp_path, trainer):
    """Exact resume: weights, optimizer moments and step counts, RNG, version and the data cursor.
    The run directory is copied right after step 1 (the process dies there), the original trains
    on, and the copy is restarted: its step 2 must equal the original's bit for bit. Without the
    saved training state the same restart gives different weights (fresh moments)."""
    import shutil

    original = trainer(tmp_path / "run", RecordingPublisher(), checkpoint_every=1)
    await original.start()
    await deliver(original, completed("a", "g1", 1.0), completed("b", "g1", 0.0))
    for exact in (True, False):  # the run directory as the dying process left it
        shutil.copytree(tmp_path / "run", tmp_path / f"died_{exact}")
        state_file = tmp_path / f"died_{exact}" / "checkpoints" / "step_00000001.trainer_state.pt"
        assert state_file.is_file()
        if not exact:
            state_file.unlink()
    second_step = (completed("c", "g2", 0.0), completed("d", "g2", 1.0))
    await deliver(original, *second_step)
    expected = original.backend.state_dict()

    for exact in (True, False):
        restarted = trainer(tmp_path / f"died_{exact}", RecordingPublisher(), checkpoint_every=1)
        await restarted.start()
        assert (restarted.step, restarted.version) == (1, 1)
        assert await deliver(restarted, completed("a", "g1", 1.0), completed("b", "g1", 0.0)) == [None, None]
        await deliver(restarted, *second_step)
        resumed = restarted.backend.state_dict()
        same = all(torch.equal(resumed[name], expected[name]) for name in expected)
        assert same is exact, "exact resume" if exact else "the test can tell a fresh optimizer apart"
