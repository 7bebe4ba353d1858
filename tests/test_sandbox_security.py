"""Attacks from inside a real bubblewrap sandbox: each is contained with the right typed result,
the attacking sandbox stays usable, and a bystander sandbox beside it keeps working untouched.
The bulk data path's stream is attacked from inside a sandbox and, with forged or borrowed
tokens, from the host: nothing lands in any workspace."""

from __future__ import annotations

import asyncio
import hashlib
import io
import os
import random
import shutil
import socket
import subprocess
import tarfile
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import msgspec
import pytest
import pytest_asyncio

from support.oci_images import host_binary_members
from support.sandbox_helpers import usable_bwrap
from rollmesh.config import SandboxConfig, SandboxProfileConfig
from rollmesh.messages.sandbox import SandboxUploadRequest
from rollmesh.sandbox import SandboxBroker, SandboxBrokerClient
from rollmesh.sandbox.bulk_stream import upload_over_stream
from rollmesh.sandbox.bwrap_backend import BwrapBackend
from rollmesh.sandbox.errors import UnsafeArchiveError, WorkspacePathError
from rollmesh.sandbox.images import SandboxImage
from rollmesh.sandbox.in_process import InProcessRequester
from rollmesh.sandbox.sandbox_protocol import SandboxLimits

REPO = Path(__file__).resolve().parent.parent
LIMITS = SandboxLimits(memory_mb=64, pids=32, workspace_mb=16, exec_timeout_s=10.0, cpu_s=10,
                       file_size_mb=64, max_output_bytes=64 * 1024)
PY = ["/usr/bin/python3", "-I", "-S", "-c"]

pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(60),
    pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed"),
]


@pytest.fixture(scope="module", params=["cgroups", "rlimits"])
def backend(request: pytest.FixtureRequest) -> BwrapBackend:
    """Each attack runs against both ways of enforcing limits: per-sandbox cgroups (where the
    host allows them) and the rlimit fallback."""
    backend = usable_bwrap(use_cgroups=request.param == "cgroups")
    if request.param == "cgroups" and backend.cgroups is None:
        pytest.skip(f"no usable cgroups here: {backend.cgroup_reason}")
    return backend


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def attacker(backend: BwrapBackend) -> AsyncIterator:
    box = await backend.create("attacker", LIMITS)
    yield box
    await box.destroy()


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def bystander(backend: BwrapBackend) -> AsyncIterator:
    box = await backend.create("bystander", LIMITS)
    await box.put_file("canary.txt", b"still here")
    yield box
    await box.destroy()


@pytest_asyncio.fixture(autouse=True, loop_scope="session")
async def bystander_unharmed(bystander) -> AsyncIterator[None]:
    yield
    done = await bystander.exec(["cat", "canary.txt"], timeout_s=5)
    assert (done.result, done.stdout) == ("exit", b"still here"), "the bystander sandbox was harmed"


@pytest.fixture
def secrets(tmp_path: Path) -> Iterator[list[Path]]:
    """A secret in a host temp dir and one under the repository."""
    paths = [tmp_path / "secret.txt", REPO / f".rollmesh-test-secret-{uuid.uuid4().hex[:8]}"]
    for path in paths:
        path.write_text("TOP-SECRET")
    yield paths
    paths[1].unlink()


async def test_host_files_outside_the_workspace_are_invisible(attacker, secrets: list[Path]) -> None:
    for secret in secrets:
        done = await attacker.exec(["cat", str(secret)])
        assert done.result == "exit" and done.exit_code != 0 and b"TOP-SECRET" not in done.stdout
        assert b"No such file" in done.stderr
    root = (await attacker.exec(["ls", "-A", "/"])).stdout.split()
    assert not {b"root", b"home", b"var", b"opt", b"srv"} & set(root)
    grep = await attacker.exec(["/bin/sh", "-c", "grep -rls TOP-SECRET / --exclude-dir=usr --exclude-dir=proc; true"])
    assert grep.result == "exit" and grep.stdout == b"", grep


