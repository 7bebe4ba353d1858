"""SandboxBroker plain logic against the fake runtime: leases, warm pools, admission, heartbeats and
reaping, exec results, chunked transfers with checksums, snapshots and forks. The client is driven
through ``InProcessRequester``, so every request and reply also passes its subject's codec."""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
from pathlib import Path

import msgspec
import pytest
from support.fakes import FakeSandboxBackend, ManualClock, RecordingPublisher
from opentelemetry import trace

from rollmesh.config import SandboxConfig, SandboxProfileConfig
from rollmesh.messages.sandbox import (
    SandboxDownloadRequest,
    SandboxExecRequest,
    SandboxForkRequest,
    SandboxHeartbeatRequest,
    SandboxLeaseRequest,
    SandboxLimitsSpec,
    SandboxReleaseRequest,
    SandboxSnapshotRequest,
    SandboxUploadRequest,
)
from rollmesh.messages.subjects import SANDBOX_OUTPUT
from rollmesh.sandbox import SandboxBroker, SandboxBrokerClient, SandboxRequestError
from rollmesh.sandbox.errors import BackendFailedError, SandboxDiedError
from rollmesh.sandbox.in_process import InProcessRequester
from rollmesh.sandbox.sandbox_protocol import ExecOutcome
from rollmesh.sandbox.warm_pool import WarmPool
from rollmesh.telemetry.tracing import flush_tracing

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

SHA_OF_NOTHING = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"


def make_broker(tmp_path: Path, *, warm_min: int = 0, warm_max: int = 4, publisher=None,
                backend: FakeSandboxBackend | None = None, **config: object):
    clock = ManualClock()
    backend = backend or FakeSandboxBackend(clock=clock, create_s=0.05)
    ids = (f"id{n}" for n in itertools.count())
    profiles = {"default": SandboxProfileConfig(warm_min=warm_min, warm_max=warm_max)}
    broker = SandboxBroker(SandboxConfig(profiles=profiles, **config), backend, snapshot_dir=tmp_path / "snap",
                           publisher=publisher, clock=clock, new_id=lambda: next(ids))
    return broker, backend, clock


def client_of(broker: SandboxBroker, **kwargs) -> SandboxBrokerClient:
    return SandboxBrokerClient(InProcessRequester(broker), **kwargs)


# -- leases, idempotency, warm pools ----------------------------------------------------------

async def test_lease_from_the_warm_pool_is_warm_and_reports_the_default_profile(tmp_path):
    broker, backend, clock = make_broker(tmp_path, warm_min=2)
    await broker.resize_pools()
    assert len(backend.created) == 2
    reply = await broker.lease(SandboxLeaseRequest(holder="rollout-1", ttl_s=30.0))
    assert reply.error_kind == "" and reply.warm
    assert (reply.backend, reply.isolated, reply.profile, reply.ttl_s) == ("fake", True, "default", 30.0)
    assert reply.expires_at == clock.now + 30.0
    assert (reply.limits.memory_mb, reply.limits.workspace_mb, reply.limits.pids,
            reply.limits.exec_timeout_s) == (2048, 2048, 256, 600.0)
    assert len(backend.created) == 2  # taken from the pool, nothing new made for the lease


async def test_a_retried_lease_with_the_same_token_gets_the_same_sandbox(tmp_path):
    broker, backend, _ = make_broker(tmp_path)
    first = await broker.lease(SandboxLeaseRequest(holder="rollout-1"))
    again = await broker.lease(SandboxLeaseRequest(holder="rollout-1"))
    other = await broker.lease(SandboxLeaseRequest(holder="rollout-2"))
    assert first.lease_id == again.lease_id != other.lease_id
    assert len(backend.created) == 2


