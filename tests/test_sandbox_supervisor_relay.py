"""The supervisor's relay, in this process: large frames from a broker reach the guest's pipe
whole (spliced from the socket when all of their payload is there), and a broker gone inside
such a frame leaves no part of it in the pipe, its upload aborted. The "guest" is ``cat``
writing what reaches its stdin to a file, read back as frames.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess

import pytest

from rollmesh.sandbox import guest_wire as wire
from rollmesh.sandbox import supervisor_splice
from rollmesh.sandbox.supervisor_relay import Conn, Held
from rollmesh.sandbox.supervisor_splice import SPLICE_AT
from rollmesh.sandbox.supervisor_wire import tune

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


def frames_in(path) -> list[tuple[dict, bytes]]:
    reader, found = wire.FrameReader(wire.CHUNK + 65536), []
    fd = os.open(path, os.O_RDONLY)
    try:
        while True:
            try:
                found += [(header, bytes(payload)) for header, payload in reader.read(fd)]
            except EOFError:
                break
    finally:
        os.close(fd)
    assert reader._start == reader._end and reader._big is None, "a part frame reached the guest"
    return found


async def relay_to_cat(tmp_path, sent: list[bytes]) -> list[tuple[dict, bytes]]:
    """Write ``sent`` (raw bytes) as one broker, then hang up; what the guest's stdin got."""
    out = tmp_path / "guest-stdin"
    process = subprocess.Popen(["sh", "-c", f"cat > {out}"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               bufsize=0)
    held = Held("s1", {}, process, os.open(os.devnull, os.O_RDONLY), [])
    broker, ours = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    for sock in (broker, ours):
        tune(sock)
    for data in sent:  # all queued before the relay reads: a whole large frame is spliced
        broker.sendall(data)
    broker.close()
    ours.setblocking(False)
    held.attach(Conn(held, ours), None)
    while held.conns or held.writer.pending:
        await asyncio.sleep(0.01)  # polled: the relay runs on this loop
    held.close_stdin()
    await asyncio.wait_for(held.exited.wait(), 30)
    held.forget()
    return frames_in(out)


async def test_a_frame_above_the_splice_threshold_reaches_the_guest_whole_by_splice(tmp_path, monkeypatch):
    assert supervisor_splice.splice_usable()  # asked (once, cached) before the count starts
    spliced: list[int] = []
    real_splice = os.splice

    def counting(*args, **kwargs):
        count = real_splice(*args, **kwargs)
        spliced.append(count)
        return count

    monkeypatch.setattr(supervisor_splice.os, "splice", counting)
    big, small = os.urandom(3 * SPLICE_AT), b"small"
    got = await relay_to_cat(tmp_path, [
        wire.encode_head({"id": 7, "op": "put_file", "path": "a.bin", "size": len(big), "last": True}, len(big)) + big,
        wire.encode_head({"id": 8, "op": "put_file", "path": "b.bin", "size": 5, "last": True}, 5) + small,
    ])
    assert [(h["op"], h["id"], h["path"]) for h, _ in got] == [("put_file", 1, "a.bin"), ("put_file", 2, "b.bin")]
    assert got[0][1] == big and got[1][1] == small
    assert sum(spliced) == len(big)  # the large payload never passed through this process


async def test_a_broker_cut_inside_a_large_frame_leaves_no_part_of_it_and_aborts_its_upload(tmp_path):
    whole, cut = os.urandom(2 * SPLICE_AT), os.urandom(SPLICE_AT)
    got = await relay_to_cat(tmp_path, [
        wire.encode_head({"id": 1, "op": "put_file", "path": "c.bin", "size": 8 * SPLICE_AT, "last": False}, 0),
        wire.encode_head({"id": 1, "op": "chunk"}, len(whole)) + whole,
        wire.encode_head({"id": 1, "op": "chunk"}, 3 * SPLICE_AT) + cut,  # the broker dies here
    ])
    assert [h for h, _ in got] == [
        {"id": 1, "op": "put_file", "path": "c.bin", "size": 8 * SPLICE_AT, "last": False},
        {"id": 1, "op": "chunk"},
        {"id": 1, "op": "chunk", "last": True, "abort": True},  # the supervisor's: nothing stored
    ]
    assert got[1][1] == whole