async def test_writing_the_root_filesystem_fails_read_only(attacker) -> None:
    probe = f"rollmesh-probe-{random.getrandbits(32):x}"
    for target in (f"/{probe}", f"/usr/{probe}", f"/etc/{probe}", "/.rollmesh/guest.py", f"/dev/{probe}"):
        done = await attacker.exec(["/bin/sh", "-c", f"echo x > {target}"])
        assert done.result == "exit" and done.exit_code != 0, target
        assert b"Read-only file system" in done.stderr, (target, done.stderr)
    assert not Path(f"/usr/{probe}").exists() and not Path(f"/etc/{probe}").exists()
    assert (await attacker.exec(["/bin/sh", "-c", "echo kept > mine.txt && cat mine.txt"])).stdout == b"kept\n"


@pytest.fixture
def listening_port() -> Iterator[int]:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        yield server.getsockname()[1]


async def test_network_connections_fail(attacker, listening_port: int) -> None:
    script = (
        "import socket\n"
        f"for addr in (('127.0.0.1', {listening_port}), ('1.1.1.1', 53)):\n"
        "    try:\n"
        "        socket.create_connection(addr, timeout=2).close(); print('connected')\n"
        "    except OSError as exc:\n"
        "        print('blocked', type(exc).__name__)\n"
    )
    done = await attacker.exec([*PY, script])
    assert done.stdout.decode().splitlines() == ["blocked ConnectionRefusedError", "blocked OSError"], done


async def test_a_fork_bomb_hits_the_process_limit_and_the_host_is_fine(attacker) -> None:
    done = await attacker.exec(["/bin/sh", "-c", "bomb() { bomb | bomb & }; bomb; sleep 5"], timeout_s=1)
    assert done.result in ("timeout", "exit", "signal")
    assert b"Cannot fork" in done.stderr  # it ran into the limit, not just out of time
    assert subprocess.run(["true"], check=False).returncode == 0  # the host can still fork
    for _ in range(100):  # the killed bomb's processes are on their way out
        after = await attacker.exec(["/bin/sh", "-c", "echo alive"], timeout_s=5)
        if after.result == "exit":
            break
        await asyncio.sleep(0.05)
    assert (after.result, after.stdout) == ("exit", b"alive\n")


async def test_allocating_past_the_memory_limit_is_stopped(attacker) -> None:
    done = await attacker.exec([*PY, "x = b'x' * (256 << 20); print('allocated')"])
    if attacker.info.enforcement["memory"].startswith("cgroup"):
        assert (done.result, done.signal) == ("oom", 9), done
    else:  # RLIMIT_AS: the allocation fails inside the command
        assert (done.result, done.exit_code) == ("exit", 1) and b"MemoryError" in done.stderr
    assert b"allocated" not in done.stdout
    assert (await attacker.exec(["true"])).result == "exit"  # the guest survived


async def test_filling_the_disk_stops_at_the_workspace_quota(attacker) -> None:
    done = await attacker.exec(["/bin/sh", "-c", "head -c 64M /dev/zero > fill.bin"])
    assert done.result == "exit" and done.exit_code != 0 and b"No space left on device" in done.stderr
    size = (await attacker.exec(["stat", "-c", "%s", "fill.bin"])).stdout
    assert int(size) <= LIMITS.workspace_mb * 1024 * 1024
    assert (await attacker.exec(["rm", "fill.bin"])).exit_code == 0


async def test_sleeping_forever_times_out(attacker) -> None:
    done = await attacker.exec(["sleep", "infinity"], timeout_s=0.5)
    assert (done.result, done.signal, done.exit_code) == ("timeout", 9, None)


def tar_of(*members: tarfile.TarInfo, data: bytes = b"pwned") -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for member in members:
            if member.isreg():
                member.size = len(data)
                tar.addfile(member, io.BytesIO(data))
            else:
                tar.addfile(member)
    return buffer.getvalue()


def symlink(name: str, target: str) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = tarfile.SYMTYPE, target
    return info


async def test_escaping_through_tar_paths_or_links_is_refused(attacker, tmp_path: Path) -> None:
    escape = tmp_path / "escaped.txt"
    attempts = [
        tar_of(tarfile.TarInfo(f"../../../../..{escape}")),
        tar_of(tarfile.TarInfo(str(escape))),
        tar_of(symlink("out", str(tmp_path)), tarfile.TarInfo("out/escaped.txt")),
        tar_of(symlink("up", "../../../.."), tarfile.TarInfo("up/tmp/escaped.txt")),
    ]
    for archive in attempts:
        with pytest.raises(UnsafeArchiveError):
            await attacker.put_tar("incoming", archive)
    # A link planted by code in the sandbox does not carry an upload out either.
    await attacker.exec(["ln", "-sfn", "/", "planted"])
    with pytest.raises(UnsafeArchiveError):
        await attacker.put_tar(".", tar_of(tarfile.TarInfo("planted/tmp/escaped.txt")))
    with pytest.raises(WorkspacePathError):
        await attacker.put_file("planted/tmp/escaped.txt", b"pwned")
    assert not escape.exists()
    assert (await attacker.exec(["/bin/sh", "-c", "ls incoming 2>/dev/null | wc -l"])).stdout.strip() == b"0"