async def test_concurrent_retries_of_a_cold_lease_make_one_sandbox(tmp_path):
    broker, backend, _ = make_broker(tmp_path)
    backend.create_gate = asyncio.Event()
    racing = [asyncio.create_task(broker.lease(SandboxLeaseRequest(holder="r"))) for _ in range(3)]
    while backend.creates_waiting == 0:
        await asyncio.sleep(0)
    backend.create_gate.set()
    replies = await asyncio.gather(*racing)
    assert len({reply.lease_id for reply in replies}) == 1 and replies[0].lease_id
    assert len(backend.created) == 1


async def test_a_released_sandbox_is_destroyed_and_never_leased_again(tmp_path):
    broker, backend, _ = make_broker(tmp_path, warm_min=1)
    await broker.resize_pools()
    first = await broker.lease(SandboxLeaseRequest(holder="a"))
    used = backend.created[0]
    assert (await broker.release(SandboxReleaseRequest(lease_id=first.lease_id))).released
    assert used.destroyed
    await broker.resize_pools()  # the pool refills with a new sandbox
    second = await broker.lease(SandboxLeaseRequest(holder="b"))
    assert second.warm
    assert all(not sandbox.destroyed for sandbox in backend.created[1:])
    assert (await broker.release(SandboxReleaseRequest(lease_id=first.lease_id))).error_kind == "unknown_lease"
    leased_after = {id(sandbox) for sandbox in backend.created[1:]}
    assert id(used) not in leased_after


async def test_the_warm_pool_never_hands_out_a_sandbox_that_died_waiting(tmp_path):
    broker, backend, _ = make_broker(tmp_path, warm_min=1)
    await broker.resize_pools()
    backend.created[0].die()
    reply = await broker.lease(SandboxLeaseRequest(holder="a"))
    assert not reply.warm and backend.created[0].destroyed and len(backend.created) == 2


def test_warm_pool_target_is_lease_rate_times_creation_latency_within_min_and_max():
    clock = ManualClock()
    pool = WarmPool(window_s=10.0, clock=clock)
    assert pool.target("p", minimum=1, maximum=8) == 1  # no demand: the minimum
    pool.record_creation("p", 2.0)
    for _ in range(30):  # 3 leases/s x 2 s to create one = 6 wanted ready
        pool.record_lease("p")
    assert pool.target("p", minimum=0, maximum=8) == 6
    assert pool.target("p", minimum=0, maximum=4) == 4
    clock.advance(11.0)  # the demand left the window
    assert pool.target("p", minimum=0, maximum=8) == 0


async def test_the_broker_keeps_sandboxes_warm_while_there_is_demand_and_drops_them_after(tmp_path):
    broker, backend, clock = make_broker(tmp_path, warm_min=0, warm_max=8, demand_window_s=10.0)
    await broker.resize_pools()
    assert backend.created == []  # no demand, no minimum: nothing kept warm
    for index in range(4):
        assert not (await broker.lease(SandboxLeaseRequest(holder=f"r{index}"))).warm
    await broker.resize_pools()
    assert broker.stats().warm_sandboxes == {"default": 1}
    assert (await broker.lease(SandboxLeaseRequest(holder="r4"))).warm
    await broker.resize_pools()  # refilled
    assert broker.stats().warm_sandboxes == {"default": 1}
    clock.advance(20.0)  # the demand left the window
    await broker.resize_pools()
    assert broker.stats().warm_sandboxes == {"default": 0}
    assert backend.created[-1].destroyed


# -- heartbeats and reaping ---------------------------------------------------------------------

async def test_heartbeats_keep_a_lease_and_a_silent_holder_is_reaped(tmp_path):
    broker, backend, clock = make_broker(tmp_path)
    lease = await broker.lease(SandboxLeaseRequest(holder="r", ttl_s=10.0))
    for _ in range(5):  # 40 s in all: alive while it heartbeats every 8 s
        clock.advance(8.0)
        beat = await broker.heartbeat(SandboxHeartbeatRequest(lease_id=lease.lease_id))
        assert beat.error_kind == "" and beat.expires_at == clock.now + 10.0
        assert await broker.reap_expired() == 0
    clock.advance(10.0)
    assert await broker.reap_expired() == 1
    assert backend.created[0].destroyed
    late = await broker.heartbeat(SandboxHeartbeatRequest(lease_id=lease.lease_id))
    assert late.error_kind == "unknown_lease"


