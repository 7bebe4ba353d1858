"""``rollmesh sandbox run|lease|put|get|release``: use the sandbox broker from a shell.

Knows the sandbox client, the wire contract and the bus (a running mesh's broker over NATS); not
Ray. ``run`` without ``--lease`` takes its own lease and releases it; when no mesh is running it
starts a broker in this process instead (the same broker code, with no bus). ``run`` streams the
command's output, then prints one JSON line with the typed result and exits like the command:

    exit N -> N; timeout -> 124; signal N -> 128+N; oom -> 137; output_truncated -> 128+N of the
    signal that stopped it (137 when unknown); sandbox_died or infra_error -> 125.

A request the broker refuses (no such lease, capacity) is an infra_error: the JSON line says so
and the exit code is 125.

``run`` is traced as ``rollmesh.cli`` (``cli_tracer``, as ``submit``): one ``sandbox run`` span
holds its lease, exec and release requests, so the exec joins the command's trace instead of
starting one of its own. Spans are exported only where the OTEL_* variables say.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import io
import json
import sys
import tarfile
import tempfile
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from opentelemetry import trace

from rollmesh.cli.cli_tracing import cli_tracer
from rollmesh.cli.errors import EXIT_OK, CliError
from rollmesh.cli.target import add_target_options, bus_errors_as_cli_errors, find_mesh, load_cli_config, positive_float
from rollmesh.config import RollmeshConfig
from rollmesh.messages import SandboxExecReply, SandboxOutputProduced
from rollmesh.telemetry import conventions
from rollmesh.telemetry.tracing import flush_tracing

EXIT_TIMEOUT = 124
EXIT_SANDBOX_FAILED = 125
EXIT_KILLED = 137  # 128 + SIGKILL
# Chunks leave room below the server's max payload for the message around the data.
CHUNK_HEADROOM_BYTES = 256 * 1024


def register(subparsers: Any, common: argparse.ArgumentParser) -> None:
    sandbox = subparsers.add_parser(
        "sandbox", parents=[common], help="run commands and move files in a leased sandbox",
        description="Talk to the sandbox broker of a running mesh (found like `rollmesh submit` "
                    "finds it); `run` alone falls back to a broker in this process.")
    commands = sandbox.add_subparsers(dest="sandbox_command", metavar="SANDBOX_COMMAND", required=True)

    run = commands.add_parser("run", parents=[common], help="run a command in a sandbox",
                              description="Run CMD (no shell unless --shell), stream its output, "
                                          "print the typed result as one JSON line, exit like CMD.")
    _lease_options(run)
    run.add_argument("--lease", metavar="ID", help="run in this lease (default: take one, release after)")
    run.add_argument("--timeout", type=positive_float, metavar="S",
                     help="wall-clock limit of the command (default: the profile's, 10 min)")
    run.add_argument("--shell", action="store_true", help="run CMD as one `sh -c` string")
    run.add_argument("--cwd", default="", metavar="DIR", help="working directory inside the workspace")
    run.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD...", help="the command and its arguments")
    add_target_options(run)
    run.set_defaults(handler=run_sandbox_run)

    lease = commands.add_parser("lease", parents=[common], help="take a lease and print its id",
                                description="Take a sandbox lease that lives --ttl seconds past its "
                                            "last use; print its id.")
    _lease_options(lease)
    add_target_options(lease)
    lease.set_defaults(handler=run_sandbox_lease)

    put = commands.add_parser("put", parents=[common], help="copy a file or directory into a lease",
                              description="Copy LOCAL (a file, or a directory as a tar) to REMOTE in "
                                          "the lease's workspace, verified by sha256.")
    put.add_argument("--lease", required=True, metavar="ID")
    put.add_argument("local", type=Path, metavar="LOCAL")
    put.add_argument("remote", metavar="REMOTE")
    add_target_options(put)
    put.set_defaults(handler=run_sandbox_put)

    get = commands.add_parser("get", parents=[common], help="copy a file or directory out of a lease",
                              description="Copy REMOTE from the lease's workspace to LOCAL, verified "
                                          "by sha256; with --dir, REMOTE is a directory.")
    get.add_argument("--lease", required=True, metavar="ID")
    get.add_argument("--dir", action="store_true", help="REMOTE is a directory: extract it into LOCAL")
    get.add_argument("remote", metavar="REMOTE")
    get.add_argument("local", type=Path, metavar="LOCAL")
    add_target_options(get)
    get.set_defaults(handler=run_sandbox_get)

    release = commands.add_parser("release", parents=[common], help="end a lease",
                                  description="Release the lease; its sandbox is destroyed.")
    release.add_argument("lease_id", metavar="ID")
    add_target_options(release)
    release.set_defaults(handler=run_sandbox_release)


def _lease_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--profile", default="default", metavar="P",
                        help="sandbox profile from the config (default: %(default)s)")
    parser.add_argument("--ttl", type=positive_float, metavar="S",
                        help="lease TTL: it is reaped S seconds after its last use (default: the broker's)")


# -- the typed result --------------------------------------------------------------------------

def exit_status(reply: SandboxExecReply) -> int:
    """The exit code ``rollmesh sandbox run`` ends with for an exec's result."""
    if reply.result == "exit" and reply.exit_code is not None:
        return reply.exit_code
    if reply.result == "timeout":
        return EXIT_TIMEOUT
    if reply.result == "oom":
        return EXIT_KILLED
    if reply.result in ("signal", "output_truncated"):
        return 128 + reply.signal if reply.signal else EXIT_KILLED
    return EXIT_SANDBOX_FAILED


