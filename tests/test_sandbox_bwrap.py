"""Real bubblewrap sandboxes: what the minimal root shows, who runs it, how it is limited, and
that destroying one leaves nothing behind (processes, cgroups)."""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import signal
import socket
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import pytest_asyncio

from support.sandbox_helpers import usable_bwrap
from rollmesh.sandbox import select_backend
from rollmesh.sandbox.bwrap_backend import BwrapBackend
from rollmesh.sandbox.sandbox_protocol import SandboxLimits
from rollmesh.sandbox.tool_paths import TOOLS_DIR

LIMITS = SandboxLimits(memory_mb=128, pids=64, workspace_mb=32, exec_timeout_s=10.0, cpu_s=10,
                       file_size_mb=64, max_output_bytes=64 * 1024)

pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(60),
    pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed"),
]


@pytest.fixture(scope="module")
def backend() -> BwrapBackend:
    return usable_bwrap()


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def sandbox(backend: BwrapBackend) -> AsyncIterator:
    box = await backend.create("bwrap-tests", LIMITS)
    yield box
    await box.destroy()


async def test_info_says_isolated_and_how_each_limit_is_enforced(sandbox) -> None:
    info = sandbox.info
    assert (info.backend, info.isolated, info.limits) == ("bwrap", True, LIMITS)
    assert {"memory", "pids", "workspace", "cpu", "file_size", "uid", "network"} <= set(info.enforcement)
    if os.geteuid() == 0:
        assert info.enforcement["uid"].startswith("dedicated host uid")


async def test_the_root_is_minimal(sandbox) -> None:
    root = set((await sandbox.exec(["ls", "-A", "/"])).stdout.decode().split())
    top = Path(TOOLS_DIR).parts[1]  # the tool scripts are shown at their host path
    assert root <= {".rollmesh", "bin", "dev", "etc", "lib", "lib32", "lib64", "libx32", "proc", "sbin", "tmp",
                    "usr", "workspace", top}
    etc = set((await sandbox.exec(["ls", "-A", "/etc"])).stdout.decode().split())
    assert {"passwd", "group", "hosts", "ld.so.cache"} <= etc
    assert not {"shadow", "gshadow", "ssh", "sudoers", "hostname", "machine-id"} & etc
    assert (await sandbox.exec(["whoami"])).stdout == b"sandbox\n"
    assert (await sandbox.exec(["pwd"])).stdout == b"/workspace\n"


