"""connect_bus: fails fast on a bad URL (credentials redacted), reconnects after a NATS restart."""

from __future__ import annotations

import asyncio
import time

import pytest

from rollmesh.bus.connection import connect_bus
from rollmesh.bus.embedded_server import EmbeddedNatsServer
from rollmesh.bus.errors import BusConnectError
from rollmesh.bus.publisher import BusPublisher
from rollmesh.bus.streams import ensure_streams, rollout_requests_stream
from rollmesh.messages import RolloutRequested
from rollmesh.messages.subjects import ROLLOUT_REQUESTED

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


async def test_unreachable_url_raises_with_credentials_redacted(tmp_path):
    # A port nobody listens on: take one from a server we stop at once.
    with EmbeddedNatsServer(tmp_path / "gone") as server:
        url = server.url.replace("nats://", "nats://alice:s3cret@")
    with pytest.raises(BusConnectError) as info:
        await asyncio.wait_for(connect_bus(url, name="probe", connect_timeout_s=0.5), 10)
    assert "s3cret" not in str(info.value) and "s3cret" not in info.value.url


async def test_client_reconnects_after_restart_and_acked_messages_survive(tmp_path, namespace):
    store = tmp_path / "store"
    server = EmbeddedNatsServer(store)
    server.start()
    port = server.port
    nc = await connect_bus(server.url, name="survivor", connect_timeout_s=5)
    try:
        js = nc.jetstream()
        await ensure_streams(js, namespace)
        await BusPublisher(nc, js, namespace).publish(
            ROLLOUT_REQUESTED, RolloutRequested(rollout_id="kept", task="t"))

        server.stop()
        server = EmbeddedNatsServer(store, port=port)  # same port and store: a restart
        server.start()

        deadline = time.monotonic() + 20
        # nats-py offers no awaitable for "reconnected" outside its callback: poll with backoff.
        while not (nc.is_connected and nc.stats["reconnects"] >= 1):
            assert time.monotonic() < deadline, "client did not reconnect"
            await asyncio.sleep(0.05)
        info = await asyncio.wait_for(js.stream_info(rollout_requests_stream(namespace)), 10)
        assert info.state.messages == 1
    finally:
        await nc.close()
        server.stop()
