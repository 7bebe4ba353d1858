"""`rollmesh submit` and `rollmesh watch` against the session's real nats-server.

The mesh's side (a rollout worker answering requests) is played by the test: it reads the
requests the CLI stored in JetStream and publishes completions/failures with BusPublisher.
The CLI runs in a worker thread (it owns its own event loop, as from a shell).
"""

from __future__ import annotations

import asyncio
import json

import pytest
from test_cli import restore_logging_config  # noqa: F401  (autouse: main() sets up logging)

from rollmesh.bus.publisher import BusPublisher
from rollmesh.bus.streams import ensure_streams, rollout_requests_stream
from rollmesh.cli import main
from rollmesh.messages import RolloutCompleted, RolloutFailed, RolloutProgressed, TrainerStepped
from rollmesh.messages.subjects import (
    ROLLOUT_COMPLETED,
    ROLLOUT_FAILED,
    ROLLOUT_PROGRESSED,
    ROLLOUT_REQUESTED,
    TRAINER_STEPPED,
)
from rollmesh.telemetry.logging import setup_logging

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]


def completed(rollout_id: str, reward: float = 1.0) -> RolloutCompleted:
    return RolloutCompleted(
        rollout_id=rollout_id, task="molar_mass", group_id="g", purpose="train", reward=reward,
        turns=2, tool_calls=1, prompt_len=2, tokens=[1, 2, 3, 4], loss_mask=[0, 0, 1, 1],
        logprobs=[0.0, 0.0, -0.5, -0.1], versions=[-1, -1, 3, 4])


def table_rows(out: str) -> list[list[str]]:
    """The cells of the results table's rollout rows (rich draws cells between │ bars)."""
    return [[cell.strip() for cell in line.strip("│ ").split("│")]
            for line in out.splitlines() if line.startswith("│ cli-")]


async def stored_requests(nats_client, namespace: str) -> list:
    js = nats_client.jetstream()
    info = await js.stream_info(rollout_requests_stream(namespace))
    return [ROLLOUT_REQUESTED.decode((await js.get_msg(rollout_requests_stream(namespace), seq=seq)).data)
            for seq in range(info.state.first_seq, info.state.last_seq + 1)] if info.state.messages else []


async def test_submit_file_publishes_the_valid_lines_durably_and_reports_the_bad_ones(
        nats_server, nats_client, namespace, tmp_path, capsys):
    lines = [
        json.dumps({"rollout_id": "r-1", "task": "molar_mass", "task_input": {"formula": "H2O"}}),
        "{this is not json",
        json.dumps({"rollout_id": "r-2", "task": "molar_mass", "purpose": "eval"}),
        json.dumps({"rollout_id": "r-3", "task": "molar_mass", "max_turns": "four"}),
    ]
    requests_file = tmp_path / "requests.jsonl"
    requests_file.write_text("\n".join(lines) + "\n")

    code = await asyncio.to_thread(main, ["submit", "--file", str(requests_file),
                                          "--nats-url", nats_server.url, "--namespace", namespace])

    assert code == 1
    out, err = capsys.readouterr()
    assert f"{requests_file}:2: not a valid RolloutRequested" in err
    assert f"{requests_file}:4: not a valid RolloutRequested" in err and "$.max_turns" in err
    assert ":1:" not in err and ":3:" not in err
    assert f"published 2 rollout request(s) to rl.{namespace}.rollout.requested; 2 bad line(s) skipped" in out
    assert [r.rollout_id for r in await stored_requests(nats_client, namespace)] == ["r-1", "r-2"]


async def test_submit_again_reports_requests_jetstream_dropped_as_repeats(
        nats_server, nats_client, namespace, tmp_path, capsys):
    requests_file = tmp_path / "requests.jsonl"
    requests_file.write_text(json.dumps({"rollout_id": "same", "task": "molar_mass"}) + "\n")
    argv = ["submit", "--file", str(requests_file), "--nats-url", nats_server.url, "--namespace", namespace]
    assert await asyncio.to_thread(main, argv) == 0
    capsys.readouterr()
    assert await asyncio.to_thread(main, argv) == 0
    out, err = capsys.readouterr()
    assert "published 0 rollout request(s)" in out
    assert "dropped by JetStream as repeats" in err and "same" in err
    assert len(await stored_requests(nats_client, namespace)) == 1


async def play_rollout_worker(nats_client, namespace: str, answer) -> asyncio.Task:
    """Answer each request seen on the requests subject with ``answer(request)``."""
    js = nats_client.jetstream()
    await ensure_streams(js, namespace)
    publisher = BusPublisher(nats_client, js, namespace)
    requests = await nats_client.subscribe(ROLLOUT_REQUESTED.format(namespace))

    async def serve() -> None:
        async for msg in requests.messages:
            request = ROLLOUT_REQUESTED.decode(msg.data)
            event = answer(request)
            subject = ROLLOUT_COMPLETED if isinstance(event, RolloutCompleted) else ROLLOUT_FAILED
            await publisher.publish(subject, event)

    return asyncio.create_task(serve())