async def test_host_processes_cannot_be_signalled_or_traced(attacker) -> None:
    me = os.getpid()
    killed = await attacker.exec(["/bin/sh", "-c", f"kill -9 {me}"])
    assert killed.exit_code != 0 and b"No such process" in killed.stderr
    trace = (
        "import ctypes, os\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        f"print(libc.ptrace(16, {me}, 0, 0), os.strerror(ctypes.get_errno()))\n"  # PTRACE_ATTACH
    )
    traced = await attacker.exec([*PY, trace])
    code, _, why = traced.stdout.decode().strip().partition(" ")
    assert code == "-1" and why in ("No such process", "Operation not permitted"), traced
    assert os.getpid() == me  # still alive


async def test_the_guest_is_out_of_reach_of_the_code_it_runs(attacker) -> None:
    """Same uid, but the guest is the sandbox's init and not dumpable: signals from inside do not
    kill it, and its pipes and memory are not reachable; no other process inside holds them."""
    killed = await attacker.exec(["/bin/sh", "-c", "kill -9 1; kill -9 -1; echo survived"])
    assert killed.stdout == b"survived\n" or killed.result == "signal"
    assert (await attacker.exec(["true"])).result == "exit"
    probe = (
        "import os\n"
        "for pid in os.listdir('/proc'):\n"
        "    if pid.isdigit() and int(pid) != os.getpid():\n"
        "        try:\n"
        "            cmd = open(f'/proc/{pid}/cmdline', 'rb').read()\n"
        "        except OSError:\n"
        "            continue\n"
        "        print('process', cmd.split(b'\\0')[0].decode())\n"
        "        for what in ('fd/0', 'fd/1', 'mem'):\n"
        "            try:\n"
        "                open(f'/proc/{pid}/{what}', 'rb').close(); print('open', what)\n"
        "            except OSError as exc:\n"
        "                print('refused', what, type(exc).__name__)\n"
    )
    done = await attacker.exec([*PY, probe])
    lines = done.stdout.decode().splitlines()
    assert lines[0] == "process /usr/bin/python3" and len(lines) == 4, done  # the guest, alone
    assert all(line.startswith("refused") for line in lines[1:]), done


async def test_another_sandboxs_workspace_is_not_visible(attacker, bystander) -> None:
    await bystander.put_file("private.txt", b"bystander-secret")
    done = await attacker.exec(["/bin/sh", "-c", "cat /workspace/private.txt; cat /proc/*/root/workspace/private.txt; "
                                                  "grep -rs bystander-secret /tmp /workspace; true"])
    assert b"bystander-secret" not in done.stdout


async def test_an_image_roots_links_to_host_paths_resolve_inside_the_sandbox(backend: BwrapBackend) -> None:
    # A dir: root (cat and its libraries) whose links name host paths: a top-level `host -> /`,
    # `leak -> <a host secret>`, `etc/leak -> <the same>`. bwrap shows links as links, so they
    # resolve in the sandbox's own root; binding them would have resolved them on the host.
    secret = REPO / f".rollmesh-test-secret-{uuid.uuid4().hex[:8]}"
    secret.write_text("TOP-SECRET")
    root = Path(tempfile.mkdtemp(prefix="rollmesh-dir-root-"))
    try:
        root.chmod(0o755)
        for name, _, data in host_binary_members("/usr/bin/cat"):
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            (root / name).write_bytes(data)  # type: ignore[arg-type]
            (root / name).chmod(0o755)
        (root / "etc").mkdir()
        (root / "host").symlink_to("/")
        (root / "leak").symlink_to(secret)
        (root / "etc" / "leak").symlink_to(secret)
        images = {"image": SandboxImage("image", root_dir=root)}
        box = await usable_bwrap(use_cgroups=backend.cgroups is not None, images=images).create(
            "dir-root", LIMITS, profile="image")
        try:
            done = await box.exec(["/usr/bin/cat", "/leak", "/etc/leak", f"/host{secret}", "/host/etc/shadow"])
            assert done.exit_code == 1 and b"TOP-SECRET" not in done.stdout, done
            assert done.stderr.count(b"No such file or directory") == 4, done.stderr
        finally:
            await box.destroy()
    finally:
        secret.unlink()
        shutil.rmtree(root)


