"""The whole mesh on a real nats-server and a real local Ray: the issue's end-to-end promises.

One session-scoped mesh (tests/conftest.py ``mesh``) serves every test here; each test uses its
own rollout ids. Model behaviour that needs tool calls comes from a short supervised warm start
done once (``tool_calling_mesh``, in conftest).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from pathlib import Path

import nats
import pytest
import ray

from rollmesh.chat import ChatModel
from rollmesh.engine.weight_buckets import load_published
from rollmesh.engine.weights import save_weights
from rollmesh.messages import WeightsPublished
from rollmesh.messages.subjects import (
    DEAD_LETTERED,
    GPU_GRANTED,
    ROLLOUT_COMPLETED,
    ROLLOUT_FAILED,
    ROLLOUT_REQUESTED,
    WEIGHTS_ACTIVATED,
    WEIGHTS_PUBLISHED,
)
from rollmesh.rollout.molar_mass import MolarMassTask

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

# How long a test waits for the mesh to do one thing (a rollout, a weight swap): generous, since a
# loaded 2-core machine can take minutes where an idle one takes seconds. ROLLMESH_TEST_WAIT_S sets it.
WAIT_S = float(os.environ.get("ROLLMESH_TEST_WAIT_S", "180"))


class ResultWatcher:
    """Collects completions and failures by rollout id, from a plain core subscription."""

    def __init__(self) -> None:
        self.results: dict[str, dict] = {}
        self._arrived = asyncio.Event()

    async def subscribe(self, nc, namespace: str) -> None:
        for subject in (ROLLOUT_COMPLETED, ROLLOUT_FAILED):
            await nc.subscribe(subject.format(namespace), cb=self._on_message)

    async def _on_message(self, msg) -> None:
        body = json.loads(msg.data)
        self.results[body["rollout_id"]] = body
        self._arrived.set()

    async def wait(self, rollout_id: str, timeout: float = WAIT_S) -> dict:
        async def arrived() -> dict:
            while rollout_id not in self.results:
                self._arrived.clear()
                await self._arrived.wait()
            return self.results[rollout_id]

        return await asyncio.wait_for(arrived(), timeout)


async def test_bare_nats_client_request_comes_back_completed(mesh) -> None:
    """A client with nothing but nats-py and JSON gets a completed rollout back."""
    nc = await nats.connect(mesh.info.nats_url)
    try:
        watcher = ResultWatcher()
        await watcher.subscribe(nc, mesh.namespace)
        rollout_id = "bare-" + uuid.uuid4().hex[:8]
        request = {"rollout_id": rollout_id, "task": "molar_mass", "task_input": {"formula": "H2O"},
                   "sampling": {"temperature": 1.0, "max_new_tokens": 24}}
        await nc.jetstream().publish(f"rl.{mesh.namespace}.rollout.requested", json.dumps(request).encode())
        result = await watcher.wait(rollout_id)
    finally:
        await nc.close()
    assert result["type"] == "rollout.completed", result
    tokens = result["trajectory"]  # a TokenTrace: short rollouts carry it inline
    assert len(tokens["ids"]) == len(tokens["loss_mask"]) == len(tokens["versions"]) == len(tokens["logprobs"])
    # The prompt is the task's messages and tools rendered by the model's own chat template,
    # tokenized once by its own tokenizer.
    chat, task = ChatModel.from_config(mesh.config.model), MolarMassTask()
    prompt = chat.render(task.messages({"formula": "H2O"}), tools=task.tools(), add_generation_prompt=True)
    assert "H2O" in prompt and tokens["ids"][: result["prompt_len"]] == chat.encode(prompt)
    assert all(v == -1 for v in tokens["versions"][: result["prompt_len"]])
    assert any(tokens["loss_mask"]) and result["reward"] in (0.0, 1.0)


async def test_unknown_task_gets_a_typed_failure(mesh) -> None:
    nc = await nats.connect(mesh.info.nats_url)
    try:
        watcher = ResultWatcher()
        await watcher.subscribe(nc, mesh.namespace)
        rollout_id = "unknown-" + uuid.uuid4().hex[:8]
        body = {"rollout_id": rollout_id, "task": "no_such_task"}
        await nc.jetstream().publish(f"rl.{mesh.namespace}.rollout.requested", json.dumps(body).encode())
        result = await watcher.wait(rollout_id)
    finally:
        await nc.close()
    assert result["type"] == "rollout.failed"
    assert result["kind"] == "unknown_task" and "no_such_task" in result["reason"]


async def subscribed_subjects(mesh) -> set[str]:
    templates: set[str] = set()
    for actor in mesh.mesh.actors.values():
        templates |= set((await actor.stats.remote())["subjects"])
    return templates


async def test_malformed_bytes_on_every_subscribed_subject_are_dead_lettered(mesh) -> None:
    templates = await subscribed_subjects(mesh)
    assert {ROLLOUT_REQUESTED.template, WEIGHTS_PUBLISHED.template} <= templates
    nc = await nats.connect(mesh.info.nats_url)
    js = nc.jetstream()
    dead: dict[str, dict] = {}
    all_in = asyncio.Event()

    async def on_dead_letter(msg) -> None:
        body = json.loads(msg.data)
        dead[body["subject"]] = body
        if len(dead) >= len(templates):
            all_in.set()

    try:
        await nc.subscribe(DEAD_LETTERED.format(mesh.namespace), cb=on_dead_letter)
        for template in sorted(templates):
            subject = template.format(ns=mesh.namespace)
            garbage = b"\xff\x00not a message" + template.encode()
            if subject.endswith(("requested", "completed", "failed", "saved")):
                await js.publish(subject, garbage)  # captured by a stream: arrives via JetStream
            else:
                await nc.publish(subject, garbage)
        await asyncio.wait_for(all_in.wait(), WAIT_S)
        assert set(dead) == {t.format(ns=mesh.namespace) for t in templates}
        assert all(body["reason"] for body in dead.values())
    finally:
        await nc.close()
    # Every actor kept serving: a normal rollout still completes end to end.
    await test_bare_nats_client_request_comes_back_completed(mesh)


async def test_weight_update_mid_rollout_keeps_the_rollout_and_both_versions(tool_calling_mesh) -> None:
    mesh = tool_calling_mesh
    trainer = ray.get_actor("trainer", namespace=mesh.mesh.ray_namespace)
    old_version = await trainer.version.remote()
    gate = mesh.gate_dir / uuid.uuid4().hex
    nc = await nats.connect(mesh.info.nats_url)
    try:
        watcher = ResultWatcher()
        await watcher.subscribe(nc, mesh.namespace)
        tool_started = asyncio.Event()

        async def on_exec(msg) -> None:
            tool_started.set()

        await nc.subscribe(f"rl.{mesh.namespace}.sandbox.exec", cb=on_exec)
        activated: set[str] = set()
        new_version = old_version + 100
        all_activated = asyncio.Event()

        async def on_activated(msg) -> None:
            event = WEIGHTS_ACTIVATED.decode(msg.data)
            if event.version == new_version:
                activated.add(event.worker)
                if len(activated) == 2:  # one prefill and one decode worker
                    all_activated.set()

        await nc.subscribe(WEIGHTS_ACTIVATED.format(mesh.namespace), cb=on_activated)
        rollout_id = "swap-" + uuid.uuid4().hex[:8]
        request = {"rollout_id": rollout_id, "task": "gated_molar_mass",
                   "task_input": {"formula": "NaCl", "gate": str(gate)},
                   "sampling": {"temperature": 0.0, "max_new_tokens": 30}, "max_turns": 2}
        await nc.jetstream().publish(ROLLOUT_REQUESTED.format(mesh.namespace), json.dumps(request).encode())
        # The first turn has been generated and its tool is parked on the gate: swap weights now.
        # (A rollout that ends without running its tool fails here with its result, not a timeout.)
        started = asyncio.create_task(tool_started.wait())
        ended = asyncio.create_task(watcher.wait(rollout_id))
        await asyncio.wait({started, ended}, timeout=WAIT_S, return_when=asyncio.FIRST_COMPLETED)
        ended.cancel()
        assert started.done(), (f"no tool call within {WAIT_S:g} s; the rollout's result: "
                                f"{watcher.results.get(rollout_id, 'none yet')}")
        # The same (warm-started) weights under a new version: the tokens' versions must show
        # the swap, and the model keeps behaving for the tests that follow.
        latest = sorted((mesh.run_dir / "weights").glob("v*/manifest.json"))[-1]
        path = mesh.run_dir / "weights" / f"test-v{new_version}.safetensors"
        sha256, size = save_weights(load_published(latest), path)
        await nc.publish(WEIGHTS_PUBLISHED.format(mesh.namespace), WEIGHTS_PUBLISHED.encode(
            WeightsPublished(version=new_version, path=str(path), sha256=sha256, num_bytes=size)))
        await asyncio.wait_for(all_activated.wait(), WAIT_S)
        gate.touch()
        result = await watcher.wait(rollout_id)
    finally:
        await nc.close()
    assert result["type"] == "rollout.completed", result
    generated = [v for v in result["trajectory"]["versions"] if v != -1]
    assert result["turns"] == 2 and result["tool_calls"] >= 1
    assert generated == sorted(generated)
    assert {old_version, new_version} <= set(generated)


def read_spans(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


async def test_turn_spans_share_a_trace_across_actors_and_link_to_the_rollout(tool_calling_mesh) -> None:
    mesh = tool_calling_mesh
    nc = await nats.connect(mesh.info.nats_url)
    try:
        watcher = ResultWatcher()
        await watcher.subscribe(nc, mesh.namespace)
        rollout_id = "trace-" + uuid.uuid4().hex[:8]
        request = {"rollout_id": rollout_id, "task": "molar_mass", "task_input": {"formula": "KCl"},
                   "sampling": {"temperature": 0.0, "max_new_tokens": 30}, "max_turns": 2}
        await nc.jetstream().publish(ROLLOUT_REQUESTED.format(mesh.namespace), json.dumps(request).encode())
        result = await watcher.wait(rollout_id)
    finally:
        await nc.close()
    assert result["type"] == "rollout.completed" and result["tool_calls"] >= 1, result
    traces = mesh.run_dir / "traces.jsonl"
    deadline = time.monotonic() + 20
    while True:  # spans are exported in batches by several processes
        spans = read_spans(traces)
        rollout = [s for s in spans if s["name"] == "rollout" and s["attributes"].get("rollout_id") == rollout_id]
        turns = [s for s in spans if s["name"] == "turn" and s["attributes"].get("rollout_id") == rollout_id]
        turn_traces = {t["trace_id"] for t in turns}
        services = {t: {s["service"] for s in spans if s["trace_id"] == t} for t in turn_traces}
        # The first turn is prefilled on the prefill worker; later turns extend the session's
        # KV on its decode worker, so their traces have no prefill span.
        if rollout and len(turns) == result["turns"] and all(
                {"decode-0", "rollout-worker-0"} <= svc for svc in services.values()) and any(
                "sandbox-broker" in svc for svc in services.values()) and sum(
                "prefill-0" in svc for svc in services.values()) == 1:
            break
        assert time.monotonic() < deadline, f"spans missing: {len(rollout)} rollout, {len(turns)} turns, {services}"
        await asyncio.sleep(0.2)
    rollout_span = rollout[0]
    assert len(turn_traces) == len(turns)  # one trace per turn
    assert rollout_span["trace_id"] not in turn_traces
    for turn in turns:
        assert turn["parent_span_id"] in (None, "")  # the root of its own trace
        assert {"trace_id": rollout_span["trace_id"], "span_id": rollout_span["span_id"]}.items() <= \
            {k: v for link in turn["links"] for k, v in link.items() if k in ("trace_id", "span_id")}.items()
        names = {s["name"] for s in spans if s["trace_id"] == turn["trace_id"]}
        # Disaggregated for the first turn, extended on the decode worker for later ones.
        assert {"generate", "prefill", "decode"} <= names or {"generate", "prefill_and_decode"} <= names


async def test_gpu_scheduler_publishes_grants_and_places_roles_on_them(mesh) -> None:
    nc = await nats.connect(mesh.info.nats_url)
    try:
        js = nc.jetstream()
        subscription = await js.subscribe(GPU_GRANTED.format(mesh.namespace), ordered_consumer=True)
        grants = [GPU_GRANTED.decode((await subscription.next_msg(timeout=10)).data) for _ in range(2)]
    finally:
        await nc.close()
    assert {(g.role, g.holder, g.count, g.resource) for g in grants} == {
        ("decode", "decode-0", 1.0, "rollmesh_gpu"), ("trainer", "trainer", 1.0, "rollmesh_gpu")}
    # The granted actors really hold the declared resource: Ray has none of the 2 left.
    assert ray.cluster_resources().get("rollmesh_gpu") == 2.0
    assert ray.available_resources().get("rollmesh_gpu", 0.0) == 0.0


async def test_a_mesh_that_cannot_start_leaves_no_actor_behind(ray_session, tmp_path) -> None:
    from rollmesh.config import load_config
    from rollmesh.launcher import Mesh

    config = load_config(overrides={
        "namespace": "broken" + uuid.uuid4().hex[:6], "nats.url": "nats://127.0.0.1:1",
        "nats.connect_timeout_s": 1.0, "serve.enabled": False,
    })
    mesh = Mesh(config, run_dir=tmp_path / "run")
    with pytest.raises(Exception):
        await mesh.start()
    with pytest.raises(ValueError):
        ray.get_actor("gpu-scheduler", namespace=mesh.ray_namespace)
    assert not (tmp_path / "run" / "mesh.json").exists()
