"""Drain and resume: a mesh stopped while rollouts are in flight (what `rollmesh down` does) and
started again on its run directory with its saved config (what `rollmesh up --resume` does).

A second mesh on the session's NATS and Ray, in its own namespace and run directory. Its trainer
starts from the session mesh's warm-started weights through a ledger line (the way any resumed
trainer starts), so its model calls the gated calculator and the rollouts park there.
"""

from __future__ import annotations

import asyncio
import json
import uuid

import msgspec
import nats
import pytest

from rollmesh.bus.rollout_states import KvRolloutStates
from rollmesh.bus.streams import rollout_requests_stream
from rollmesh.config import load_run_config
from rollmesh.engine.weight_buckets import load_published
from rollmesh.engine.weights import save_weights
from rollmesh.launcher import Mesh
from rollmesh.mesh_address import new_run_dir
from rollmesh.messages.subjects import ROLLOUT_REQUESTED
from rollmesh.training.ledger import LedgerEntry, TrainingLedger
from conftest import REPO_ROOT
from test_mesh_recovery import ledger_keys, results_of, wait_trained

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

ROLLOUTS = 4


async def test_a_drained_mesh_resumes_its_in_flight_rollouts_and_trains_each_once(tool_calling_mesh):
    session = tool_calling_mesh
    run_dir = new_run_dir(REPO_ROOT / ".rollmesh" / "test-runs")
    latest = sorted((session.mesh.run_dir / "weights").glob("v*/manifest.json"))[-1]
    weights = run_dir / "weights" / "v000001.safetensors"
    sha256, size = save_weights(load_published(latest), weights)
    TrainingLedger(run_dir / "trainer" / "ledger.jsonl").append(LedgerEntry(
        step=0, weight_version=1, weights_path=str(weights), sha256=sha256, num_bytes=size))
    gate = session.gate_dir / uuid.uuid4().hex
    # The session mesh holds every declared accelerator: this one asks for none.
    config = msgspec.structs.replace(
        session.config, namespace="resume" + uuid.uuid4().hex[:8],
        scheduler=msgspec.structs.replace(session.config.scheduler, total_gpus=0, grants={}))
    namespace = config.namespace
    ids = [f"drain-{index}" for index in range(ROLLOUTS)]

    first = Mesh(config, run_dir=run_dir)
    info = await first.start()
    nc = await nats.connect(info.nats_url)
    try:
        parked = asyncio.Event()
        execs: set[str] = set()

        async def on_exec(msg) -> None:
            execs.add(msg.reply)
            if len(execs) >= ROLLOUTS:
                parked.set()

        await nc.subscribe(f"rl.{namespace}.sandbox.exec", cb=on_exec)
        for index, rollout_id in enumerate(ids):
            request = {"rollout_id": rollout_id, "task": "gated_molar_mass", "group_id": f"g{index // 2}",
                       "task_input": {"formula": "KCl", "gate": str(gate)},
                       "sampling": {"temperature": 0.0, "max_new_tokens": 30}, "max_turns": 2}
            await nc.jetstream().publish(ROLLOUT_REQUESTED.format(namespace), json.dumps(request).encode())
        await asyncio.wait_for(parked.wait(), 60)  # every rollout waits on its tool: drain now
    finally:
        await nc.close()
    await first.stop()

    # Drained: nothing answered, nothing trained, every request back in the work queue and every
    # rollout's state saved.
    assert not set(ledger_keys(run_dir)) & set(ids)
    resumed = Mesh(load_run_config(run_dir), run_dir=run_dir)
    info = await resumed.start()
    nc = await nats.connect(info.nats_url)
    try:
        js = nc.jetstream()
        states = KvRolloutStates(js, namespace)
        saved = [await states.load(rollout_id) for rollout_id in ids]
        assert all(state is not None and state.outcome is None for state in saved), [
            (state.rollout_id, state.turn, state.attempts, state.outcome) if state else None for state in saved]
        assert (await js.stream_info(rollout_requests_stream(namespace))).state.messages >= 1
        gate.touch()
        results = await results_of(nc, namespace, ids)
        done = [await states.load(rollout_id) for rollout_id in ids]
    finally:
        await nc.close()
    try:
        assert all(len(answers) == 1 and answers[0]["type"] == "rollout.completed"
                   for answers in results.values()), results
        assert all(answers[0]["attempts"] >= 2 for answers in results.values()), "resumed, not new"
        assert all(state.outcome is not None for state in done)
        counts = await wait_trained(run_dir, ids)
        assert set(counts.values()) == {1}, counts
    finally:
        await resumed.stop()

