"""The sandbox guest and its host client: the frame codec, the workspace path and tar rules, and
round trips with a real guest process (the process backend, so no isolation is involved)."""

from __future__ import annotations

import asyncio
import hashlib
import io
import os
import random
import signal
import tarfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
from hypothesis import given, settings
from hypothesis import strategies as st
from support.waiting import WAIT_S

from rollmesh.sandbox import guest_files, guest_wire
from rollmesh.sandbox.errors import (
    ChecksumMismatchError,
    SandboxDiedError,
    TransferError,
    UnsafeArchiveError,
    WorkspacePathError,
)
from rollmesh.sandbox.process_backend import ProcessBackend
from rollmesh.sandbox.sandbox_protocol import SandboxLimits

pytestmark = [pytest.mark.timeout(60)]
integration = pytest.mark.integration  # the tests below that run a real guest process

LIMITS = SandboxLimits(memory_mb=512, pids=64, workspace_mb=256, exec_timeout_s=20.0, cpu_s=20,
                       file_size_mb=256, max_output_bytes=64 * 1024)


def make_tar(*members: tuple[str, str, bytes | str]) -> bytes:
    """(name, kind, data or link target) with kind "file" | "dir" | "symlink" | "hardlink" | "fifo"."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name, kind, data in members:
            info = tarfile.TarInfo(name)
            if kind == "file":
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))  # type: ignore[arg-type]
                continue
            info.type = {"dir": tarfile.DIRTYPE, "symlink": tarfile.SYMTYPE, "hardlink": tarfile.LNKTYPE,
                         "fifo": tarfile.FIFOTYPE}[kind]
            if kind in ("symlink", "hardlink"):
                info.linkname = str(data)
            tar.addfile(info)
    return buffer.getvalue()


# ---- frame codec ------------------------------------------------------------------------------

frames_strategy = st.lists(
    st.tuples(
        st.dictionaries(st.text(min_size=1, max_size=8), st.integers() | st.text(max_size=40), max_size=4),
        st.sampled_from([0, 1, 100, guest_wire.DIRECT_READ_AT - 1, guest_wire.DIRECT_READ_AT, 300_000]),
    ),
    max_size=12,
)


@pytest.mark.unit
@settings(max_examples=40, deadline=None)
@given(frames=frames_strategy, reuse=st.booleans(), pieces=st.lists(st.integers(1, 200_000), min_size=1, max_size=8))
def test_frames_survive_any_split_of_the_stream(frames: list[tuple[dict, int]], reuse: bool, pieces: list[int]) -> None:
    sent = [(header, os.urandom(size)) for header, size in frames]
    stream = b"".join(guest_wire.encode_head(h, len(p)) + p for h, p in sent)
    reader = guest_wire.FrameReader(1 << 20, reuse=reuse)
    read_end, write_end = os.pipe()
    os.set_blocking(read_end, False)
    received: list[tuple[dict, bytes]] = []
    try:
        position, turn = 0, 0
        while True:
            if position < len(stream):
                # At most ~400 writes per example: 1-byte pieces over megabytes only cost time.
                piece = max(pieces[turn % len(pieces)], len(stream) // 400)
                size = min(piece, 60_000, len(stream) - position)
                os.write(write_end, stream[position:position + size])
                position, turn = position + size, turn + 1
            try:
                while True:
                    received += [(h, bytes(p)) for h, p in reader.read(read_end)]
            except BlockingIOError:
                if position >= len(stream):
                    break
    finally:
        os.close(read_end)
        os.close(write_end)
    assert received == sent


@pytest.mark.unit
def test_a_frame_larger_than_the_bound_is_a_wire_error() -> None:
    read_end, write_end = os.pipe()
    try:
        os.write(write_end, guest_wire.encode_head({"id": 1}, 10_000_000))
        with pytest.raises(guest_wire.WireError, match="too large"):
            guest_wire.FrameReader(1 << 20).read(read_end)
        os.write(write_end, guest_wire.PREFIX.pack(3, 0) + b"{]x")
        with pytest.raises(guest_wire.WireError, match="bad frame header"):
            guest_wire.FrameReader(1 << 20).read(read_end)
    finally:
        os.close(read_end)
        os.close(write_end)


@pytest.mark.unit
def test_writer_keeps_what_a_full_pipe_would_not_take() -> None:
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    writer = guest_wire.FrameWriter(write_end)
    payload = os.urandom(3 * 1024 * 1024)
    writer.send({"id": 7}, payload)
    assert writer.flush() is False and writer.pending > 0
    reader, got = guest_wire.FrameReader(8 << 20), []
    while not got:
        got = reader.read(read_end)
        writer.flush()
    assert got[0][0] == {"id": 7} and bytes(got[0][1]) == payload and writer.pending == 0
    os.close(read_end)
    os.close(write_end)


# ---- paths and tar rules ----------------------------------------------------------------------


@pytest.mark.unit
@pytest.mark.parametrize("path", ["a.txt", "dir/sub/x", "./a", "a/../b", "dir/"])
def test_relative_paths_inside_the_workspace_are_accepted(path: str) -> None:
    assert not guest_wire.workspace_relative(path).startswith(("/", ".."))


@pytest.mark.unit
@pytest.mark.parametrize("path", ["/etc/passwd", "..", "../x", "a/../../x", "", ".", "a\0b"])
def test_absolute_escaping_or_empty_paths_are_refused(path: str) -> None:
    with pytest.raises(ValueError):
        guest_wire.workspace_relative(path)


@pytest.mark.unit
def test_a_planted_symlink_cannot_carry_a_write_out_of_the_workspace(tmp_path: Path) -> None:
    workspace, outside = tmp_path / "ws", tmp_path / "outside"
    workspace.mkdir()
    outside.mkdir()
    (workspace / "link").symlink_to(outside)
    space = guest_files.Workspace(str(workspace))
    with pytest.raises(guest_files.RequestError) as refused:
        space.new_entry("link/x.txt")
    assert refused.value.kind == "workspace_path"
    with pytest.raises(guest_files.RequestError):
        space.existing("link")
    (workspace / "inner").mkdir()
    (workspace / "ok").symlink_to("inner")
    assert space.new_entry("ok/x.txt") == str(workspace / "inner" / "x.txt")


@pytest.mark.unit
@pytest.mark.parametrize(
    ("members", "why"),
    [
        ([("/etc/evil", "file", b"x")], "absolute"),
        ([("../evil", "file", b"x")], "'..'"),
        ([("a/../../evil", "file", b"x")], "'..'"),
        ([("link", "symlink", "/etc")], "absolute"),
        ([("link", "symlink", "../../etc")], "outside"),
        ([("d/link", "symlink", "../../x")], "outside"),
        ([("hard", "hardlink", "../x")], "outside"),
        ([("fifo", "fifo", b"")], "not a file"),
    ],
)
def test_unsafe_tar_members_refuse_the_whole_archive(tmp_path: Path, members: list, why: str) -> None:
    archive = tarfile.open(fileobj=io.BytesIO(make_tar(("fine.txt", "file", b"ok"), *members)))
    with pytest.raises(guest_files.RequestError) as refused:
        guest_files.tar_members_check(archive, guest_files.Workspace(str(tmp_path)), ".")
    assert refused.value.kind == "unsafe_archive" and why in str(refused.value)


@pytest.mark.unit
def test_safe_tar_members_are_kept_with_sane_modes(tmp_path: Path) -> None:
    archive = tarfile.open(fileobj=io.BytesIO(make_tar(
        ("d", "dir", b""), ("d/f", "file", b"1"), ("d/up", "symlink", "../d/f"), ("h", "hardlink", "d/f"))))
    members = guest_files.tar_members_check(archive, guest_files.Workspace(str(tmp_path)), ".")
    assert [m.name for m in members] == ["d", "d/f", "d/up", "h"]
    assert all(m.mode & 0o600 == 0o600 and not m.mode & 0o7000 for m in members)


# ---- round trips with a real guest ------------------------------------------------------------


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def sandbox(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator:
    backend = ProcessBackend(root_dir=tmp_path_factory.mktemp("process-sandboxes"))
    box = await backend.create("guest-tests", LIMITS)
    yield box
    await box.destroy()



@integration
async def test_exec_reports_exit_code_output_and_duration(sandbox) -> None:
    done = await sandbox.exec(["/bin/sh", "-c", "echo out; echo err >&2; exit 3"])
    assert (done.result, done.exit_code, done.signal, done.stdout, done.stderr) == ("exit", 3, None, b"out\n", b"err\n")
    assert 0 < done.duration_s < 5 and not done.truncated


@integration
async def test_exec_passes_stdin_env_and_cwd(sandbox) -> None:
    await sandbox.put_file("sub/marker", b"")
    done = await sandbox.exec(shell='cat; echo "$GREETING"; ls', stdin=b"in ", env={"GREETING": "hi"}, cwd="sub")
    assert done.stdout == b"in hi\nmarker\n"


@integration
async def test_exec_environment_is_clean(sandbox, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROLLMESH_API_KEY", "secret")
    done = await sandbox.exec(["env"])
    assert sorted(line.split("=")[0] for line in done.stdout.decode().splitlines()) == ["HOME", "LANG", "PATH"]


@integration
async def test_a_missing_program_exits_127_like_a_shell(sandbox) -> None:
    done = await sandbox.exec(["no-such-program-xyz"])
    assert (done.result, done.exit_code) == ("exit", 127)
    assert b"no-such-program-xyz" in done.stderr


@integration
async def test_a_signal_ends_the_command_with_result_signal(sandbox) -> None:
    done = await sandbox.exec(["/bin/sh", "-c", "kill -TERM $$"])
    assert (done.result, done.exit_code, done.signal) == ("signal", None, signal.SIGTERM)


async def wait_no_process_with(marker: str, deadline_s: float = 5.0) -> bool:
    """Poll the host's /proc until no command line holds ``marker``."""
    give_up = time.monotonic() + deadline_s
    while time.monotonic() < give_up:
        if not any(marker in _cmdline(pid) for pid in os.listdir("/proc") if pid.isdigit()):
            return True
        await asyncio.sleep(0.02)
    return False