async def test_an_expired_lease_answers_lease_expired_and_its_sandbox_is_destroyed(tmp_path):
    broker, backend, clock = make_broker(tmp_path)
    lease = await broker.lease(SandboxLeaseRequest(holder="r", ttl_s=5.0))
    clock.advance(6.0)
    reply = await broker.exec(SandboxExecRequest(lease_id=lease.lease_id, argv=["true"]))
    assert (reply.error_kind, reply.result) == ("lease_expired", "")
    assert backend.created[0].destroyed
    assert broker.stats().counts["leases_expired"] == 1
    # The same token then gets a fresh sandbox.
    again = await broker.lease(SandboxLeaseRequest(holder="r"))
    assert again.lease_id != lease.lease_id and len(backend.created) == 2


async def test_a_lease_running_an_exec_is_not_reaped_mid_exec(tmp_path):
    broker, backend, clock = make_broker(tmp_path)
    lease = await broker.lease(SandboxLeaseRequest(holder="r", ttl_s=5.0))
    backend.exec_gate = asyncio.Event()
    running = asyncio.create_task(broker.exec(SandboxExecRequest(lease_id=lease.lease_id, argv=["sleep", "60"])))
    while backend.execs_waiting == 0:
        await asyncio.sleep(0)
    clock.advance(60.0)
    assert await broker.reap_expired() == 0
    backend.exec_gate.set()
    assert (await running).result == "exit"
    assert await broker.reap_expired() == 0  # the exec's end counts as activity
    clock.advance(6.0)
    assert await broker.reap_expired() == 1


# -- admission ----------------------------------------------------------------------------------

async def test_leases_past_max_sandboxes_are_refused_with_capacity_and_a_retry_hint(tmp_path):
    broker, _, _ = make_broker(tmp_path, max_sandboxes=2, capacity_retry_after_s=0.5)
    for holder in ("a", "b"):
        assert (await broker.lease(SandboxLeaseRequest(holder=holder))).error_kind == ""
    refused = await broker.lease(SandboxLeaseRequest(holder="c"))
    assert (refused.error_kind, refused.retry_after_s, refused.lease_id) == ("capacity", 0.5, "")
    assert "2 of 2" in refused.error


async def test_warm_sandboxes_give_way_to_leases_and_never_pass_max_sandboxes(tmp_path):
    broker, backend, _ = make_broker(tmp_path, warm_min=3, max_sandboxes=3)
    await broker.resize_pools()
    assert len(backend.live()) == 3
    custom = SandboxLimitsSpec(memory_mb=4096)  # not warmable: needs a new sandbox
    reply = await broker.lease(SandboxLeaseRequest(holder="big", limits=custom))
    assert reply.error_kind == "" and not reply.warm and reply.limits.memory_mb == 4096
    assert len(backend.live()) == 3  # one warm sandbox was destroyed to make room
    await broker.resize_pools()
    assert len(backend.live()) == 3


async def test_execs_past_max_concurrent_execs_are_refused_with_capacity(tmp_path):
    broker, backend, _ = make_broker(tmp_path, max_concurrent_execs=1)
    lease = await broker.lease(SandboxLeaseRequest(holder="r"))
    backend.exec_gate = asyncio.Event()
    first = asyncio.create_task(broker.exec(SandboxExecRequest(lease_id=lease.lease_id, argv=["true"])))
    while backend.execs_waiting == 0:
        await asyncio.sleep(0)
    refused = await broker.exec(SandboxExecRequest(lease_id=lease.lease_id, argv=["true"]))
    assert refused.error_kind == "capacity" and refused.retry_after_s > 0 and refused.result == ""
    backend.exec_gate.set()
    assert (await first).result == "exit"


