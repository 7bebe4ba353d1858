"""Fault injection on the whole mesh (real nats-server, real Ray, real sandboxes, real torch):
an actor SIGKILLed mid-run, or the NATS server restarted, while rollouts are in flight.

Each test submits train rollouts in GRPO groups of two whose tool call sleeps (so they are
mid-rollout when the fault strikes), injects the fault once the first tool runs, and then counts:
every request ends completed or typed-failed (read from the results stream, deduplicated by the
server), a request answered twice got the same answer twice (republished, not redone), every
trajectory lands in exactly one durable training step (the trainer's ledger), and the killed role
is serving again. Timers are the session mesh's short ones (tests/conftest.py).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import get_args

import nats
import pytest
import ray
from nats.js.api import ConsumerConfig, DeliverPolicy

from rollmesh.bus.streams import rollout_results_stream
from rollmesh.messages.rollout import FailureKind
from rollmesh.messages.subjects import ROLLOUT_REQUESTED

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

ROLLOUTS = 6  # three groups of two
TOOL_SLEEP_S = 1.5
RESULTS_TIMEOUT_S = 150.0
FAILURE_KINDS = set(get_args(FailureKind))


async def submit(nc, namespace: str, prefix: str) -> list[str]:
    ids = [f"{prefix}-{index}" for index in range(ROLLOUTS)]
    js = nc.jetstream()
    for index, rollout_id in enumerate(ids):
        request = {"rollout_id": rollout_id, "task": "slow_molar_mass", "group_id": f"{prefix}-g{index // 2}",
                   "task_input": {"formula": "NaCl", "tool_sleep_s": TOOL_SLEEP_S},
                   "sampling": {"temperature": 1.0, "max_new_tokens": 30}, "max_turns": 3}
        await js.publish(ROLLOUT_REQUESTED.format(namespace), json.dumps(request).encode())
    return ids


async def first_tool_call(nc, namespace: str) -> asyncio.Event:
    started = asyncio.Event()

    async def on_exec(msg) -> None:
        started.set()

    await nc.subscribe(f"rl.{namespace}.sandbox.exec", cb=on_exec)
    return started


async def results_of(nc, namespace: str, ids: list[str]) -> dict[str, list[dict]]:
    """Every result message in the results stream for ``ids`` (waits until each has one)."""
    js = nc.jetstream()
    durable = "recovery" + uuid.uuid4().hex[:8]
    pull = await js.pull_subscribe(f"rl.{namespace}.rollout.*", durable=durable,
                                   stream=rollout_results_stream(namespace),
                                   config=ConsumerConfig(deliver_policy=DeliverPolicy.ALL))
    wanted, found = set(ids), {rollout_id: [] for rollout_id in ids}
    deadline = time.monotonic() + RESULTS_TIMEOUT_S
    while any(not found[rollout_id] for rollout_id in ids):
        assert time.monotonic() < deadline, f"no result for {[i for i in ids if not found[i]]}"
        try:
            msgs = await pull.fetch(50, timeout=1.0)
        except (nats.errors.TimeoutError, asyncio.TimeoutError):
            continue
        except nats.errors.Error:  # the server is restarting: ask again
            await asyncio.sleep(0.2)
            continue
        for msg in msgs:
            try:
                body = json.loads(msg.data)
            except ValueError:  # malformed bytes another test published into the stream
                body = {}
            if isinstance(body, dict) and body.get("rollout_id") in wanted:
                found[body["rollout_id"]].append(body)
            await msg.ack()
    return found


def ledger_keys(run_dir: Path) -> list[str]:
    path = run_dir / "trainer" / "ledger.jsonl"
    keys = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            keys.extend(json.loads(line)["keys"])
        except (ValueError, KeyError):
            continue
    return keys


async def wait_trained(run_dir: Path, ids: list[str], timeout_s: float = 90.0) -> Counter:
    """How many durable training steps consumed each of ``ids`` (waits until each is in one)."""
    deadline = time.monotonic() + timeout_s
    while True:
        counts = Counter(key for key in ledger_keys(run_dir) if key in set(ids))
        if set(counts) == set(ids):
            return counts
        assert time.monotonic() < deadline, f"not in a durable step: {set(ids) - set(counts)}"
        await asyncio.sleep(0.25)


async def sigkill(mesh, name: str) -> int:
    actor = ray.get_actor(name, namespace=mesh.mesh.ray_namespace)
    pid = await actor.pid.remote()
    os.kill(pid, signal.SIGKILL)
    return pid


async def wait_serving_again(mesh, name: str, old_pid: int, timeout_s: float = 90.0) -> None:
    actor = ray.get_actor(name, namespace=mesh.mesh.ray_namespace)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if await asyncio.wait_for(actor.ready.remote(), 5) and await actor.pid.remote() != old_pid:
                return
        except Exception:  # still restarting
            pass
        assert time.monotonic() < deadline, f"{name} was not restarted and started again"
        await asyncio.sleep(0.25)


def assert_each_ended_once(results: dict[str, list[dict]]) -> None:
    for rollout_id, answers in results.items():
        assert answers, rollout_id
        assert len(answers) == 1, f"{rollout_id} got {len(answers)} results in the stream"
        (result,) = answers
        assert result["type"] in ("rollout.completed", "rollout.failed"), result
        if result["type"] == "rollout.failed":
            assert result["kind"] in FAILURE_KINDS and result["reason"], result


async def run_with_fault(mesh, prefix: str, inject) -> dict[str, list[dict]]:
    nc = await nats.connect(mesh.info.nats_url, max_reconnect_attempts=-1, reconnect_time_wait=0.2)
    try:
        started = await first_tool_call(nc, mesh.namespace)
        ids = await submit(nc, mesh.namespace, f"{prefix}-{uuid.uuid4().hex[:6]}")
        await asyncio.wait_for(started.wait(), 60)
        await inject()
        results = await results_of(nc, mesh.namespace, ids)
    finally:
        await nc.close()
    assert_each_ended_once(results)
    counts = await wait_trained(mesh.mesh.run_dir, ids)
    assert all(count == 1 for count in counts.values()), f"trained twice: {counts}"
    return results


@pytest.mark.parametrize("victim", ["rollout-worker-0", "decode-0", "sandbox-broker", "trainer"])
async def test_an_actor_killed_mid_run_loses_nothing_and_trains_nothing_twice(tool_calling_mesh, victim):
    mesh = tool_calling_mesh
    killed: list[int] = []

    async def inject() -> None:
        killed.append(await sigkill(mesh, victim))

    results = await run_with_fault(mesh, victim.split("-")[0], inject)
    await wait_serving_again(mesh, victim, killed[0])
    completed = [r for (r,) in results.values() if r["type"] == "rollout.completed"]
    if victim == "rollout-worker-0":
        # Its requests were redelivered to the restarted worker, which took them over.
        assert completed and any(r["attempts"] >= 2 for r in completed), results


async def test_a_nats_server_restarted_mid_run_loses_nothing(tool_calling_mesh, nats_server):
    mesh = tool_calling_mesh

    async def inject() -> None:
        await asyncio.to_thread(nats_server.restart, kill=True)

    results = await run_with_fault(mesh, "nats", inject)
    assert any(r["type"] == "rollout.completed" for (r,) in results.values()), results


# The command a rollout's tool runs while its broker is killed (the 20 s shows nothing
# 5 s does not: the command outlives the broker either way).
BROKER_KILL_TOOL_S = float(os.environ.get("ROLLMESH_TEST_BROKER_KILL_TOOL_S", "5"))


async def test_a_broker_killed_mid_tool_call_leaves_the_rollout_running_in_its_sandbox(tool_calling_mesh):
    """SIGKILL the sandbox broker while a rollout's tool runs: the node's supervisor keeps the
    sandbox and its command, the restarted broker re-adopts the lease from KV, and the rollout's
    exec, retried with its exec_id, attaches to the command. The rollout completes in the same
    sandbox: no infrastructure failure, no second attempt, the tool's answer in its text."""
    mesh = tool_calling_mesh
    nc = await nats.connect(mesh.info.nats_url, max_reconnect_attempts=-1, reconnect_time_wait=0.2)
    try:
        started = await first_tool_call(nc, mesh.namespace)
        rollout_id = f"outlive-{uuid.uuid4().hex[:6]}"
        request = {"rollout_id": rollout_id, "task": "slow_molar_mass", "group_id": f"{rollout_id}-g",
                   "task_input": {"formula": "NaCl", "tool_sleep_s": BROKER_KILL_TOOL_S},
                   "sampling": {"temperature": 0.0, "max_new_tokens": 30}, "max_turns": 3}
        await nc.jetstream().publish(ROLLOUT_REQUESTED.format(mesh.namespace), json.dumps(request).encode())
        await asyncio.wait_for(started.wait(), 60)
        killed = await sigkill(mesh, "sandbox-broker")
        (result,) = (await results_of(nc, mesh.namespace, [rollout_id]))[rollout_id]
    finally:
        await nc.close()
    assert result["type"] == "rollout.completed", result
    # (Fields at their default value are left out of the JSON: 0 failures, 1 attempt.)
    assert (result.get("infra_failures", 0), result.get("attempts", 1)) == (0, 1), result
    assert "58.44" in result["text"], result["text"]  # NaCl's molar mass, as the tool printed it
    await wait_serving_again(mesh, "sandbox-broker", killed)
    broker = ray.get_actor("sandbox-broker", namespace=mesh.mesh.ray_namespace)
    counts = (await broker.stats.remote())["logic"]["counts"]
    assert counts.get("leases_adopted", 0) >= 1 and counts.get("leases_granted", 0) == 0, counts