# -- the bulk data path: a stream straight to the broker, opened only with its one-time token ----


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def bulk_broker(backend: BwrapBackend, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator:
    """A broker serving the bulk stream over real bubblewrap sandboxes: the attacker's lease and
    a victim's, with a canary in the victim's workspace."""
    config = SandboxConfig(backend="bwrap", profiles={"default": SandboxProfileConfig(warm_min=0)})
    broker = SandboxBroker(config, backend, snapshot_dir=tmp_path_factory.mktemp("bulk-snapshots"))
    server = await broker.serve_bulk()
    client = SandboxBrokerClient(InProcessRequester(broker))
    attacker_lease = (await client.lease("bulk-attacker")).lease_id
    victim_lease = (await client.lease("bulk-victim")).lease_id
    await client.upload(victim_lease, "canary.txt", b"victim's own")
    yield broker, client, attacker_lease, victim_lease
    await server.close()
    await broker.close()


async def bulk_ticket(broker: SandboxBroker, lease_id: str, path: str, size: int):
    reply = await broker.upload(SandboxUploadRequest(lease_id=lease_id, path=path, data=b"", size=size,
                                                     sha256="", bulk=True))
    assert reply.bulk is not None, reply
    return reply.bulk


async def victim_untouched(client: SandboxBrokerClient, victim_lease: str) -> None:
    listing = await client.exec(victim_lease, ["ls", "-A"])
    assert listing.stdout.split() == [b"canary.txt"], listing
    assert await client.download(victim_lease, "canary.txt") == b"victim's own"


async def test_a_bulk_stream_without_a_valid_token_stores_nothing(bulk_broker) -> None:
    broker, client, attacker_lease, victim_lease = bulk_broker
    payload = b"pwned" * 40_000
    ticket = await bulk_ticket(broker, attacker_lease, "mine.bin", len(payload))
    # From inside the sandbox the stream is out of reach: no network, and the socket is not shown.
    probe = (
        "import os, socket\n"
        f"print(os.path.exists({ticket.unix_path!r}))\n"
        "try:\n"
        f"    socket.create_connection(({ticket.host!r}, {ticket.port}), timeout=2).close(); print('connected')\n"
        "except OSError as exc:\n"
        "    print('blocked', type(exc).__name__)\n"
    )
    inside = await client.exec(attacker_lease, [*PY, probe])
    assert inside.stdout.decode().splitlines() == ["False", "blocked ConnectionRefusedError"], inside
    # From the host, a forged token (and none at all) is refused, whichever lease it names.
    sha = hashlib.sha256(payload).hexdigest()
    for token, lease in (("f" * 43, victim_lease), (ticket.token[:-1] + "x", victim_lease), (" ", attacker_lease)):
        forged = msgspec.structs.replace(ticket, token=token)
        done = await upload_over_stream(forged, "unix", lease_id=lease, path="canary.txt", data=payload,
                                        sha256=sha, tls=None)
        assert done.error_kind == "bad_token", done
    await victim_untouched(client, victim_lease)
    assert (await client.exec(attacker_lease, ["ls", "-A"])).stdout == b""


async def test_a_bulk_token_of_another_lease_is_refused_and_spent(bulk_broker) -> None:
    broker, client, attacker_lease, victim_lease = bulk_broker
    payload = b"overwrite" * 30_000
    sha = hashlib.sha256(payload).hexdigest()
    # The attacker's own token, shown with the victim's lease, for a file named like its canary.
    ticket = await bulk_ticket(broker, attacker_lease, "canary.txt", len(payload))
    done = await upload_over_stream(ticket, "tcp", lease_id=victim_lease, path="canary.txt", data=payload,
                                    sha256=sha, tls=None)
    assert done.error_kind == "bad_token" and "another lease" in done.error, done
    again = await upload_over_stream(ticket, "unix", lease_id=attacker_lease, path="canary.txt", data=payload,
                                     sha256=sha, tls=None)
    assert again.error_kind == "bad_token", again  # shown to the wrong place, it is spent
    await victim_untouched(client, victim_lease)