async def test_the_client_retries_a_capacity_refusal_after_its_hint(tmp_path):
    broker, _, _ = make_broker(tmp_path, max_sandboxes=1, capacity_retry_after_s=2.0)
    held = await broker.lease(SandboxLeaseRequest(holder="a"))
    waits: list[float] = []

    async def sleep(seconds: float) -> None:  # the holder releases while the client waits
        waits.append(seconds)
        await broker.release(SandboxReleaseRequest(lease_id=held.lease_id))

    client = client_of(broker, sleep=sleep)
    reply = await client.lease("b", capacity_retries=2)
    assert reply.lease_id and waits == [2.0]
    with pytest.raises(SandboxRequestError) as refused:
        await client_of(broker).lease("c")
    assert refused.value.kind == "capacity" and refused.value.retry_after_s == 2.0


async def test_lease_refuses_unknown_profiles_network_and_limits_above_the_maxima(tmp_path):
    broker, _, _ = make_broker(tmp_path)
    cases = [
        (SandboxLeaseRequest(holder="r", profile="gpu"), "unknown sandbox profile"),
        (SandboxLeaseRequest(holder="r", network=True), "network"),
        (SandboxLeaseRequest(holder="r", limits=SandboxLimitsSpec(memory_mb=10**6)), "limits.memory_mb"),
        (SandboxLeaseRequest(holder="r", ttl_s=30 * 24 * 3600.0), "ttl_s"),
    ]
    for request, named in cases:
        reply = await broker.lease(request)
        assert reply.error_kind == "invalid_request" and named in reply.error, reply
    assert broker.stats().active_leases == 0


async def test_a_runtime_that_cannot_create_a_sandbox_answers_infra_error_with_a_retry_hint(tmp_path):
    broker, backend, _ = make_broker(tmp_path)
    backend.create_failures = [BackendFailedError("bwrap exited", backend="fake", reason="status 1")]
    reply = await broker.lease(SandboxLeaseRequest(holder="r"))
    assert reply.error_kind == "infra_error" and "bwrap exited" in reply.error and reply.retry_after_s > 0
    assert broker.live_sandboxes() == 0


# -- exec -----------------------------------------------------------------------------------------

async def test_exec_results_are_typed_and_a_dead_sandbox_is_sandbox_died(tmp_path):
    timeout = ExecOutcome("timeout", None, 9, False, b"partial", b"", 2.0)
    oom = ExecOutcome("oom", None, 9, False, b"", b"", 0.5, detail="memory limit")
    backend = FakeSandboxBackend([timeout, oom, BackendFailedError("pipe broke", backend="fake"),
                                  SandboxDiedError("guest gone", sandbox_id="x")])
    broker, _, _ = make_broker(tmp_path, backend=backend)
    lease = (await broker.lease(SandboxLeaseRequest(holder="r"))).lease_id

    async def run(**kwargs):
        return await broker.exec(SandboxExecRequest(lease_id=lease, **kwargs))

    assert (await run(argv=["sleep", "9"], timeout_s=2.0)).result == "timeout"
    assert (await run(argv=["big"])).result == "oom"
    infra = await run(argv=["x"])
    assert infra.result == "infra_error" and "pipe broke" in infra.detail and infra.error_kind == ""
    died = await run(argv=["x"])
    assert died.result == "sandbox_died" and died.exit_code is None
    assert (await run(argv=["echo", "hi"])).result == "sandbox_died"  # and stays so
    beat = await broker.heartbeat(SandboxHeartbeatRequest(lease_id=lease))
    assert beat.error_kind == "sandbox_died"
    counts = broker.stats().counts
    assert (counts["exec_timeout"], counts["exec_oom"], counts["exec_infra_error"]) == (1, 1, 1)


