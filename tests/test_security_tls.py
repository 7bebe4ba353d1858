"""TLS to NATS against a real nats-server: plaintext refused, mutual TLS needs a client certificate.

Certificates are made here with ``trustme`` (a throwaway CA, a server certificate for 127.0.0.1
and a client certificate); the servers are embedded nats-servers with the rendered ``tls { }``.
"""

from __future__ import annotations

import asyncio
import json
import ssl
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import trustme

from rollmesh.bus.connection import connect_bus
from rollmesh.bus.embedded_server import EmbeddedNatsServer
from rollmesh.bus.errors import BusSecurityError, BusTlsError
from rollmesh.bus.tls import client_tls_context, server_tls_block
from rollmesh.config import NatsTlsConfig

pytestmark = pytest.mark.timeout(60)


@dataclass(frozen=True)
class Pki:
    ca_file: str
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    directory = tmp_path_factory.mktemp("pki")
    ca = trustme.CA()
    server = ca.issue_cert("127.0.0.1", "localhost")
    client = ca.issue_cert("rollmesh-client@example.org")
    ca.cert_pem.write_to_path(str(directory / "ca.pem"))
    server.cert_chain_pems[0].write_to_path(str(directory / "server.pem"))
    server.private_key_pem.write_to_path(str(directory / "server.key"))
    client.cert_chain_pems[0].write_to_path(str(directory / "client.pem"))
    client.private_key_pem.write_to_path(str(directory / "client.key"))
    return Pki(*(str(directory / name) for name in
                 ("ca.pem", "server.pem", "server.key", "client.pem", "client.key")))


def tls_server(directory: Path, pki: Pki, *, verify: bool) -> EmbeddedNatsServer:
    config = NatsTlsConfig(enabled=True, ca_file=pki.ca_file, server_cert_file=pki.server_cert,
                           server_key_file=pki.server_key, verify=verify)
    return EmbeddedNatsServer(directory, tls_config=server_tls_block(config))


@pytest.fixture(scope="module")
def tls_only(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedNatsServer]:
    with tls_server(tmp_path_factory.mktemp("tls-nats"), pki, verify=False) as server:
        yield server


@pytest.fixture(scope="module")
def mutual_tls(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedNatsServer]:
    with tls_server(tmp_path_factory.mktemp("mtls-nats"), pki, verify=True) as server:
        yield server


async def round_trip(nc) -> bytes:
    sub = await nc.subscribe("tls.check")
    await nc.publish("tls.check", b"over tls")
    msg = await sub.next_msg(timeout=5)
    return msg.data


@pytest.mark.integration
async def test_a_plaintext_connection_to_a_tls_only_server_fails(tls_only: EmbeddedNatsServer) -> None:
    # A raw client that speaks the protocol in plaintext: told TLS is required, and cut off.
    reader, writer = await asyncio.open_connection("127.0.0.1", tls_only.port)
    try:
        info = await asyncio.wait_for(reader.readline(), 5)
        assert json.loads(info.split(b" ", 1)[1])["tls_required"] is True
        writer.write(b'CONNECT {"verbose":false}\r\nPING\r\n')
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), 10)  # until the server closes it
    finally:
        writer.close()
    assert b"PONG" not in answer


@pytest.mark.integration
async def test_a_client_that_does_not_trust_the_server_certificate_is_refused(
    tls_only: EmbeddedNatsServer,
) -> None:
    # No ca_file: the system store, which has never heard of the test CA. A failed handshake ends
    # the first connect at once (retrying cannot help), typed, however long the connect timeout.
    with pytest.raises(BusTlsError) as refused:
        await asyncio.wait_for(connect_bus(tls_only.url, name="untrusting", connect_timeout_s=600,
                                           tls=ssl.create_default_context()), 60)
    assert refused.value.verify_failed
    assert refused.value.reason == "certificate verify failed: unable to get local issuer certificate"


@pytest.mark.integration
async def test_a_client_verifying_the_server_gets_through(tls_only: EmbeddedNatsServer, pki: Pki) -> None:
    assert tls_only.url.startswith("tls://127.0.0.1:")  # the scheme says TLS is required
    context = client_tls_context(NatsTlsConfig(enabled=True, ca_file=pki.ca_file))
    nc = await connect_bus(tls_only.url, name="tls-client", tls=context)
    try:
        assert await round_trip(nc) == b"over tls"
    finally:
        await nc.close()


@pytest.mark.integration
async def test_mutual_tls_refuses_a_client_without_a_certificate(mutual_tls: EmbeddedNatsServer, pki: Pki) -> None:
    context = client_tls_context(NatsTlsConfig(enabled=True, ca_file=pki.ca_file))
    with pytest.raises(BusTlsError) as refused:
        await asyncio.wait_for(connect_bus(mutual_tls.url, name="no-cert", connect_timeout_s=600, tls=context), 60)
    assert not refused.value.verify_failed  # the server refused us, not we it
    assert "certificate required" in refused.value.reason


@pytest.mark.integration
async def test_mutual_tls_lets_a_client_with_a_certificate_in(mutual_tls: EmbeddedNatsServer, pki: Pki) -> None:
    context = client_tls_context(NatsTlsConfig(enabled=True, ca_file=pki.ca_file, cert_file=pki.client_cert,
                                               key_file=pki.client_key))
    nc = await connect_bus(mutual_tls.url, name="with-cert", tls=context)
    try:
        assert await round_trip(nc) == b"over tls"
    finally:
        await nc.close()


@pytest.mark.unit
def test_missing_tls_files_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(BusSecurityError, match="does not exist"):
        client_tls_context(NatsTlsConfig(enabled=True, ca_file=str(tmp_path / "nope.pem")))
    with pytest.raises(BusSecurityError, match="server_cert_file"):
        server_tls_block(NatsTlsConfig(enabled=True))
    assert client_tls_context(NatsTlsConfig()) is None
