"""Bulk uploads handed to the sandbox supervisor: over the broker's Unix socket, once the token is
checked, the client's socket goes to the supervisor holding the sandbox, which moves the bytes
into the guest; the broker only answers. Every refusal of the broker's own relay holds here too
(typed, nothing stored), and a stream cut mid-piece leaves the guest's pipe in step.

Broker and client run in this process on real sockets; the sandboxes are the process backend's
real guests, held by a real supervisor process.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest
import pytest_asyncio

from rollmesh.config import SandboxConfig, SandboxProfileConfig
from rollmesh.messages.sandbox import SandboxUploadRequest
from rollmesh.messages.sandbox_bulk import SandboxBulkDigest, SandboxBulkDone, SandboxBulkHello
from rollmesh.sandbox import SandboxBroker, SandboxBrokerClient
from rollmesh.sandbox.bulk_stream import frame, upload_over_stream
from rollmesh.sandbox.in_process import InProcessRequester
from rollmesh.sandbox.process_backend import ProcessBackend
from rollmesh.sandbox.supervisor_bulk import HandOffStreamError, digest_of
from rollmesh.sandbox.supervisor_client import SupervisorClient

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]
MIB = 1024 * 1024


@pytest_asyncio.fixture
async def broker(tmp_path: Path) -> AsyncIterator[SandboxBroker]:
    config = SandboxConfig(backend="process", profiles={"default": SandboxProfileConfig(warm_min=0)})
    backend = ProcessBackend(root_dir=tmp_path / "boxes")
    (tmp_path / "run").mkdir()
    backend.supervisor = SupervisorClient(tmp_path / "run", broker="handoff", idle_exit_s=5)
    broker = SandboxBroker(config, backend, snapshot_dir=tmp_path / "snap")
    server = await broker.serve_bulk()
    yield broker
    await server.close()
    await broker.close()


async def ticket_for(broker: SandboxBroker, lease_id: str, size: int):
    reply = await broker.upload(SandboxUploadRequest(lease_id=lease_id, path="x", data=b"", size=size,
                                                     sha256="", bulk=True))
    assert reply.error_kind == "" and reply.bulk is not None, reply
    return reply.bulk


def later(value: str) -> asyncio.Future:
    """A digest still being computed: sent after the bytes, as rollmesh's client does."""
    return asyncio.ensure_future(asyncio.sleep(0, result=value))


async def workspace(client: SandboxBrokerClient, lease_id: str) -> list[str]:
    """Every name in the workspace, hidden ones (an upload's temporary file) included."""
    return (await client.exec(lease_id, ["ls", "-A"])).stdout.decode().split()


async def test_uploads_over_the_unix_socket_skip_the_broker_and_are_stored_verified(broker):
    client = SandboxBrokerClient(InProcessRequester(broker))
    lease = (await client.lease("handoff-good")).lease_id
    for name, size in (("one", MIB), ("several", 3 * MIB + 12345), ("small", 70_000)):
        data = os.urandom(size)
        sha = hashlib.sha256(data).hexdigest()
        for how, digest in (("known", sha), ("trailing", later(sha))):
            done = await upload_over_stream(await ticket_for(broker, lease, size), "unix", lease_id=lease,
                                            path=f"{name}-{how}", data=data, sha256=digest, tls=None)
            assert (done.error_kind, done.size, done.sha256) == ("", size, sha)
            assert done.next_ticket is not None
            got = await client.download(lease, f"{name}-{how}")
            assert hashlib.sha256(got).hexdigest() == sha
    empty = await upload_over_stream(await ticket_for(broker, lease, 0), "unix", lease_id=lease, path="empty",
                                     data=b"", sha256=later(hashlib.sha256(b"").hexdigest()), tls=None)
    assert (empty.error_kind, empty.size) == ("", 0)
    assert broker.counts["bulk_handed_off"] == 7


