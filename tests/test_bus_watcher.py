"""BusWatcher on the session's real nats-server: a process that is no actor follows events on the
actors' path (decoded in order, bad bytes dead-lettered, a failing callback counted, the canonical
log line), and nothing in rollmesh/ outside the bus subscribes to NATS by itself."""

from __future__ import annotations

import ast
import asyncio
import io
import json
from pathlib import Path

import pytest

from rollmesh.bus.connection import flush_to_server
from rollmesh.bus.streams import ensure_streams
from rollmesh.bus.watcher import BusWatcher
from rollmesh.messages import RolloutProgressed, TrainerStepped
from rollmesh.messages.subjects import DEAD_LETTERED, ROLLOUT_PROGRESSED, TRAINER_STEPPED
from rollmesh.telemetry.logging import setup_logging
from support.waiting import WAIT_S

pytestmark = pytest.mark.timeout(60)

ROLLMESH = Path(__file__).resolve().parent.parent / "rollmesh"


def progressed(turn: int) -> RolloutProgressed:
    return RolloutProgressed(rollout_id="r1", turn=turn, num_tokens=turn, weight_version=0)


@pytest.mark.integration
async def test_a_watcher_gets_decoded_events_in_order_and_dead_letters_bad_bytes(
        nats_client, namespace: str) -> None:
    await ensure_streams(nats_client.jetstream(), namespace)
    dlq = await nats_client.subscribe(DEAD_LETTERED.format(namespace))
    seen: asyncio.Queue[RolloutProgressed] = asyncio.Queue()
    malformed: list[str] = []
    async with BusWatcher(nats_client, namespace, name="test-watcher",
                          on_dead_lettered=malformed.append) as watcher:
        await watcher.watch(ROLLOUT_PROGRESSED, seen.put_nowait)
        subject = ROLLOUT_PROGRESSED.format(namespace)
        await nats_client.publish(subject, ROLLOUT_PROGRESSED.encode(progressed(1)))
        await nats_client.publish(subject, b"\xff not a message")
        await nats_client.publish(subject, ROLLOUT_PROGRESSED.encode(progressed(2)))

        assert [(await asyncio.wait_for(seen.get(), WAIT_S)).turn for _ in range(2)] == [1, 2]
        letter = DEAD_LETTERED.decode((await dlq.next_msg(timeout=WAIT_S)).data)
        assert (letter.subject, letter.consumer) == (subject, "test-watcher")
        assert malformed == [ROLLOUT_PROGRESSED.template]
        assert watcher.stats()[ROLLOUT_PROGRESSED.template] == {
            "received": 3, "handled": 2, "failed": 0, "dead_lettered": 1}


@pytest.mark.integration
async def test_a_callback_that_raises_is_counted_and_the_watcher_goes_on(nats_client, namespace: str) -> None:
    turns: asyncio.Queue[int] = asyncio.Queue()

    async def on_event(event: RolloutProgressed) -> None:
        if event.turn == 1:
            raise RuntimeError("the owner's bug")
        turns.put_nowait(event.turn)

    async with BusWatcher(nats_client, namespace, name="test-watcher") as watcher:
        await watcher.watch(ROLLOUT_PROGRESSED, on_event)
        for turn in (1, 2):
            await nats_client.publish(ROLLOUT_PROGRESSED.format(namespace), ROLLOUT_PROGRESSED.encode(progressed(turn)))
        assert await asyncio.wait_for(turns.get(), WAIT_S) == 2
        assert watcher.stats()[ROLLOUT_PROGRESSED.template]["failed"] == 1


@pytest.mark.integration
async def test_close_handles_what_the_server_sent_before_it(nats_client, namespace: str) -> None:
    steps: list[int] = []
    watcher = BusWatcher(nats_client, namespace, name="test-watcher")
    await watcher.watch(TRAINER_STEPPED, lambda event: steps.append(event.step))
    for step in range(1, 21):
        await nats_client.publish(TRAINER_STEPPED.format(namespace), TRAINER_STEPPED.encode(TrainerStepped(
            step=step, weight_version=step, loss=0.0, reward_mean=0.0, num_samples=1, num_groups=1)))
    await flush_to_server(nats_client)
    await watcher.close()
    assert steps == list(range(1, 21))
    await watcher.close()  # idempotent


@pytest.mark.integration
async def test_every_watched_message_ends_in_one_canonical_log_line(nats_client, namespace: str) -> None:
    buffer = io.StringIO()
    setup_logging("pytest", "info", stream=buffer, force=True)
    seen = asyncio.Event()
    try:
        async with BusWatcher(nats_client, namespace, name="test-watcher") as watcher:
            await watcher.watch(ROLLOUT_PROGRESSED, lambda event: seen.set())
            await nats_client.publish(ROLLOUT_PROGRESSED.format(namespace), ROLLOUT_PROGRESSED.encode(progressed(1)))
            await asyncio.wait_for(seen.wait(), WAIT_S)
    finally:
        setup_logging("pytest", "info", force=True)
    (line,) = [line for line in map(json.loads, buffer.getvalue().splitlines())
               if line["event"] == "message_handled"]
    assert (line["outcome"], line["subject_template"], line["mode"], line["actor"]) == (
        "handled", ROLLOUT_PROGRESSED.template, "core", "test-watcher")


def subscribe_calls(path: Path) -> list[int]:
    """Lines of ``path`` that call a ``.subscribe(...)`` (nats-py's core or JetStream push)
    or ``.pull_subscribe(...)``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    return [node.lineno for node in ast.walk(tree)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr in {"subscribe", "pull_subscribe"}]


@pytest.mark.unit
def test_nothing_outside_the_bus_subscribes_to_nats() -> None:
    """Every consumer goes through rollmesh/bus (the actor shell's consumers, or a BusWatcher),
    so every message gets the dispatcher's span, canonical log line and dead-letter handling."""
    found = {str(path.relative_to(ROLLMESH.parent)): lines
             for path in sorted(ROLLMESH.rglob("*.py"))
             if ROLLMESH / "bus" not in path.parents and (lines := subscribe_calls(path))}
    assert subscribe_calls(ROLLMESH / "bus" / "consumers.py"), "the check finds the bus's own calls"
    assert found == {}, f"subscribe outside rollmesh/bus/ (use rollmesh.bus.watcher.BusWatcher): {found}"