async def test_the_environment_is_clean(sandbox, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROLLMESH_API_KEY", "secret")
    done = await sandbox.exec(["env"])
    assert sorted(line.split("=")[0] for line in done.stdout.decode().splitlines()) == ["HOME", "LANG", "PATH"]


async def test_workspace_tmp_and_shm_are_size_limited(sandbox) -> None:
    done = await sandbox.exec(["df", "-k", "--output=target,size", "/workspace", "/tmp", "/dev/shm"])
    sizes = dict(line.split() for line in done.stdout.decode().splitlines()[1:])
    assert int(sizes["/workspace"]) == int(sizes["/tmp"]) == LIMITS.workspace_mb * 1024
    assert int(sizes["/dev/shm"]) <= LIMITS.workspace_mb * 1024


async def test_per_exec_rlimits_apply(sandbox) -> None:
    done = await sandbox.exec(["/bin/sh", "-c", "ulimit -t; ulimit -f"])
    cpu, file_blocks = done.stdout.decode().split()
    assert int(cpu) == LIMITS.cpu_s and int(file_blocks) * 512 == LIMITS.file_size_mb * 1024 * 1024  # dash: 512 B
    big = await sandbox.exec(["/bin/sh", "-c", "head -c 70M /dev/zero > /tmp/x; echo $?"])
    assert big.stdout != b"0\n"  # past RLIMIT_FSIZE (or the /tmp quota): refused
    # The soft CPU limit is inherited even by what the command forks at once; the hard one
    # follows a moment later.
    child = await sandbox.exec(["/bin/sh", "-c", "(ulimit -t) & wait; sleep 0.1; ulimit -H -t"])
    assert child.stdout.split() == [str(LIMITS.cpu_s).encode(), str(LIMITS.cpu_s + 1).encode()]


async def test_burning_past_the_cpu_limit_kills_the_command(backend: BwrapBackend) -> None:
    box = await backend.create("cpu", SandboxLimits(cpu_s=1, exec_timeout_s=20.0, memory_mb=128, pids=32))
    try:
        done = await box.exec(["/bin/sh", "-c", "while :; do :; done"])
        # SIGXCPU, not the 20 s timeout: the CPU limit ended it, after about 1 CPU-second. The
        # reported CPU time is the kernel's rusage, which can read a little under the limit that
        # fired (0.8999 s was seen under load): the bound only tells "about 1 s" from "none".
        assert (done.result, done.signal) == ("signal", signal.SIGXCPU), done
        assert 0.5 < done.cpu_s < 3
    finally:
        await box.destroy()


@pytest.fixture
def dataset() -> Iterator[Path]:
    """A world-readable host directory (the sandbox's uid must be able to read what it is shown;
    pytest's tmp_path is private to its user)."""
    data = Path(tempfile.mkdtemp(prefix="rollmesh-test-dataset-", dir="/var/tmp"))
    data.chmod(0o755)
    (data / "table.txt").write_text("42\n")
    yield data
    shutil.rmtree(data)


async def test_configured_readonly_paths_are_visible_and_read_only(dataset: Path) -> None:
    data = dataset
    script = f"cat {data}/table.txt; touch {data}/new 2>/dev/null && echo writable || echo read-only"
    box = await BwrapBackend(readonly_paths=[str(data)]).create("ro-paths", LIMITS)
    hidden_box = await BwrapBackend().create("no-ro-paths", LIMITS)
    try:
        assert (await box.exec(["/bin/sh", "-c", script])).stdout == b"42\nread-only\n"
        hidden = await hidden_box.exec(["cat", f"{data}/table.txt"])
        assert hidden.exit_code != 0  # without the setting, not there at all
    finally:
        await box.destroy()
        await hidden_box.destroy()


@pytest.mark.skipif(os.geteuid() != 0, reason="dedicated uids need the broker to run as root")
async def test_each_sandbox_runs_as_its_own_uid(backend: BwrapBackend, sandbox) -> None:
    other = await backend.create("uid-check", LIMITS)
    try:
        uids = [int((await box.exec(["id", "-u"])).stdout) for box in (sandbox, other)]
    finally:
        await other.destroy()
    assert uids[0] != uids[1] and 0 not in uids and os.getuid() not in uids


async def test_network_true_shares_the_host_network(backend: BwrapBackend) -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        box = await backend.create("with-network", LIMITS, network=True)
        try:
            script = f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=2).close(); print('ok')"
            done = await box.exec(["/usr/bin/python3", "-I", "-S", "-c", script])
        finally:
            await box.destroy()
    assert done.stdout == b"ok\n", done
    assert box.info.enforcement["network"] == "host network"


@pytest.mark.parametrize("use_cgroups", [True, False], ids=["cgroups", "no-cgroups"])
async def test_destroy_leaves_no_process_and_no_cgroup(use_cgroups: bool) -> None:
    backend = BwrapBackend(use_cgroups=use_cgroups)
    box = await backend.create(f"destroy-me-{random.getrandbits(32):x}", LIMITS)
    marker = f"30.{random.randrange(10**6):06d}"
    # setsid: escapes the exec's process group, so only the sandbox's own teardown can end it.
    await box.exec(["/bin/sh", "-c", f"setsid sleep {marker} >/dev/null 2>&1 < /dev/null & sleep 0.3"])
    assert await wait_processes_with(marker, present=True)
    cgroup_dirs = _cgroup_dirs_of(box)
    await box.destroy()
    assert not box.alive()
    assert await wait_processes_with(marker, present=False)
    assert not any(d.exists() for d in cgroup_dirs)
    if use_cgroups and backend.cgroups is not None:
        assert box.info.enforcement["memory"].startswith("cgroup")
    else:
        assert box.info.enforcement["memory"].startswith("rlimit")


def _cgroup_dirs_of(box) -> list[Path]:
    name = box.info.sandbox_id
    found = []
    for hierarchy in Path("/sys/fs/cgroup").iterdir():
        found += [p for p in hierarchy.rglob(f"{name}-*") if p.is_dir()] if hierarchy.is_dir() else []
    return found


async def wait_processes_with(marker: str, *, present: bool, deadline_s: float = 5.0) -> bool:
    give_up = time.monotonic() + deadline_s
    while time.monotonic() < give_up:
        if bool([pid for pid in os.listdir("/proc") if pid.isdigit() and marker in _cmdline(pid)]) == present:
            return True
        await asyncio.sleep(0.02)
    return False


def _cmdline(pid: str) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return ""


def test_auto_selects_bubblewrap_when_it_works(backend: BwrapBackend) -> None:
    chosen = select_backend("auto")
    assert (chosen.name, chosen.isolated) == ("bwrap", True)