def result_line(reply: SandboxExecReply) -> str:
    """The one JSON line ``run`` prints last."""
    return json.dumps({"result": reply.result or "infra_error", "exit_code": reply.exit_code,
                       "signal": reply.signal, "truncated": reply.truncated,
                       "duration_s": round(reply.duration_s, 6)})


# -- handlers ----------------------------------------------------------------------------------

def run_sandbox_run(args: argparse.Namespace) -> int:
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        raise CliError("no command given: rollmesh sandbox run [options] -- CMD...", exit_code=2)
    config = load_cli_config(args)
    tracer = cli_tracer(config.telemetry)
    try:
        reply = asyncio.run(_traced_run(args, config, cmd, tracer))
    finally:
        flush_tracing()  # the batch processor would drop what is still queued at exit
    if reply.truncated:  # after the streamed output, where a reader notices what is missing
        sys.stderr.write("\n[rollmesh: output truncated at the profile's cap]\n")
        sys.stderr.flush()
    out = sys.stdout
    out.write(result_line(reply) + "\n")
    out.flush()
    return exit_status(reply)


def run_sandbox_lease(args: argparse.Namespace) -> int:
    async def lease(client: Any) -> str:
        reply = await client.lease(f"cli-{uuid.uuid4().hex[:12]}", profile=args.profile, ttl_s=args.ttl)
        return reply.lease_id

    print(asyncio.run(_with_mesh_client(args, lease)))
    return EXIT_OK


def run_sandbox_put(args: argparse.Namespace) -> int:
    local: Path = args.local
    if not local.exists():
        raise CliError(f"{local}: no such file or directory")

    async def put(client: Any) -> Any:
        if local.is_dir():
            return await client.upload(args.lease, args.remote, tar_directory(local), kind="tar")
        return await client.upload(args.lease, args.remote, local.read_bytes(), mode=local.stat().st_mode & 0o777)

    stored = asyncio.run(_with_mesh_client(args, put))
    print(json.dumps({"path": args.remote, "size": stored.size, "sha256": stored.sha256}))
    return EXIT_OK