async def test_exec_runs_argv_or_shell_with_stdin_env_and_cwd(tmp_path):
    broker, backend, _ = make_broker(tmp_path)
    client = client_of(broker)
    lease = (await client.lease("r")).lease_id
    ok = await client.exec(lease, ["cat"], stdin=b"\x00binary\xff", env={"A": "1"}, cwd="sub")
    assert (ok.result, ok.exit_code, ok.stdout) == ("exit", 0, b"\x00binary\xff")
    failed = await client.exec(lease, shell="exit 3")
    assert (failed.result, failed.exit_code) == ("exit", 3)
    call = backend.created[0].execs[0]
    # The caller's env as given (plus the trace context's TRACEPARENT when a span is current).
    env = {key: value for key, value in call["env"].items() if key not in ("TRACEPARENT", "TRACESTATE")}
    assert (env, call["cwd"], call["timeout_s"]) == ({"A": "1"}, "sub", 600.0)


async def test_an_exec_is_a_broker_span_whose_traceparent_reaches_the_tool_process(tmp_path, trace_file):
    broker, backend, _ = make_broker(tmp_path)
    client = client_of(broker)
    lease = (await client.lease("r")).lease_id
    with trace.get_tracer("test").start_as_current_span("turn") as turn:
        failed = await client.exec(lease, shell="exit 3", env={"A": "1"})
    assert flush_tracing()
    trace_id = f"{turn.get_span_context().trace_id:032x}"
    (span,) = [r for r in map(json.loads, trace_file.read_text().splitlines())
               if r["trace_id"] == trace_id and r["name"] == "sandbox.exec"]
    assert span["parent_span_id"] == f"{turn.get_span_context().span_id:016x}"
    assert span["attributes"]["rl.sandbox.lease_id"] == lease
    assert span["attributes"]["rl.sandbox.exec_id"] == failed.exec_id
    assert (span["attributes"]["rl.sandbox.result"], span["attributes"]["rl.sandbox.exit_code"]) == ("exit", 3)
    env = backend.created[0].execs[0]["env"]
    # W3C traceparent: version-traceid-spanid-flags; the tool process continues the broker's span.
    assert env["A"] == "1" and env["TRACEPARENT"].startswith(f"00-{trace_id}-{span['span_id']}-")


@pytest.mark.parametrize("request_fields, named", [
    ({"argv": ["ls"], "shell": "ls"}, "exactly one"),
    ({}, "exactly one"),
    ({"argv": ["ls"], "timeout_s": 601.0}, "exec_timeout_s"),
])
async def test_an_exec_that_cannot_run_is_refused_with_invalid_request(tmp_path, request_fields, named):
    broker, _, _ = make_broker(tmp_path)
    lease = (await broker.lease(SandboxLeaseRequest(holder="r"))).lease_id
    reply = await broker.exec(SandboxExecRequest(lease_id=lease, **request_fields))
    assert (reply.error_kind, reply.result) == ("invalid_request", "") and named in reply.error


async def test_exec_streams_output_chunks_with_their_lease_exec_id_and_offsets(tmp_path):
    bus = RecordingPublisher()
    broker, _, _ = make_broker(tmp_path, publisher=bus)
    lease = (await broker.lease(SandboxLeaseRequest(holder="r"))).lease_id
    script = ExecOutcome("exit", 0, None, False, b"one\ntwo\n", b"warn\n", 0.1)
    broker.backend.outcomes.append(script)
    reply = await broker.exec(SandboxExecRequest(lease_id=lease, argv=["x"], exec_id="e-1", stream_output=True))
    chunks = bus.messages(SANDBOX_OUTPUT)
    assert [(c.exec_id, c.lease_id, c.stream, c.offset, c.data) for c in chunks] == [
        ("e-1", lease, "stdout", 0, b"one\n"), ("e-1", lease, "stdout", 4, b"two\n"),
        ("e-1", lease, "stderr", 0, b"warn\n")]
    assert reply.stdout == b"one\ntwo\n" and reply.exec_id == "e-1"
    await broker.exec(SandboxExecRequest(lease_id=lease, argv=["echo", "quiet"]))
    assert len(bus.messages(SANDBOX_OUTPUT)) == 3  # not asked to stream: nothing published


