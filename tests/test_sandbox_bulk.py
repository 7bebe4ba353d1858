"""The bulk data path: files above sandbox.bulk_threshold_bytes move over a direct stream to the
broker (Unix socket, TCP, TLS), opened with a one-time token issued over NATS's request/reply
(here: in process); every bad stream is refused with its typed error and nothing is stored.

Broker and client run in this process on real sockets, against the process backend's real
guests (the guest's own write-then-rename is what keeps a refused file out of the workspace).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import ssl
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest
import pytest_asyncio
import trustme
from support.fakes import ManualClock

from rollmesh.bus.tls import client_tls_context, server_tls_context
from rollmesh.config import NatsTlsConfig, SandboxConfig, SandboxProfileConfig
from rollmesh.messages.sandbox import SandboxUploadRequest
from rollmesh.messages.sandbox_bulk import SandboxBulkDone, SandboxBulkHello
from rollmesh.messages.subjects import SANDBOX_UPLOAD
from rollmesh.sandbox import SandboxBroker, SandboxBrokerClient
from rollmesh.sandbox.bulk_stream import ReceiveBuffers, frame, stream_route, upload_over_stream
from rollmesh.sandbox.bulk_tokens import BulkTokens
from rollmesh.sandbox.errors import BulkStreamError, BulkTokenError
from rollmesh.sandbox.in_process import InProcessRequester
from rollmesh.sandbox.leases import Lease
from rollmesh.sandbox.process_backend import ProcessBackend

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]
MIB = 1024 * 1024


def make_broker(tmp_path: Path) -> SandboxBroker:
    config = SandboxConfig(backend="process", profiles={"default": SandboxProfileConfig(warm_min=0)})
    return SandboxBroker(config, ProcessBackend(root_dir=tmp_path / "boxes"), snapshot_dir=tmp_path / "snap")


@pytest_asyncio.fixture
async def broker(tmp_path: Path) -> AsyncIterator[SandboxBroker]:
    broker = make_broker(tmp_path)
    server = await broker.serve_bulk()
    yield broker
    await server.close()
    await broker.close()


async def ticket_for(broker: SandboxBroker, lease_id: str, path: str, size: int):
    reply = await broker.upload(SandboxUploadRequest(lease_id=lease_id, path=path, data=b"", size=size,
                                                     sha256="", bulk=True))
    assert reply.error_kind == "" and reply.bulk is not None, reply
    return reply.bulk


async def done_frame(reader: asyncio.StreamReader) -> SandboxBulkDone:
    """The broker's one frame, read by hand (a client that does not use rollmesh's)."""
    length = int.from_bytes(await reader.readexactly(4), "big")
    return msgspec.msgpack.decode(await reader.readexactly(length), type=SandboxBulkDone)


async def workspace(client: SandboxBrokerClient, lease_id: str) -> list[str]:
    """Every name in the workspace, hidden ones (an upload's temporary file) included."""
    reply = await client.exec(lease_id, ["ls", "-A"])
    return reply.stdout.decode().split()


async def test_files_above_the_threshold_go_over_the_stream_verified_and_small_ones_over_nats(broker):
    client = SandboxBrokerClient(InProcessRequester(broker))
    lease = (await client.lease("bulk-1")).lease_id
    big, small = os.urandom(MIB + 7), os.urandom(1000)
    stored = await client.upload(lease, "big.bin", big)
    assert stored.complete and stored.sha256 == hashlib.sha256(big).hexdigest()
    await client.upload(lease, "small.bin", small)
    assert broker.counts["bulk_uploads"] == 1 and broker.counts["uploads"] == 2
    assert await client.download(lease, "big.bin") == big
    assert await client.download(lease, "small.bin") == small
    assert broker.counts["bulk_downloads"] == 1 and broker.counts["downloads"] == 2
    tar = await client.download(lease, ".", kind="tar")  # a directory's tar, also above the threshold
    await client.upload(lease, "copy", tar, kind="tar")
    assert await client.download(lease, "copy/big.bin") == big
    assert broker.counts["bulk_uploads"] == 2


async def test_a_client_from_the_deployments_config_takes_its_bulk_threshold(broker):
    # The rollout workers and `rollmesh sandbox` build their clients so: a file of 100 KiB goes
    # over NATS under a 1 MiB threshold and over the stream under the 64 KiB default.
    data = os.urandom(100 * 1024)
    raised = SandboxBrokerClient.from_config(InProcessRequester(broker), SandboxConfig(bulk_threshold_bytes=MIB))
    lease = (await raised.lease("bulk-config")).lease_id
    await raised.upload(lease, "over-nats.bin", data)
    assert broker.counts["bulk_uploads"] == 0 and broker.counts["uploads"] == 1
    default = SandboxBrokerClient.from_config(InProcessRequester(broker), SandboxConfig())
    await default.upload(lease, "over-the-stream.bin", data)
    assert broker.counts["bulk_uploads"] == 1 and broker.counts["uploads"] == 2
    assert await default.download(lease, "over-nats.bin") == data


class CountingRequester(InProcessRequester):
    """Counts the bulk tickets asked for."""

    tickets = 0

    async def request(self, subject, message, timeout_s):
        self.tickets += bool(getattr(message, "bulk", False) and subject is SANDBOX_UPLOAD)
        return await super().request(subject, message, timeout_s)


async def test_a_stored_uploads_done_brings_the_next_ticket_and_a_spent_one_is_replaced(broker):
    requester = CountingRequester(broker)
    client = SandboxBrokerClient(requester)
    lease = (await client.lease("bulk-kept")).lease_id
    data = os.urandom(MIB)
    await client.upload(lease, "one", data)
    assert requester.tickets == 1  # its own; the next upload's came in this one's Done frame
    await client.upload(lease, "two", data)
    assert requester.tickets == 1  # no ticket round trip over NATS before (or after) the bytes
    # The kept ticket spent elsewhere (as after a broker restart): refused once, then a fresh one.
    kept = client._bulk.kept[lease]
    spent_elsewhere = await upload_over_stream(kept, "unix", lease_id=lease, path="three", data=data,
                                               sha256=hashlib.sha256(data).hexdigest(), tls=None)
    assert spent_elsewhere.error_kind == "" and spent_elsewhere.next_ticket is not None
    assert spent_elsewhere.next_ticket.token != kept.token
    assert (await client.upload(lease, "four", data)).complete
    assert requester.tickets == 2  # the spent one's replacement
    # A refused upload's Done brings no ticket: the kept one is the one its stored upload gave.
    refused = await upload_over_stream(client._bulk.kept[lease], "unix", lease_id=lease, path="bad",
                                       data=data, sha256="0" * 64, tls=None)
    assert refused.error_kind == "checksum_mismatch" and refused.next_ticket is None
    # A kept ticket whose stream is gone (its broker restarted): a fresh ticket, not NATS.
    client._bulk.kept[lease] = msgspec.structs.replace(client._bulk.kept[lease], unix_path="/nonexistent/s",
                                                       port=1)
    assert (await client.upload(lease, "five", data)).complete
    assert await workspace(client, lease) == ["five", "four", "one", "three", "two"]
    assert broker.counts["bulk_uploads"] == 5


async def test_a_broker_without_a_bulk_server_takes_large_files_over_nats(tmp_path):
    broker = make_broker(tmp_path)
    try:
        client = SandboxBrokerClient(InProcessRequester(broker))
        lease = (await client.lease("bulk-2")).lease_id
        data = os.urandom(MIB)
        assert (await client.upload(lease, "f", data)).complete
        assert await client.download(lease, "f") == data
        assert broker.counts["bulk_uploads"] == broker.counts["bulk_downloads"] == 0
    finally:
        await broker.close()


async def test_each_bad_stream_is_refused_typed_and_nothing_is_stored(broker):
    client = SandboxBrokerClient(InProcessRequester(broker))
    mine, other = (await client.lease("bulk-mine")).lease_id, (await client.lease("bulk-other")).lease_id
    data = os.urandom(MIB)
    sha = hashlib.sha256(data).hexdigest()

    async def send(ticket, lease_id: str, path: str, digest=sha) -> SandboxBulkDone:
        return await upload_over_stream(ticket, "unix", lease_id=lease_id, path=path, data=data, sha256=digest,
                                        tls=None)

    ticket = await ticket_for(broker, mine, "forged", len(data))
    forged = msgspec.structs.replace(ticket, token="not-a-token-the-broker-issued")
    assert (await send(forged, mine, "forged")).error_kind == "bad_token"
    # A token shown with another lease's id is refused, and spent: its own lease cannot use it either.
    assert (await send(ticket, other, "borrowed")).error_kind == "bad_token"
    assert (await send(ticket, mine, "borrowed")).error_kind == "bad_token"
    wrong = await send(await ticket_for(broker, mine, "wrong-digest", len(data)), mine, "wrong-digest",
                       digest=hashlib.sha256(b"other bytes").hexdigest())
    assert wrong.error_kind == "checksum_mismatch"
    # The same with the digest after the bytes (as rollmesh's client sends it, hashing meanwhile).
    trailing = await send(await ticket_for(broker, mine, "wrong-trailer", len(data)), mine, "wrong-trailer",
                          digest=asyncio.ensure_future(asyncio.sleep(0, result=hashlib.sha256(b"x").hexdigest())))
    assert trailing.error_kind == "checksum_mismatch"
    empty = await upload_over_stream(await ticket_for(broker, mine, "empty", 0), "unix", lease_id=mine, path="empty",
                                     data=b"", tls=None, sha256=asyncio.ensure_future(asyncio.sleep(0, result=sha)))
    assert empty.error_kind == "checksum_mismatch"  # even an empty file's digest is checked
    # Truncated: the stream announces 1 MiB and ends after half of it.
    ticket = await ticket_for(broker, mine, "truncated", len(data))
    reader, writer = await asyncio.open_unix_connection(ticket.unix_path)
    writer.write(frame(SandboxBulkHello(token=ticket.token, lease_id=mine, size=len(data), sha256=sha,
                                        path="truncated")))
    writer.write(data[: len(data) // 2])
    writer.write_eof()
    truncated = await done_frame(reader)
    writer.close()
    assert truncated.error_kind == "transfer_error"
    assert f"after {len(data) // 2} of {len(data)} bytes" in truncated.error
    # One good upload, then the same token again: used once only.
    ticket = await ticket_for(broker, mine, "good", len(data))
    assert (await send(ticket, mine, "good")).sha256 == sha
    reused = await send(ticket, mine, "again")
    assert reused.error_kind == "bad_token" and "already used" in reused.error
    assert await workspace(client, mine) == ["good"]
    assert await workspace(client, other) == []


def test_tokens_are_one_time_lapse_and_name_why_they_are_refused():
    clock = ManualClock()
    tokens = BulkTokens(ttl_s=30.0, clock=clock)
    lease = Lease("lease-a", "holder", None, None, 0.0)  # type: ignore[arg-type]
    grant = tokens.issue("upload", lease, "f", size=10)
    with pytest.raises(BulkTokenError) as refused:
        tokens.take(grant.token, "lease-b")
    assert (refused.value.reason, refused.value.lease_id) == ("other_lease", "lease-b")
    with pytest.raises(BulkTokenError) as refused:
        tokens.take(grant.token, "lease-a")
    assert refused.value.reason == "spent"
    with pytest.raises(BulkTokenError) as refused:
        tokens.take("never-issued", "lease-a")
    assert refused.value.reason == "unknown"
    late = tokens.issue("upload", lease, "f", size=10)
    clock.advance(30.0)
    with pytest.raises(BulkTokenError) as refused:
        tokens.take(late.token, "lease-a")
    assert refused.value.reason == "expired"
    kept = [tokens.issue("download", lease, f"f{n}") for n in range(6)]  # at most 4 per lease live
    assert len(tokens) == 4
    assert tokens.take(kept[-1].token, "lease-a") is kept[-1]
    with pytest.raises(BulkTokenError):
        tokens.take(kept[0].token, "lease-a")
    lease.transfers.clear()  # the lease ended: its tokens (a download's holds bytes) go at the next sweep
    assert tokens.drop_lapsed() == 3 and len(tokens) == 0


@pytest.fixture(scope="module")
def tls_material(tmp_path_factory: pytest.TempPathFactory) -> NatsTlsConfig:
    directory = tmp_path_factory.mktemp("bulk-pki")
    ca = trustme.CA()
    server, client = ca.issue_cert("127.0.0.1"), ca.issue_cert("rollout-worker@example.org")
    ca.cert_pem.write_to_path(str(directory / "ca.pem"))
    for name, cert in (("server", server), ("client", client)):
        cert.cert_chain_pems[0].write_to_path(str(directory / f"{name}.pem"))
        cert.private_key_pem.write_to_path(str(directory / f"{name}.key"))
    # Mutual TLS, as security.nats_tls with verify: the broker requires the client's certificate.
    return NatsTlsConfig(enabled=True, ca_file=str(directory / "ca.pem"), verify=True,
                         cert_file=str(directory / "client.pem"), key_file=str(directory / "client.key"),
                         server_cert_file=str(directory / "server.pem"),
                         server_key_file=str(directory / "server.key"))


async def test_the_tcp_stream_speaks_mutual_tls_and_a_client_without_the_ca_has_no_route(tmp_path, tls_material):
    broker = make_broker(tmp_path)
    server = await broker.serve_bulk(tls=server_tls_context(tls_material))
    try:
        client = SandboxBrokerClient(InProcessRequester(broker), bulk_tls=client_tls_context(tls_material))
        lease = (await client.lease("bulk-tls")).lease_id
        data = os.urandom(MIB)
        ticket = await ticket_for(broker, lease, "over-tls", len(data))
        assert ticket.tls and ticket.host == "127.0.0.1" and ticket.port > 0
        done = await upload_over_stream(ticket, "tcp", lease_id=lease, path="over-tls", data=data,
                                        sha256=hashlib.sha256(data).hexdigest(), tls=client._bulk.tls)
        assert (done.error_kind, done.size) == ("", len(data))
        # From another node (no Unix socket) a client that cannot verify TLS has no route...
        remote = msgspec.structs.replace(ticket, unix_path="")
        assert stream_route(remote, client._bulk.tls) == "tcp" and stream_route(remote, None) is None
        # ...and a plaintext connection to the TLS port stores nothing.
        reader, writer = await asyncio.open_connection(ticket.host, ticket.port)
        writer.write(frame(SandboxBulkHello(token=ticket.token, lease_id=lease, size=3, sha256="")))
        await writer.drain()
        assert await reader.read() == b""  # the handshake failed: closed
        writer.close()
        # A client that trusts the CA but shows no certificate of its own is cut off.
        anonymous = ssl.create_default_context(cafile=tls_material.ca_file)
        ticket = await ticket_for(broker, lease, "anonymous", len(data))
        with pytest.raises((OSError, BulkStreamError)):
            await upload_over_stream(ticket, "tcp", lease_id=lease, path="anonymous", data=data,
                                     sha256=hashlib.sha256(data).hexdigest(), tls=anonymous)
        assert await client.download(lease, "over-tls") == data
        assert await workspace(client, lease) == ["over-tls"]
    finally:
        await server.close()
        await broker.close()


def test_receive_buffers_are_kept_for_uploads_of_similar_size_up_to_a_cap():
    buffers = ReceiveBuffers(keep_bytes=3 * 1024 * 1024)
    first = buffers.take(1024 * 1024 - 5)
    assert len(first) == 1024 * 1024  # rounded up to a power of two
    buffers.give_back(first)
    assert buffers.take(1024 * 1024) is first  # the same pages, faulted in already
    assert buffers.take(1024 * 1024) is not first  # taken: a concurrent upload gets its own
    assert len(buffers.take(10)) == ReceiveBuffers.MIN_KEPT
    big = buffers.take(3 * 1024 * 1024)
    buffers.give_back(first)
    buffers.give_back(big)  # 1 MiB + 4 MiB is above the cap: this one is dropped
    assert buffers.take(3 * 1024 * 1024) is not big
    assert buffers.take(1024 * 1024) is first
