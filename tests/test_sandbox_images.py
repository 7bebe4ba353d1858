"""Sandbox images: OCI layouts and docker-save tarballs unpacked once (layers in order,
whiteouts, unsafe members refused), profile config, and real bubblewrap sandboxes that show an
image's root, a profile's Python environment, and an egress allowlist enforced outside."""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
from support.oci_images import host_binary_members, layer, write_docker_save, write_layout
from support.sandbox_helpers import usable_bwrap

from rollmesh.config import SandboxConfig, SandboxProfileConfig
from rollmesh.sandbox_config import SandboxPythonConfig
from rollmesh.messages.sandbox import SandboxExecRequest, SandboxLeaseRequest, SandboxReleaseRequest
from rollmesh.sandbox import SandboxBroker
from rollmesh.sandbox.errors import ImageBuildError, ImageLayoutError, UnsafeImageError
from rollmesh.sandbox.backends import select_backend, select_configured_backend
from rollmesh.sandbox.bwrap_mounts import shown_in_image
from rollmesh.sandbox.images import SandboxImage, prepare_images
from rollmesh.sandbox.oci_layout import unpack_image
from rollmesh.sandbox.sandbox_protocol import SandboxLimits

LIMITS = SandboxLimits(memory_mb=256, pids=64, workspace_mb=32, exec_timeout_s=30.0, cpu_s=30,
                       file_size_mb=64, max_output_bytes=64 * 1024)
needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed")