# -- transfers --------------------------------------------------------------------------------------

async def test_a_large_file_goes_up_and_down_in_chunks_verified_by_sha256(tmp_path):
    broker, backend, _ = make_broker(tmp_path)
    client = client_of(broker, chunk_bytes=1024)
    lease = (await client.lease("r")).lease_id
    data = bytes(range(256)) * 20  # 5 chunks
    stored = await client.upload(lease, "data/blob.bin", data)
    assert stored.complete and stored.size == len(data)
    assert backend.created[0].files["data/blob.bin"] == data
    assert await client.download(lease, "data/blob.bin") == data
    small = await client.upload(lease, "empty", b"")
    assert small.complete and small.sha256 == SHA_OF_NOTHING


async def test_a_directory_goes_up_and_down_as_a_tar(tmp_path):
    broker, backend, _ = make_broker(tmp_path)
    client = client_of(broker)
    lease = (await client.lease("r")).lease_id
    source = await client_of(broker).lease("other")
    sandbox = backend.created[1]
    sandbox.files.update({"a.txt": b"A", "d/b.txt": b"B"})
    tar = await client.download(source.lease_id, ".", kind="tar")
    await client.upload(lease, "copy", tar, kind="tar")
    assert backend.created[0].files == {"copy/a.txt": b"A", "copy/d/b.txt": b"B"}


async def test_a_checksum_mismatch_on_either_side_is_a_typed_error(tmp_path):
    broker, backend, _ = make_broker(tmp_path)
    lease = (await broker.lease(SandboxLeaseRequest(holder="r"))).lease_id
    wrong = await broker.upload(SandboxUploadRequest(lease_id=lease, path="f", data=b"abc", size=3,
                                                     sha256=SHA_OF_NOTHING))
    assert wrong.error_kind == "checksum_mismatch" and not wrong.complete
    assert "f" not in backend.created[0].files  # refused before anything was stored
    backend.corrupt_stores = True
    with pytest.raises(SandboxRequestError) as stored_wrong:
        await client_of(broker).upload(lease, "f", b"abc")
    assert stored_wrong.value.kind == "checksum_mismatch"


async def test_a_download_corrupted_on_the_way_is_caught_by_the_client(tmp_path):
    broker, backend, _ = make_broker(tmp_path)
    lease = (await broker.lease(SandboxLeaseRequest(holder="r"))).lease_id
    backend.created[0].files["f"] = b"payload"

    class FlippingRequester(InProcessRequester):
        async def request(self, subject, message, timeout_s):
            reply = await super().request(subject, message, timeout_s)
            data = getattr(reply, "data", b"")
            return type(reply)(**{**{f: getattr(reply, f) for f in reply.__struct_fields__},
                                  "data": data[:-1] + b"X"}) if data else reply

    with pytest.raises(SandboxRequestError) as caught:
        await SandboxBrokerClient(FlippingRequester(broker)).download(lease, "f")
    assert caught.value.kind == "checksum_mismatch"


async def test_an_upload_corrupted_on_the_way_in_is_caught_and_sent_again_with_its_digest(tmp_path):
    broker, backend, _ = make_broker(tmp_path)
    lease = (await broker.lease(SandboxLeaseRequest(holder="r"))).lease_id

    class FlippingRequester(InProcessRequester):
        """Flips the last byte of the first ``flips`` uploads on their way to the broker."""

        flips = 1

        async def request(self, subject, message, timeout_s):
            if isinstance(message, SandboxUploadRequest) and self.flips:
                self.flips -= 1
                message = msgspec.structs.replace(message, data=message.data[:-1] + b"X")
            return await super().request(subject, message, timeout_s)

    once = FlippingRequester(broker)
    reply = await SandboxBrokerClient(once).upload(lease, "f", b"payload")
    assert backend.created[0].files["f"] == b"payload"  # the second try, checked, replaced it
    assert reply.sha256 == hashlib.sha256(b"payload").hexdigest()
    always = FlippingRequester(broker)
    always.flips = 2
    with pytest.raises(SandboxRequestError) as caught:
        await SandboxBrokerClient(always).upload(lease, "g", b"payload")
    assert caught.value.kind == "checksum_mismatch"