async def test_handed_off_uploads_are_refused_typed_and_a_cut_stream_leaves_the_guest_in_step(broker):
    client = SandboxBrokerClient(InProcessRequester(broker))
    mine = (await client.lease("handoff-bad")).lease_id
    data = os.urandom(2 * MIB)
    sha = hashlib.sha256(data).hexdigest()
    other = hashlib.sha256(b"other bytes").hexdigest()

    async def send(path: str, digest) -> object:
        return await upload_over_stream(await ticket_for(broker, mine, len(data)), "unix", lease_id=mine,
                                        path=path, data=data, sha256=digest, tls=None)

    # The token is the broker's to check before anything is handed off.
    ticket = await ticket_for(broker, mine, len(data))
    forged = msgspec.structs.replace(ticket, token="not-a-token-the-broker-issued")
    theirs = (await client.lease("handoff-other")).lease_id
    for shown, lease_id in ((forged, mine), (ticket, theirs), (ticket, mine)):  # the last: spent by the second
        refused = await upload_over_stream(shown, "unix", lease_id=lease_id, path="borrowed", data=data,
                                           sha256=sha, tls=None)
        assert refused.error_kind == "bad_token"
    assert (await send("wrong-hello", other)).error_kind == "checksum_mismatch"
    assert (await send("wrong-trailer", later(other))).error_kind == "checksum_mismatch"
    assert (await send("../escape", sha)).error_kind != ""
    # Cut inside the second piece: the first went to the guest whole, the second never does.
    for cut, digest in ((MIB + MIB // 2, sha), (len(data), "")):
        ticket = await ticket_for(broker, mine, len(data))
        reader, writer = await asyncio.open_unix_connection(ticket.unix_path)
        writer.write(frame(SandboxBulkHello(token=ticket.token, lease_id=mine, size=len(data), sha256=digest,
                                            path="truncated")))
        writer.write(data[:cut])
        writer.write_eof()  # (the second: every byte, then no digest)
        length = int.from_bytes(await reader.readexactly(4), "big")
        truncated = msgspec.msgpack.decode(await reader.readexactly(length), type=SandboxBulkDone)
        writer.close()
        assert truncated.error_kind == "transfer_error", truncated
        if digest:
            assert f"after {cut} of {len(data)} bytes" in truncated.error
    # The guest is in step: a good upload after all that lands, and it alone.
    good = await send("good", later(sha))
    assert (good.error_kind, good.sha256) == ("", sha)
    assert await workspace(client, mine) == ["good"]
    assert await workspace(client, theirs) == []
    assert broker.counts["bulk_handed_off"] == 1


def test_the_supervisors_digest_reader_takes_only_a_digest_frame():
    sha = hashlib.sha256(b"x").hexdigest()
    assert digest_of(msgspec.msgpack.encode(SandboxBulkDigest(sha256=sha))) == sha
    for body in (msgspec.msgpack.encode(SandboxBulkDone(sha256=sha)), b"\x81\xa6sha256\x01", b"\x92",
                 msgspec.msgpack.encode({"type": "sandbox.bulk_digest", "sha256": "not hex"})):
        with pytest.raises(HandOffStreamError) as refused:
            digest_of(body)
        assert refused.value.reason == "framing"


async def test_a_broker_gone_mid_upload_ends_it_and_nothing_lands(broker):
    client = SandboxBrokerClient(InProcessRequester(broker))
    lease = (await client.lease("handoff-gone")).lease_id
    data = os.urandom(3 * MIB)
    ticket = await ticket_for(broker, lease, len(data))
    reader, writer = await asyncio.open_unix_connection(ticket.unix_path)
    writer.write(frame(SandboxBulkHello(token=ticket.token, lease_id=lease, size=len(data), path="partial",
                                        sha256=hashlib.sha256(data).hexdigest())))
    writer.write(data[: MIB + MIB // 2])  # the first piece goes to the guest; the client then stalls
    await writer.drain()
    while len(await workspace(client, lease)) == 0:
        pass  # polled: the guest has opened the upload's temporary file once the first piece is in
    # The broker's channel to the supervisor ends, as when the broker dies.
    broker.backend.supervisor.hand_off_channel().close()
    length = int.from_bytes(await reader.readexactly(4), "big")
    done = msgspec.msgpack.decode(await reader.readexactly(length), type=SandboxBulkDone)
    writer.close()
    assert done.error_kind == "transfer_error", done
    while await workspace(client, lease):
        pass  # polled: the guest drops the upload a moment after the supervisor ends it
    # The guest's pipe is still in step: the next upload (a new channel) lands.
    sha = hashlib.sha256(data).hexdigest()
    good = await upload_over_stream(await ticket_for(broker, lease, len(data)), "unix", lease_id=lease,
                                    path="good", data=data, sha256=later(sha), tls=None)
    assert (good.error_kind, good.sha256) == ("", sha)
    assert await workspace(client, lease) == ["good"]