async def test_submit_task_wait_prints_a_table_and_fails_when_a_rollout_failed(
        nats_server, nats_client, namespace, capsys):
    answered = 0

    def answer(request):
        nonlocal answered
        answered += 1
        if answered == 2:
            return RolloutFailed(rollout_id=request.rollout_id, kind="sandbox_timeout", reason="tool ran 10s")
        return completed(request.rollout_id)

    worker = await play_rollout_worker(nats_client, namespace, answer)
    try:
        code = await asyncio.to_thread(main, [
            "submit", "--task", "molar_mass", "--count", "3", "--n-samples-per-prompt", "3", "--wait", "--timeout", "30",
            "--nats-url", nats_server.url, "--namespace", namespace])
    finally:
        worker.cancel()
    out, err = capsys.readouterr()
    rows = table_rows(out)
    assert code == 1
    assert len(rows) == 3
    assert sorted(row[1] for row in rows) == ["completed", "completed", "failed: sandbox_timeout"]
    assert all(row[5] == "3-4" for row in rows if row[1] == "completed")  # generated tokens' versions
    assert "sandbox_timeout: tool ran 10s" in err and "1 of 3 rollout(s) failed" in err


async def test_submit_task_wait_exits_zero_when_every_rollout_completed(
        nats_server, nats_client, namespace, capsys):
    worker = await play_rollout_worker(nats_client, namespace, lambda request: completed(request.rollout_id, 0.5))
    try:
        code = await asyncio.to_thread(main, [
            "submit", "--task", "molar_mass", "--count", "2", "--n-samples-per-prompt", "2", "--wait", "--timeout", "30",
            "--nats-url", nats_server.url, "--namespace", namespace])
    finally:
        worker.cancel()
    out, _ = capsys.readouterr()
    assert code == 0
    assert [row[1:3] for row in table_rows(out)] == [["completed", "0.500"]] * 2
    assert "mean reward 0.500 over 2 completed" in out


async def test_watch_count_prints_plain_lines_and_exits_after_n_rollouts(
        nats_server, nats_client, namespace, capsys):
    js = nats_client.jetstream()
    await ensure_streams(js, namespace)
    publisher = BusPublisher(nats_client, js, namespace)
    watching = asyncio.ensure_future(asyncio.to_thread(main, [
        "watch", "--count", "2", "--timeout", "30", "--nats-url", nats_server.url, "--namespace", namespace]))
    # The watcher subscribes at some point after it starts: keep events coming until it has seen two.
    index = 0
    while not watching.done() and index < 200:
        await publisher.publish(ROLLOUT_PROGRESSED, RolloutProgressed(
            rollout_id=f"w-{index}", turn=1, num_tokens=9, weight_version=3))
        await publisher.publish(TRAINER_STEPPED, TrainerStepped(
            step=index, weight_version=index, loss=0.25, reward_mean=0.5, num_samples=8, num_groups=1))
        await publisher.publish(ROLLOUT_COMPLETED, completed(f"w-{index}"))
        index += 1
        await asyncio.wait({watching}, timeout=0.1)
    assert await watching == 0
    out = capsys.readouterr().out
    assert "completed  w-" in out and "reward=1.000" in out and "versions=3-4" in out
    assert "trainer    step=" in out
    assert out.strip().splitlines()[-1].startswith("completed 2 (mean reward 1.000)  failed 0")


async def test_watch_count_exits_1_when_the_timeout_passes_first(nats_server, namespace, capsys):
    code = await asyncio.to_thread(main, ["watch", "--count", "1", "--timeout", "0.5",
                                          "--nats-url", nats_server.url, "--namespace", namespace])
    assert code == 1
    assert "timed out after 0.5s: 0 of 1 rollouts finished" in capsys.readouterr().err


async def test_submit_to_an_unreachable_nats_is_one_line(monkeypatch, capsys):
    monkeypatch.setenv("ROLLMESH_NATS__CONNECT_TIMEOUT_S", "0.5")
    # As a fresh `rollmesh` process has it: the CLI's own logging setup, not an earlier test's.
    setup_logging("rollmesh-submit", "warning", force=True)
    try:
        code = await asyncio.to_thread(main, ["submit", "--task", "molar_mass", "--count", "1", "--purpose", "eval",
                                              "--nats-url", "nats://127.0.0.1:1", "--namespace", "nowhere"])
    finally:
        setup_logging("pytest", "info", force=True)
    err = capsys.readouterr().err
    assert code == 1
    assert err.startswith("rollmesh: error: ") and "Traceback" not in err