async def test_upload_chunks_must_come_in_order_and_a_repeated_chunk_is_not_appended_twice(tmp_path):
    broker, backend, _ = make_broker(tmp_path)
    lease = (await broker.lease(SandboxLeaseRequest(holder="r"))).lease_id
    data = b"0123456789"
    sha = hashlib.sha256(data).hexdigest()

    def chunk(offset: int, piece: bytes) -> SandboxUploadRequest:
        return SandboxUploadRequest(lease_id=lease, path="f", data=piece, size=10, sha256=sha,
                                    upload_id="u1", offset=offset)

    assert (await broker.upload(chunk(0, data[:4]))).received == 4
    assert (await broker.upload(chunk(0, data[:4]))).received == 4  # a retry of a lost reply
    gap = await broker.upload(chunk(8, data[8:]))
    assert gap.error_kind == "invalid_request" and "offset" in gap.error
    assert (await broker.upload(chunk(4, data[4:]))).complete
    assert backend.created[0].files["f"] == data


async def test_paths_outside_the_workspace_and_missing_files_are_typed_errors(tmp_path):
    broker, _, _ = make_broker(tmp_path)
    client = client_of(broker)
    lease = (await client.lease("r")).lease_id
    with pytest.raises(SandboxRequestError) as escaped:
        await client.upload(lease, "../outside", b"x")
    assert escaped.value.kind == "path_error"
    with pytest.raises(SandboxRequestError) as missing:
        await client.download(lease, "nope")
    assert missing.value.kind == "transfer_error"


# -- snapshots and forks -------------------------------------------------------------------------

async def test_fork_makes_independent_leases_whose_workspaces_start_as_the_snapshot(tmp_path):
    broker, backend, _ = make_broker(tmp_path, warm_min=1)
    await broker.resize_pools()
    client = client_of(broker)
    source = (await client.lease("parent", limits=SandboxLimitsSpec(pids=512))).lease_id
    await client.upload(source, "state/step.txt", b"step 3")
    snapshot = await client.snapshot(source)
    assert snapshot.snapshot_id and snapshot.size > 0
    await client.upload(source, "state/step.txt", b"step 4")  # later changes are not in it
    forks = await client.fork(snapshot.snapshot_id, "group-7", 3)
    assert [fork.holder for fork in forks] == ["group-7/0", "group-7/1", "group-7/2"]
    assert len({fork.lease_id for fork in forks} | {source}) == 4
    for fork in forks:
        assert await client.download(fork.lease_id, "state/step.txt") == b"step 3"
    await client.upload(forks[0].lease_id, "state/step.txt", b"branch 0")
    assert await client.download(forks[1].lease_id, "state/step.txt") == b"step 3"
    forked_sandboxes = backend.created[-3:]
    assert all(sandbox.info.limits.pids == 512 for sandbox in forked_sandboxes)  # the source's limits
    again = await client.fork(snapshot.snapshot_id, "group-7", 3)  # a retried fork: the same leases
    assert [fork.lease_id for fork in again] == [fork.lease_id for fork in forks]


async def test_fork_refuses_unknown_snapshots_and_all_or_nothing_at_capacity(tmp_path):
    broker, _, _ = make_broker(tmp_path, max_sandboxes=3)
    unknown = await broker.fork(SandboxForkRequest(snapshot_id="nope", holder="g"))
    assert unknown.error_kind == "unknown_snapshot"
    source = (await broker.lease(SandboxLeaseRequest(holder="p"))).lease_id
    snapshot = await broker.snapshot(SandboxSnapshotRequest(lease_id=source))
    refused = await broker.fork(SandboxForkRequest(snapshot_id=snapshot.snapshot_id, holder="g", count=3))
    assert refused.error_kind == "capacity" and refused.leases == []
    assert broker.stats().active_leases == 1