def run_sandbox_get(args: argparse.Namespace) -> int:
    async def get(client: Any) -> bytes:
        return await client.download(args.lease, args.remote, kind="tar" if args.dir else "file")

    data = asyncio.run(_with_mesh_client(args, get))
    local: Path = args.local
    if args.dir:
        local.mkdir(parents=True, exist_ok=True)
        with tarfile.open(fileobj=io.BytesIO(data)) as archive:
            archive.extractall(local, filter="data")  # refuses members that leave LOCAL
    else:
        target = local / Path(args.remote).name if local.is_dir() else local
        target.write_bytes(data)
    print(json.dumps({"path": str(local), "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}))
    return EXIT_OK


def run_sandbox_release(args: argparse.Namespace) -> int:
    async def release(client: Any) -> None:
        await client.release(args.lease_id)

    asyncio.run(_with_mesh_client(args, release))
    return EXIT_OK


def tar_directory(directory: Path) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as archive:
        for path in sorted(directory.rglob("*")):
            archive.add(path, arcname=str(path.relative_to(directory)), recursive=False)
    return buffer.getvalue()


# -- the broker: a mesh's over NATS, or one in this process -----------------------------------

@dataclass
class _Printer:
    """Writes a streamed exec's chunks as they come; keeps how much of each stream it wrote."""

    exec_id: str
    written: dict[str, int]

    def write(self, chunk: SandboxOutputProduced) -> None:
        if chunk.exec_id != self.exec_id or chunk.offset != self.written[chunk.stream]:
            return  # another exec's, or after a lost chunk: the reply fills in the rest
        stream = sys.stdout if chunk.stream == "stdout" else sys.stderr
        stream.buffer.write(chunk.data)
        stream.flush()
        self.written[chunk.stream] += len(chunk.data)

    def finish(self, reply: SandboxExecReply) -> None:
        """Write what streaming missed, and end stdout with a newline before the JSON line."""
        for name, data in (("stdout", reply.stdout), ("stderr", reply.stderr)):
            stream = sys.stdout if name == "stdout" else sys.stderr
            stream.buffer.write(data[self.written[name]:])
            stream.flush()
        if reply.stdout and not reply.stdout.endswith(b"\n"):
            sys.stdout.buffer.write(b"\n")


async def _traced_run(args: argparse.Namespace, config: RollmeshConfig, cmd: list[str],
                      tracer: trace.Tracer) -> SandboxExecReply:
    """``_run`` inside the command's ``sandbox run`` span, which ends with the exec's result."""
    exec_id = uuid.uuid4().hex
    with tracer.start_as_current_span(conventions.SPAN_SANDBOX_RUN, attributes={
            conventions.RL_SANDBOX_EXEC_ID: exec_id}) as span:
        reply = await _run(args, config, cmd, exec_id)
        span.set_attribute(conventions.RL_SANDBOX_RESULT, reply.result or "infra_error")
        if reply.exit_code is not None:
            span.set_attribute(conventions.RL_SANDBOX_EXIT_CODE, reply.exit_code)
        if reply.result in ("", "sandbox_died", "infra_error"):
            span.set_status(trace.StatusCode.ERROR, reply.detail or reply.result or "infra_error")
    return reply


async def _run(args: argparse.Namespace, config: RollmeshConfig, cmd: list[str],
               exec_id: str) -> SandboxExecReply:
    from rollmesh.sandbox.errors import SandboxRequestError

    printer = _Printer(exec_id, {"stdout": 0, "stderr": 0})
    try:
        mesh = find_mesh(args, config, role="mesh")
    except CliError:
        if args.lease:
            raise
        mesh = None
    try:
        async with (_mesh_client(mesh, config, printer) if mesh else _in_process_client(config, printer)) as client:
            lease_id = args.lease
            if not lease_id:
                lease_id = (await client.lease(f"cli-{printer.exec_id[:12]}", profile=args.profile,
                                               ttl_s=args.ttl)).lease_id
            trace.get_current_span().set_attribute(conventions.RL_SANDBOX_LEASE_ID, lease_id)
            try:
                reply = await client.exec(
                    lease_id, [] if args.shell else cmd, shell=" ".join(cmd) if args.shell else "",
                    timeout_s=args.timeout, cwd=args.cwd, exec_id=printer.exec_id, stream_output=True)
            finally:
                if not args.lease:
                    await _quietly(client.release(lease_id))
    except SandboxRequestError as exc:
        print(f"rollmesh: error: {exc}", file=sys.stderr)
        return SandboxExecReply(result="infra_error", detail=str(exc))
    printer.finish(reply)
    if reply.result in ("sandbox_died", "infra_error") and reply.detail:
        print(f"rollmesh: {reply.result}: {reply.detail}", file=sys.stderr)
    return reply


async def _quietly(release: Any) -> None:
    try:
        await release
    except Exception as exc:  # noqa: BLE001 - the broker reaps it; the command's result stands
        print(f"rollmesh: warning: could not release the lease: {exc}", file=sys.stderr)


async def _with_mesh_client(args: argparse.Namespace, action: Callable[[Any], Any]) -> Any:
    from rollmesh.sandbox.errors import SandboxRequestError

    config = load_cli_config(args)
    mesh = find_mesh(args, config, role="mesh")
    try:
        async with _mesh_client(mesh, config, None) as client:
            return await action(client)
    except SandboxRequestError as exc:
        raise CliError(str(exc)) from exc


@asynccontextmanager
async def _mesh_client(mesh: Any, config: RollmeshConfig, printer: _Printer | None) -> AsyncIterator[Any]:
    from rollmesh.bus.publisher import BusPublisher
    from rollmesh.bus.tls import client_tls_context
    from rollmesh.bus.watcher import BusWatcher
    from rollmesh.messages.subjects import SANDBOX_OUTPUT
    from rollmesh.sandbox.broker_client import DEFAULT_CHUNK_BYTES, SandboxBrokerClient

    with bus_errors_as_cli_errors(mesh):
        nc = await mesh.connect("rollmesh-sandbox", role="mesh")
    watcher = BusWatcher(nc, mesh.namespace, name="rollmesh-sandbox")
    try:
        if printer is not None:
            await watcher.watch(SANDBOX_OUTPUT, printer.write)
        chunk = max(1024, min(DEFAULT_CHUNK_BYTES, nc.max_payload - CHUNK_HEADROOM_BYTES))
        yield SandboxBrokerClient.from_config(BusPublisher(nc, nc.jetstream(), mesh.namespace), config.sandbox,
                                              chunk_bytes=chunk, bulk_tls=client_tls_context(mesh.nats_tls))
        await watcher.close()  # drained: the last output chunks are written before the reply
    finally:
        await watcher.close(drain_timeout_s=0)
        await nc.close()


@asynccontextmanager
async def _in_process_client(config: RollmeshConfig, printer: _Printer) -> AsyncIterator[Any]:
    from rollmesh.sandbox import SandboxBroker, SandboxBrokerClient
    from rollmesh.sandbox.backends import select_configured_backend
    from rollmesh.sandbox.in_process import InProcessRequester, OutputCallbackPublisher

    print("rollmesh: no running mesh found; using a sandbox broker in this process", file=sys.stderr)
    sandbox_config = config.sandbox
    with tempfile.TemporaryDirectory(prefix="rollmesh-sandbox-") as scratch:
        # Images go to sandbox.image_cache_dir when set, else to this scratch directory.
        Path(scratch).chmod(0o755)  # sandboxes mount images from it as their own uids
        backend = select_configured_backend(sandbox_config, run_dir=Path(scratch))
        broker = SandboxBroker(sandbox_config, backend, snapshot_dir=Path(scratch) / "snapshots",
                               publisher=OutputCallbackPublisher(printer.write))
        try:
            yield SandboxBrokerClient(InProcessRequester(broker))
        finally:
            await broker.close()