def _cmdline(pid: str) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return ""


@integration
async def test_timeout_kills_the_whole_process_group(sandbox) -> None:
    marker = f"30.{random.randrange(10**6):06d}"
    done = await sandbox.exec(["/bin/sh", "-c", f"sleep {marker} & sleep {marker}"], timeout_s=0.3)
    assert (done.result, done.signal, done.exit_code) == ("timeout", signal.SIGKILL, None)
    assert await wait_no_process_with(marker)


@integration
async def test_background_children_end_with_the_command(sandbox) -> None:
    marker = f"30.{random.randrange(10**6):06d}"
    done = await sandbox.exec(["/bin/sh", "-c", f"sleep {marker} >/dev/null 2>&1 </dev/null & echo started"])
    assert (done.result, done.exit_code, done.stdout) == ("exit", 0, b"started\n")
    assert await wait_no_process_with(marker)


@integration
async def test_output_past_the_cap_is_truncated_and_stopped(sandbox) -> None:
    done = await sandbox.exec(["/usr/bin/yes", "x"])
    assert (done.result, done.truncated) == ("output_truncated", True)
    assert len(done.stdout) + len(done.stderr) == LIMITS.max_output_bytes
    assert done.stdout == b"x\n" * (LIMITS.max_output_bytes // 2)


@integration
async def test_output_streams_while_the_command_runs(sandbox) -> None:
    chunks: list[tuple[str, bytes]] = []
    released: list[asyncio.Task] = []

    async def collect(stream: str, data: bytes) -> None:
        chunks.append((stream, data))
        if data == b"one\n":  # only streamed output can let the command go on
            released.append(asyncio.create_task(sandbox.put_file("go", b"")))

    script = "echo one; while [ ! -e go ]; do sleep 0.01; done; echo two >&2"
    done = await sandbox.exec(["/bin/sh", "-c", script], on_output=collect, timeout_s=20)
    assert done.result == "exit" and chunks == [("stdout", b"one\n"), ("stderr", b"two\n")]
    assert (done.stdout, done.stderr) == (b"one\n", b"two\n")
    await asyncio.gather(*released)
    await sandbox.exec(["rm", "go"])


@integration
async def test_concurrent_execs_run_side_by_side(sandbox) -> None:
    # Each command waits until all eight have started: run one after another, they would time out.
    script = "touch started.$0; while [ $(ls started.* | wc -l) -lt 8 ]; do sleep 0.01; done; echo $0"
    results = await asyncio.gather(*(sandbox.exec(["/bin/sh", "-c", script, str(i)], timeout_s=20)
                                     for i in range(8)))
    assert [(r.result, r.stdout) for r in results] == [("exit", f"{i}\n".encode()) for i in range(8)]
    await sandbox.exec(["/bin/sh", "-c", "rm started.*"])


@integration
async def test_cancelling_an_exec_kills_its_command(sandbox) -> None:
    task = asyncio.create_task(sandbox.exec(["/bin/sh", "-c", "echo $$ > pid; exec sleep 30"]))
    while not (await sandbox.exec(["/bin/sh", "-c", "test -s pid"])).exit_code == 0:
        await asyncio.sleep(0.02)
    pid = int((await sandbox.get_file("pid"))[0])
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    for _ in range(200):
        if not Path(f"/proc/{pid}").exists():
            break
        await asyncio.sleep(0.01)
    assert not Path(f"/proc/{pid}").exists()


@integration
async def test_put_and_get_file_round_trip_with_checksums(sandbox) -> None:
    data = os.urandom(300_000)
    stored = await sandbox.put_file("deep/dir/blob.bin", data, mode=0o600)
    assert (stored.path, stored.size, stored.sha256) == ("deep/dir/blob.bin", len(data), hashlib.sha256(data).hexdigest())
    read, transfer = await sandbox.get_file("deep/dir/blob.bin")
    assert read == data and transfer == stored
    listing = await sandbox.exec(["/bin/sh", "-c", "stat -c %a deep/dir/blob.bin; ls -a deep/dir"])
    assert listing.stdout == b"600\n.\n..\nblob.bin\n"  # no temp file left beside it


@integration
@pytest.mark.parametrize("size", [1000, 2 * guest_wire.CHUNK + 7])
async def test_bytes_that_do_not_match_the_senders_digest_never_land(sandbox, size: int) -> None:
    data = os.urandom(size)
    with pytest.raises(ChecksumMismatchError):
        await sandbox.put_file("checked.bin", data, expected_sha256=hashlib.sha256(b"other").hexdigest())
    listing = await sandbox.exec(["/bin/sh", "-c", "ls -a"])
    assert b"checked" not in listing.stdout  # neither the file nor its temp file
    stored = await sandbox.put_file("checked.bin", data, expected_sha256=hashlib.sha256(data).hexdigest())
    assert stored.sha256 == hashlib.sha256(data).hexdigest()
    await sandbox.exec(["rm", "checked.bin"])


@integration
async def test_a_large_file_streams_in_chunks(sandbox) -> None:
    data = os.urandom(3 * guest_wire.CHUNK + 12345)
    stored = await sandbox.put_file("big.bin", data)
    assert stored.sha256 == hashlib.sha256(data).hexdigest()
    read, transfer = await sandbox.get_file("big.bin")
    assert read == data and transfer.sha256 == stored.sha256
    await sandbox.exec(["rm", "big.bin"])


@integration
@pytest.mark.parametrize("path", ["/etc/passwd", "../outside", "a/../../x"])
async def test_transfers_refuse_paths_outside_the_workspace(sandbox, path: str) -> None:
    with pytest.raises(WorkspacePathError):
        await sandbox.put_file(path, b"x")
    with pytest.raises(WorkspacePathError):
        await sandbox.get_file(path)


@integration
async def test_reading_a_missing_file_is_a_transfer_error(sandbox) -> None:
    with pytest.raises(TransferError):
        await sandbox.get_file("no/such/file")
    assert (await sandbox.exec(["true"])).exit_code == 0  # the sandbox goes on


@integration
async def test_put_tar_and_get_tar_round_trip(sandbox) -> None:
    tar_bytes = make_tar(("proj", "dir", b""), ("proj/a.py", "file", b"print(1)\n"), ("proj/link", "symlink", "a.py"))
    stored = await sandbox.put_tar("unpacked", tar_bytes)
    assert stored.sha256 == hashlib.sha256(tar_bytes).hexdigest()
    assert (await sandbox.exec(["cat", "unpacked/proj/link"])).stdout == b"print(1)\n"
    data, transfer = await sandbox.get_tar("unpacked")
    assert transfer.sha256 == hashlib.sha256(data).hexdigest()
    names = tarfile.open(fileobj=io.BytesIO(data)).getnames()
    assert {"./proj/a.py", "./proj/link"} <= set(names)


@integration
async def test_an_unsafe_tar_writes_nothing(sandbox) -> None:
    evil = make_tar(("good.txt", "file", b"x"), ("../../escaped.txt", "file", b"x"))
    with pytest.raises(UnsafeArchiveError) as refused:
        await sandbox.put_tar("t", evil)
    assert refused.value.member == "../../escaped.txt"
    assert (await sandbox.exec(["/bin/sh", "-c", "ls t 2>/dev/null | wc -l"])).stdout.strip() == b"0"


@integration
async def test_a_dead_guest_fails_pending_and_later_calls(tmp_path: Path) -> None:
    box = await ProcessBackend(root_dir=tmp_path).create("doomed", LIMITS)
    pending = asyncio.create_task(box.exec(["/bin/sh", "-c", "touch started; exec sleep 30"]))
    give_up = time.monotonic() + WAIT_S
    while (await box.exec(["test", "-e", "started"])).exit_code != 0:  # then the exec is in flight
        assert time.monotonic() < give_up, "the pending exec's command never started"
        await asyncio.sleep(0.02)
    os.kill(box._process.pid, signal.SIGKILL)  # the guest itself
    done = await asyncio.wait_for(pending, 10)
    assert done.result == "sandbox_died" and "exit" in done.detail
    assert not box.alive()
    with pytest.raises(SandboxDiedError):
        await box.exec(["true"])
    with pytest.raises(SandboxDiedError):
        await box.put_file("x", b"1")
    await box.destroy()
    await box.destroy()  # idempotent
    assert list(tmp_path.iterdir()) == []


@integration
async def test_destroying_a_reaped_sandbox_signals_no_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Once the guest has been reaped its pid, and so its process group id, may be handed to any
    # new process (another sandbox's): destroy must not send SIGKILL there.
    box = await ProcessBackend(root_dir=tmp_path).create("reaped", LIMITS)
    pid = box._process.pid
    os.kill(pid, signal.SIGKILL)
    give_up = time.monotonic() + 10
    while box._process.poll() is None and time.monotonic() < give_up:  # reaped once it has died
        await asyncio.sleep(0.01)
    assert box._process.returncode is not None
    signalled: list[int] = []
    real_killpg = os.killpg
    monkeypatch.setattr(os, "killpg", lambda pgid, sig: (signalled.append(pgid), real_killpg(pgid, sig)))
    await box.destroy()
    assert pid not in signalled


@pytest.mark.unit
def test_the_guest_starts_without_the_modules_only_file_transfers_need() -> None:
    """A sandbox starts for every rollout, and most never move a file: tarfile (with bz2, lzma and
    shutil) and hashlib are imported at the first transfer, not at the guest's start."""
    import subprocess
    import sys
    from pathlib import Path

    import rollmesh.sandbox

    sandbox_dir = Path(rollmesh.sandbox.__file__).parent
    probe = ("import sys; sys.path.insert(0, sys.argv[1]); import guest; "
             "print(sorted(m for m in ('tarfile', 'hashlib', 'bz2', 'lzma', 'shutil') if m in sys.modules))")
    loaded = subprocess.run([sys.executable, "-I", "-S", "-c", probe, str(sandbox_dir)],
                            capture_output=True, text=True, check=True).stdout.strip()
    assert loaded == "[]"