@pytest.fixture
def cache_dir() -> Iterator[Path]:
    # World-reachable, unlike pytest's tmp_path (0700): bwrap mounts as the sandbox's own uid.
    path = Path(tempfile.mkdtemp(prefix="rollmesh-images-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


# -- unpacking (plain logic) -------------------------------------------------------------------

LOWER = [("a", "dir", ""), ("a/gone", "file", "lower"), ("a/kept", "file", "lower"),
         ("d", "dir", ""), ("d/old", "file", "lower"), ("etc/motd", "file", "v1")]
UPPER = [("a/.wh.gone", "file", ""), ("d/new", "file", "upper"), ("d/.wh..wh..opq", "file", ""),
         ("etc/motd", "file", "v2"), ("link", "symlink", "/etc/motd"), ("hard", "hardlink", "a/kept")]


@pytest.mark.unit
@pytest.mark.parametrize("writer", [write_layout, write_docker_save], ids=["oci-layout", "docker-save"])
def test_layers_apply_in_order_with_whiteouts(tmp_path: Path, cache_dir: Path, writer) -> None:
    image = writer(tmp_path / "image", [layer(LOWER, compress=True), layer(UPPER)])
    root = unpack_image(image, cache_dir)
    assert sorted(p.name for p in (root / "a").iterdir()) == ["kept"]  # .wh.gone removed the lower file
    assert sorted(p.name for p in (root / "d").iterdir()) == ["new"]  # opaque: lower entries gone, this layer's kept
    assert (root / "etc/motd").read_text() == "v2"
    assert os.readlink(root / "link") == "/etc/motd"  # kept as written: it resolves inside the sandbox
    assert (root / "hard").stat().st_ino == (root / "a/kept").stat().st_ino
    (root / "marker").write_text("unpacked once")
    assert unpack_image(image, cache_dir) == root and (root / "marker").exists()  # the cache, by digest


@pytest.mark.unit
@pytest.mark.parametrize(("layers", "member"), [
    ([[("../escape", "file", "x")]], "../escape"),
    ([[("/etc/cron.d/x", "file", "x")]], "/etc/cron.d/x"),
    ([[("evil", "symlink", "/tmp")], [("evil/planted", "file", "x")]], "evil/planted"),
    ([[("up", "symlink", "../../..")], [("up/planted", "file", "x")]], "up/planted"),
    ([[("h", "hardlink", "../../etc/passwd")]], "h"),
], ids=["dotdot", "absolute", "absolute-symlink", "relative-symlink", "hardlink-out"])
def test_unsafe_members_are_refused_and_nothing_is_cached(tmp_path: Path, cache_dir: Path, layers, member) -> None:
    image = write_layout(tmp_path / "image", [layer(members) for members in layers])
    with pytest.raises(UnsafeImageError) as caught:
        unpack_image(image, cache_dir)
    assert caught.value.member == member and caught.value.image == str(image)
    assert list((cache_dir / "roots").iterdir()) == []
    assert not Path("/tmp/planted").exists()


@pytest.mark.unit
def test_a_layer_whose_bytes_do_not_match_its_digest_is_refused(tmp_path: Path, cache_dir: Path) -> None:
    image = write_layout(tmp_path / "image", [layer([("f", "file", "good")])])
    blob = max((image / "blobs/sha256").iterdir(), key=lambda p: p.stat().st_size)  # the layer
    blob.write_bytes(layer([("f", "file", "evil")]))
    with pytest.raises(ImageLayoutError, match="do not match its digest"):
        unpack_image(image, cache_dir)


@pytest.mark.unit
def test_host_paths_are_shown_in_an_image_only_where_bwrap_can_mount_them(tmp_path: Path) -> None:
    (tmp_path / "opt" / "data").mkdir(parents=True)
    (tmp_path / "usr").mkdir()
    wanted = ["/opt/data", "/opt/tools", "/usr/local/lib/rollmesh/tools", "/work/rollmesh/tools"]
    # /opt/tools and /usr/local/...: below the image's own read-only /opt and /usr, not there.
    assert shown_in_image(tmp_path, wanted) == ["/opt/data", "/work/rollmesh/tools"]


@pytest.mark.unit
@pytest.mark.parametrize(("profile", "error"), [
    ({"root": "docker:/x"}, "is not \"host\""),
    ({"network_allow": ["example.org"]}, "is not host:port"),
    ({"network_allow": ["example.org:70000"]}, "is not host:port"),
    ({"python": {}}, "needs packages or a requirements file"),
    ({"python": {"packages": ["--index-url=http://evil"]}}, "pip option"),
])
def test_bad_image_keys_are_config_errors(profile: dict, error: str) -> None:
    with pytest.raises(msgspec.ValidationError, match=error):
        msgspec.convert({"profiles": {"p": profile}}, SandboxConfig)


@pytest.mark.unit
def test_a_profile_whose_image_cannot_be_made_stops_the_broker_start_naming_it(tmp_path: Path) -> None:
    config = SandboxConfig(profiles={"chem": SandboxProfileConfig(root=f"oci:{tmp_path / 'nothing'}")})
    with pytest.raises(ImageBuildError, match="'chem'.*the path does not exist") as caught:
        select_configured_backend(config, run_dir=tmp_path)  # what the broker actor runs at start
    assert caught.value.profile == "chem"


@pytest.mark.unit
def test_a_backend_that_cannot_show_images_refuses_them_instead_of_ignoring_them() -> None:
    with pytest.raises(ImageBuildError, match="'lab'.*need the bwrap backend"):
        select_backend("process", images={"lab": SandboxImage("lab", network_allow=("10.0.0.5:5025",))})


# -- real sandboxes ----------------------------------------------------------------------------

def broker_with(config: SandboxConfig, cache_dir: Path, tmp_path: Path) -> SandboxBroker:
    backend = usable_bwrap(images=prepare_images(config, cache_dir=cache_dir))
    return SandboxBroker(config, backend, snapshot_dir=tmp_path / "snapshots")


async def run_in(broker: SandboxBroker, profile: str, argv: list[str]):
    lease = await broker.lease(SandboxLeaseRequest(holder=f"test-{profile}", profile=profile))
    assert lease.error_kind == "", lease.error
    try:
        return await broker.exec(SandboxExecRequest(lease_id=lease.lease_id, argv=argv))
    finally:
        await broker.release(SandboxReleaseRequest(lease_id=lease.lease_id))


@pytest.mark.integration
@pytest.mark.timeout(120)
@needs_bwrap
async def test_an_oci_image_written_here_is_leased_and_used(tmp_path: Path, cache_dir: Path) -> None:
    # A root with no Python and no shell: cat and its libraries, and a file only the image has.
    # The guest still runs (the host's Python at /.rollmesh/python), and tools see the image.
    files = [*host_binary_members("/usr/bin/cat"), ("bin", "symlink", "usr/bin"),
             ("etc/only-in-image", "file", "hello from the image\n")]
    image = write_layout(tmp_path / "image", [layer(files, compress=True)])
    profiles = {"tiny": SandboxProfileConfig(root=f"oci:{image}", warm_min=0, warm_max=0, **_small())}
    broker = broker_with(SandboxConfig(profiles=profiles), cache_dir, tmp_path)
    try:
        done = await run_in(broker, "tiny", ["cat", "/etc/only-in-image"])
        assert (done.result, done.exit_code, done.stdout) == ("exit", 0, b"hello from the image\n")
        missing = await run_in(broker, "tiny", ["cat", "/etc/os-release"])  # the host's: not shown
        assert missing.exit_code == 1 and b"No such file" in missing.stderr
    finally:
        await broker.close()


def _small() -> dict:
    return {"memory_mb": LIMITS.memory_mb, "pids": LIMITS.pids, "workspace_mb": LIMITS.workspace_mb}


WHEELHOUSE = Path(sys.prefix) / "wheelhouse"  # `make wheelhouse` (a prerequisite of `make test`)


@pytest.mark.integration
@pytest.mark.timeout(300)
@needs_bwrap
@pytest.mark.skipif(not list(WHEELHOUSE.glob("numpy-*.whl")), reason=f"no wheels in {WHEELHOUSE}: run `make wheelhouse`")
async def test_a_profile_environment_holds_numpy_and_ase_and_hides_the_hosts_packages(
        tmp_path: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The host's pip fetches from the local wheelhouse only: nothing is downloaded here. ase
    # without its declared scipy and matplotlib (`import ase` needs numpy alone).
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(WHEELHOUSE))
    python = {"packages": ["numpy==2.4.6", "ase==3.29.0"], "no_deps": True}
    profiles = {"chem": msgspec.convert({"python": python, "warm_min": 0, "warm_max": 0, **_small()},
                                        SandboxProfileConfig)}
    broker = broker_with(SandboxConfig(profiles=profiles), cache_dir, tmp_path)
    script = ("import sys, numpy, ase; from ase import Atoms; "
              "print(Atoms('H2O').get_chemical_formula(), numpy.__file__, sys.prefix); "
              "print(any('dist-packages' in p or 'site-packages' in p and '/.rollmesh/venv' not in p "
              "for p in sys.path))")
    try:
        done = await run_in(broker, "chem", ["python3", "-c", script])
        assert (done.result, done.exit_code) == ("exit", 0), done.stderr
        formula, numpy_file, prefix, host_paths = done.stdout.decode().split()
        assert formula == "H2O" and numpy_file.startswith("/.rollmesh/venv/") and prefix == "/.rollmesh/venv"
        assert host_paths == "False"
        # A package of the host's Python (Debian's python3-yaml) is not importable by the
        # profile's python3, though the same interpreter imports it outside the environment.
        seen = await run_in(broker, "default", ["/usr/bin/python3", "-c", "import yaml"])
        if seen.exit_code != 0:
            pytest.skip("the host's Python has no yaml package to hide")
        hidden = await run_in(broker, "chem", ["python3", "-c", "import yaml"])
        assert hidden.exit_code == 1 and b"ModuleNotFoundError" in hidden.stderr
    finally:
        await broker.close()


@pytest.mark.integration
@pytest.mark.timeout(120)
@needs_bwrap
def test_an_environment_whose_packages_cannot_be_fetched_fails_naming_the_profile_and_leaves_nothing(
        tmp_path: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))  # holds no wheels
    python = SandboxPythonConfig(packages=["numpy==2.4.6"])
    config = SandboxConfig(profiles={"chem": SandboxProfileConfig(python=python)})
    with pytest.raises(ImageBuildError, match="'chem'.*fetching its packages") as caught:
        prepare_images(config, cache_dir=cache_dir)
    assert caught.value.profile == "chem" and "numpy" in caught.value.reason
    assert list((cache_dir / "envs").iterdir()) == []  # no half-built environment under any name


EGRESS_CLIENT = """
import socket, sys
def ask(target):
    s = socket.socket(socket.AF_UNIX)
    s.connect("/.rollmesh/egress.sock")
    s.sendall(b"CONNECT " + target.encode() + b" HTTP/1.1\\r\\n\\r\\n")
    head = s.recv(64).split(b"\\r\\n")[0].decode()
    if " 200 " in head:
        s.sendall(b"ping")
        head += " " + s.recv(64).decode()
    return head
print(ask(sys.argv[1])); print(ask(sys.argv[2]))
try:
    socket.create_connection(("127.0.0.1", int(sys.argv[1].rsplit(":", 1)[1])), timeout=5)
    print("direct: connected")
except OSError as exc:
    print("direct: refused", type(exc).__name__)
"""


@pytest.mark.integration
@pytest.mark.timeout(120)
@needs_bwrap
async def test_network_allow_reaches_an_allowed_target_and_refuses_others(tmp_path: Path, cache_dir: Path) -> None:
    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"pong:" + await reader.read(4))
        await writer.drain()
        writer.close()

    allowed = await asyncio.start_server(echo, "127.0.0.1", 0)
    other = await asyncio.start_server(echo, "127.0.0.1", 0)
    allowed_at, other_at = (f"127.0.0.1:{server.sockets[0].getsockname()[1]}" for server in (allowed, other))
    profiles = {"lab": SandboxProfileConfig(network_allow=[allowed_at], warm_min=0, warm_max=0, **_small())}
    broker = broker_with(SandboxConfig(profiles=profiles), cache_dir, tmp_path)
    try:
        done = await run_in(broker, "lab", ["/usr/bin/python3", "-I", "-c", EGRESS_CLIENT, allowed_at, other_at])
        assert done.exit_code == 0, done.stderr
        assert done.stdout.decode().splitlines() == [
            "HTTP/1.1 200 Connection established pong:ping",  # through the forwarder, outside
            "HTTP/1.1 403 Forbidden",  # not on the list: refused outside the sandbox
            "direct: refused ConnectionRefusedError",  # the sandbox's own namespace reaches nothing
        ]
    finally:
        await broker.close()
        for server in (allowed, other):
            server.close()
