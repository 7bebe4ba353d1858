"""The embedded nats-server: starts on a free port, is detected ready, stops, reports failures."""

from __future__ import annotations

import asyncio

import pytest

from rollmesh.bus.connection import connect_bus
from rollmesh.bus.embedded_server import EmbeddedNatsServer
from rollmesh.bus.errors import NatsServerStartError

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


async def test_embedded_server_is_ready_on_a_free_port_and_accepts_jetstream(tmp_path):
    with EmbeddedNatsServer(tmp_path / "store") as server:
        assert server.running and server.port > 0
        assert server.url == f"nats://127.0.0.1:{server.port}"
        nc = await connect_bus(server.url, name="probe", connect_timeout_s=5)
        info = await asyncio.wait_for(nc.jetstream().account_info(), 5)
        assert info is not None
        await nc.close()
        assert "Server is ready" in server.log_tail()
    assert not server.running
    with pytest.raises(NatsServerStartError):
        _ = server.port


async def test_wait_ready_detects_readiness_without_blocking_the_loop(tmp_path):
    server = EmbeddedNatsServer(tmp_path / "store")
    server.launch()
    try:
        url = await asyncio.wait_for(server.wait_ready(), 20)
        assert url.startswith("nats://127.0.0.1:")
    finally:
        server.stop()
    assert server.pid is None


def test_start_failure_raises_typed_error_with_log_tail(tmp_path, nats_server):
    clash = EmbeddedNatsServer(tmp_path / "store", port=nats_server.port)
    with pytest.raises(NatsServerStartError) as info:
        clash.start()
    assert info.value.returncode is not None
    assert "address already in use" in info.value.log_tail.lower()
    assert not clash.running


def test_stop_is_idempotent(tmp_path):
    server = EmbeddedNatsServer(tmp_path / "store")
    server.start()
    server.stop()
    server.stop()
    assert not server.running


async def test_embedded_server_accepts_messages_up_to_8_mib(nats_server):
    nc = await connect_bus(nats_server.url, name="probe", connect_timeout_s=5)
    try:
        assert nc.max_payload == 8 * 1024 * 1024
        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox)
        await nc.publish(inbox, b"x" * (6 * 1024 * 1024))
        msg = await sub.next_msg(timeout=5)
        assert len(msg.data) == 6 * 1024 * 1024
    finally:
        await nc.close()