async def test_snapshots_past_the_cap_drop_the_least_recently_used(tmp_path):
    broker, _, clock = make_broker(tmp_path, max_snapshots=2)
    lease = (await broker.lease(SandboxLeaseRequest(holder="p"))).lease_id
    taken = [(await broker.snapshot(SandboxSnapshotRequest(lease_id=lease))).snapshot_id for _ in range(2)]
    clock.advance(1.0)
    await broker.fork(SandboxForkRequest(snapshot_id=taken[0], holder="g"))  # uses the first
    third = (await broker.snapshot(SandboxSnapshotRequest(lease_id=lease))).snapshot_id
    assert broker.stats().snapshots == 2
    gone = await broker.fork(SandboxForkRequest(snapshot_id=taken[1], holder="h"))
    assert gone.error_kind == "unknown_snapshot"
    kept = await broker.fork(SandboxForkRequest(snapshot_id=third, holder="i"))
    assert kept.error_kind == ""


async def test_every_request_the_client_makes_for_a_rollout_names_it(tmp_path):
    broker, _, _ = make_broker(tmp_path)

    class RecordingRequester(InProcessRequester):
        def __init__(self, broker: SandboxBroker) -> None:
            super().__init__(broker)
            self.sent: list = []

        async def request(self, subject, message, timeout_s):
            self.sent.append(message)
            return await super().request(subject, message, timeout_s)

    requester = RecordingRequester(broker)
    client = SandboxBrokerClient(requester, chunk_bytes=1024)
    lease = (await client.lease("r-7", rollout_id="r-7")).lease_id
    await client.heartbeat(lease, rollout_id="r-7")
    await client.exec(lease, ["true"], rollout_id="r-7")
    await client.upload(lease, "big", b"x" * 3000, rollout_id="r-7")  # three chunks
    assert await client.download(lease, "big", rollout_id="r-7") == b"x" * 3000
    snapshot = (await client.snapshot(lease, rollout_id="r-7")).snapshot_id
    (forked,) = await client.fork(snapshot, "r-7", 1, rollout_id="r-7")
    for held in (forked.lease_id, lease):
        await client.release(held, rollout_id="r-7")
    assert {type(m).__name__ for m in requester.sent} == {
        "SandboxLeaseRequest", "SandboxHeartbeatRequest", "SandboxExecRequest", "SandboxUploadRequest",
        "SandboxDownloadRequest", "SandboxSnapshotRequest", "SandboxForkRequest", "SandboxReleaseRequest"}
    assert len(requester.sent) >= 12 and {m.rollout_id for m in requester.sent} == {"r-7"}


# -- every reply is typed --------------------------------------------------------------------------

@pytest.mark.parametrize("operation, request_", [
    ("exec", SandboxExecRequest(lease_id="nope", argv=["true"])),
    ("upload", SandboxUploadRequest(lease_id="nope", path="f", data=b"", size=0, sha256=SHA_OF_NOTHING)),
    ("download", SandboxDownloadRequest(lease_id="nope", path="f")),
    ("snapshot", SandboxSnapshotRequest(lease_id="nope")),
    ("heartbeat", SandboxHeartbeatRequest(lease_id="nope")),
    ("release", SandboxReleaseRequest(lease_id="nope")),
])
async def test_every_operation_on_an_unknown_lease_answers_unknown_lease(tmp_path, operation, request_):
    broker, _, _ = make_broker(tmp_path)
    reply = await getattr(broker, operation)(request_)
    assert reply.error_kind == "unknown_lease" and reply.error


async def test_close_destroys_every_sandbox_leased_and_warm(tmp_path):
    broker, backend, _ = make_broker(tmp_path, warm_min=2)
    await broker.resize_pools()
    await broker.lease(SandboxLeaseRequest(holder="a", limits=SandboxLimitsSpec(pids=300)))
    await broker.close()
    assert backend.live() == [] and len(backend.created) == 3
