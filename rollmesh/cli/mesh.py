"""``rollmesh up`` and ``rollmesh down``: a mesh as a background process, and stopping it.

Knows processes, signals and ``mesh.json``; the launcher (and so Ray) is imported only by the
foreground process that runs the mesh. ``up`` picks the run directory, spawns ``rollmesh up
--foreground --run-dir DIR`` in a new session with its output in ``DIR/mesh.log``, and returns when
``mesh.json`` appears (the launcher writes it last, atomically). ``down`` sends SIGTERM to the pid
in ``mesh.json``, waits, and kills the process group if it will not go: the mesh drains (in-flight
rollouts hand their requests back to the work queue, their state saved at their last turn; the
trainer's unfinished groups stay unacknowledged). ``up --resume RUN_DIR`` starts that run again
with its saved config (``config.json``) and the NATS store in its run directory, so everything
carries on from where it stopped.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from rollmesh.cli.errors import EXIT_OK, EXIT_USAGE, CliError
from rollmesh.cli.foreground import run_until_signalled
from rollmesh.cli.target import (
    add_target_options,
    check_model_dir,
    load_cli_config,
    model_dir_arg,
    namespace_arg,
    positive_float,
    read_cli_mesh_address,
)
from rollmesh.config import RUN_CONFIG_FILE, ConfigError, load_run_config
from rollmesh.mesh_address import MESH_FILE, MeshAddress, MeshNotFoundError, new_run_dir, read_mesh_address

LOG_FILE = "mesh.log"
LOG_TAIL_LINES = 30


def register(subparsers: Any, common: argparse.ArgumentParser) -> None:
    up = subparsers.add_parser(
        "up", parents=[common], help="start a mesh in the background",
        description="Start NATS (embedded unless --nats-url), Ray (local unless --ray-address), "
                    "every actor and the Serve app, in a background process; return when ready.")
    up.add_argument("--nats-url", metavar="URL", help="use this NATS server (config nats.url)")
    up.add_argument("--ray-address", metavar="ADDR", help="join this Ray cluster (config ray.address)")
    up.add_argument("--namespace", type=namespace_arg, metavar="NS", help="subject namespace (config namespace)")
    up.add_argument("--model", type=model_dir_arg, metavar="DIR",
                    help="the Hugging Face model directory to serve and train (config model.path; "
                         "default: the demo's model, built in the run directory)")
    up.add_argument("--no-serve", action="store_true", help="do not deploy the Serve inference app")
    up.add_argument("--metrics-port", type=port_arg, metavar="PORT",
                    help="serve Prometheus metrics of the whole mesh on this port; 0: any free one "
                         "(config telemetry.metrics_port, default 9464)")
    up.add_argument("--run-dir", type=Path, metavar="DIR",
                    help="run directory (default: a new one under --run-root)")
    up.add_argument("--resume", type=Path, metavar="RUN_DIR",
                    help="start again a run stopped by `rollmesh down`, with its own config: "
                         "queued and in-flight rollouts resume from their last saved turn, "
                         "the trainer from its last durable step")
    up.add_argument("--timeout", type=positive_float, default=600.0, metavar="S",
                    help="seconds to wait for the mesh to be ready (default: %(default)s)")
    up.add_argument("--foreground", action="store_true",
                    help="run the mesh in this process until SIGINT/SIGTERM")
    up.set_defaults(handler=run_up)

    down = subparsers.add_parser(
        "down", parents=[common], help="stop a mesh started by `rollmesh up`",
        description="SIGTERM the mesh process named in mesh.json, wait for it to stop, "
                    "SIGKILL its process group after --timeout.")
    add_target_options(down, nats=False)
    down.add_argument("--timeout", type=positive_float, default=90.0, metavar="S",
                      help="seconds to wait before SIGKILL (default: %(default)s)")
    down.set_defaults(handler=run_down)


# -- up ----------------------------------------------------------------------------------------

def _up_overrides(args: argparse.Namespace) -> dict[str, Any]:
    return {"nats.url": args.nats_url, "ray.address": args.ray_address, "namespace": args.namespace,
            "model.path": args.model, "serve.enabled": False if args.no_serve else None, "telemetry.metrics_port": args.metrics_port}


def run_up(args: argparse.Namespace) -> int:
    if args.resume is not None:
        config, run_dir = _resumed_config(args), args.resume
    else:
        check_model_dir(args.model)
        config = load_cli_config(args, _up_overrides(args))  # a bad config fails here, not in the child
        run_dir = Path(args.run_dir) if args.run_dir else new_run_dir(config.run_root)
    if args.foreground:
        return asyncio.run(_run_foreground(config, run_dir))
    run_dir.mkdir(parents=True, exist_ok=True)
    _refuse_live_mesh(run_dir)
    log_path = run_dir / LOG_FILE
    with log_path.open("ab") as log:
        # A new session: the mesh outlives this command and the terminal's Ctrl-C.
        child = subprocess.Popen(child_command(args, run_dir), stdin=subprocess.DEVNULL, stdout=log,
                                 stderr=subprocess.STDOUT, start_new_session=True)
    try:
        info = _wait_with_status(child, run_dir, args.timeout)
    except BaseException:
        stop_mesh_process(child.pid, grace_s=30.0)
        child.wait()
        raise
    print(f"mesh up (pid {info.pid})")
    print(f"  run dir    {info.run_dir}")
    print(f"  NATS       {info.nats_url}")
    print(f"  namespace  {info.namespace}")
    print(f"  Serve      {info.serve_url or 'disabled'}")
    print(f"  metrics    {info.metrics_url or 'disabled'}")
    print(f"  log        {log_path}")
    latest = args.run_dir is None and args.run_root is None  # `down` finds it unaided
    print("stop it with: rollmesh down" + ("" if latest else f" --run-dir {run_dir}"))
    return EXIT_OK


def _resumed_config(args: argparse.Namespace) -> Any:
    """The config the resumed run was started with (only addresses and Serve may change)."""
    if args.config or args.run_dir or args.namespace or args.model:
        raise CliError("--resume runs the run's own config: it takes no --config, --run-dir, "
                       "--namespace or --model", exit_code=EXIT_USAGE)
    if not (args.resume / RUN_CONFIG_FILE).is_file():
        raise CliError(f"{args.resume} holds no run to resume (no {RUN_CONFIG_FILE})", exit_code=EXIT_USAGE)
    try:
        return load_run_config(args.resume, overrides={
            key: value for key, value in _up_overrides(args).items() if value is not None})
    except ConfigError as exc:
        raise CliError(f"bad config: {exc}", exit_code=EXIT_USAGE) from exc


def child_command(args: argparse.Namespace, run_dir: Path) -> list[str]:
    """The ``rollmesh up --foreground`` command line that runs the mesh for ``run_dir``."""
    command = [sys.executable, "-m", "rollmesh.cli"]
    if args.config:
        command += ["--config", str(Path(args.config).resolve())]
    if args.debug:
        command.append("--debug")
    if args.resume is not None:
        command += ["up", "--foreground", "--resume", str(run_dir.resolve())]
    else:
        command += ["up", "--foreground", "--run-dir", str(run_dir.resolve())]
    for flag, value in (("--nats-url", args.nats_url), ("--ray-address", args.ray_address),
                        ("--namespace", args.namespace), ("--model", args.model)):
        if value:
            command += [flag, value]
    if args.no_serve:
        command.append("--no-serve")
    if args.metrics_port is not None:  # 0 is a port choice too
        command += ["--metrics-port", str(args.metrics_port)]
    return command


def port_arg(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 0-65535, got {value}")
    return value


def wait_mesh_ready(child: subprocess.Popen[bytes], run_dir: Path, timeout_s: float,
                    on_poll: Callable[[float], None] = lambda elapsed: None) -> MeshAddress:
    """Poll for ``run_dir/mesh.json`` written by ``child``; fail early if the child dies."""
    started = time.monotonic()
    delay = 0.05
    while True:
        info = _read_ready_info(run_dir, child.pid)
        if info is not None:
            return info
        returncode = child.poll()
        if returncode is not None:
            raise CliError(f"the mesh process exited with code {returncode} before it was ready; "
                           f"its log is {run_dir / LOG_FILE}", detail=log_tail(run_dir / LOG_FILE))
        elapsed = time.monotonic() - started
        if elapsed > timeout_s:
            raise CliError(f"the mesh was not ready within {timeout_s:g}s; its log is {run_dir / LOG_FILE}",
                           detail=log_tail(run_dir / LOG_FILE))
        on_poll(elapsed)
        time.sleep(delay)  # polling a file for readiness; the file is the signal
        delay = min(delay * 1.5, 0.5)


def _read_ready_info(run_dir: Path, pid: int) -> MeshAddress | None:
    try:
        info = read_mesh_address(run_dir, run_root=run_dir.parent)
    except (MeshNotFoundError, OSError, msgspec.DecodeError):
        return None
    return info if info.pid == pid else None


def _wait_with_status(child: subprocess.Popen[bytes], run_dir: Path, timeout_s: float) -> MeshAddress:
    if not sys.stdout.isatty():
        print(f"starting the mesh in {run_dir} (log: {run_dir / LOG_FILE}) ...", flush=True)
        return wait_mesh_ready(child, run_dir, timeout_s)
    from rich.console import Console

    console = Console()
    with console.status(f"starting the mesh in {run_dir}") as status:
        return wait_mesh_ready(child, run_dir, timeout_s, on_poll=lambda elapsed: status.update(
            f"starting the mesh in {run_dir} ({elapsed:.0f}s; log: {run_dir / LOG_FILE})"))


def _refuse_live_mesh(run_dir: Path) -> None:
    try:
        info = read_mesh_address(run_dir, run_root=run_dir.parent)
    except (MeshNotFoundError, msgspec.DecodeError):
        return
    if mesh_process_alive(info.pid):
        raise CliError(f"a mesh (pid {info.pid}) already runs in {run_dir}; stop it with "
                       f"`rollmesh down --run-dir {run_dir}`")


async def _run_foreground(config: Any, run_dir: Path) -> int:
    """Run the mesh in this process: start it, wait for SIGINT/SIGTERM, stop it."""
    from rollmesh.launcher import Mesh

    mesh = Mesh(config, run_dir=run_dir)
    return await run_until_signalled(
        mesh.start, mesh.stop,
        ready=lambda info: (f"mesh ready: run dir {info.run_dir}, NATS {info.nats_url}, "
                            f"namespace {info.namespace}, Serve {info.serve_url or 'disabled'}, "
                            f"pid {info.pid}"),
        gave_up="stop requested while starting; stopping",
        stopping="stop requested; stopping the mesh",
        stopped="mesh stopped",
    )


# -- down --------------------------------------------------------------------------------------

def run_down(args: argparse.Namespace) -> int:
    config = load_cli_config(args)
    info = read_cli_mesh_address(args, config)
    mesh_file = Path(info.run_dir) / MESH_FILE
    if not mesh_process_alive(info.pid) or not _looks_like_rollmesh(info.pid):
        mesh_file.unlink(missing_ok=True)
        print(f"no mesh process {info.pid} is running; removed the stale {mesh_file}")
        return EXIT_OK
    print(f"stopping the mesh (pid {info.pid}, run dir {info.run_dir}) ...", flush=True)
    if stop_mesh_process(info.pid, grace_s=args.timeout):
        print("mesh stopped")
        return EXIT_OK
    mesh_file.unlink(missing_ok=True)
    raise CliError(f"the mesh did not stop within {args.timeout:g}s after SIGTERM; killed it; "
                   f"see {Path(info.run_dir) / LOG_FILE}")


def stop_mesh_process(pid: int, *, grace_s: float) -> bool:
    """SIGTERM ``pid`` (the mesh stops itself); SIGKILL it if it is still there after ``grace_s``.

    When it leads its own session, as ``up`` starts it, whatever is left in that session afterwards
    (the embedded nats-server, Ray's workers, after a crash or a kill) is SIGKILLed too.
    Returns True when it stopped on SIGTERM.
    """
    try:
        leads_session = os.getsid(pid) == pid
    except ProcessLookupError:
        return True
    _send_signal(pid, signal.SIGTERM)
    graceful = _wait_exit(pid, grace_s)
    if not graceful:
        _send_signal(pid, signal.SIGKILL)
        _wait_exit(pid, 10.0)
    if leads_session:
        for member in _session_members(pid):
            _send_signal(member, signal.SIGKILL)
    return graceful


def _send_signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def _session_members(session_id: int) -> list[int]:
    """Live processes of a session, from /proc (empty where there is no /proc)."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        # after "pid (comm)": state ppid pgrp session ...
        if len(fields) > 3 and fields[0] != "Z" and int(fields[3]) == session_id:
            members.append(int(stat.parent.name))
    return members


def _wait_exit(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    delay = 0.05
    while mesh_process_alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(delay)
        delay = min(delay * 1.5, 0.5)
    return True


def mesh_process_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # an exited process nobody has reaped yet is a zombie: as good as gone
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state != "Z"


def _looks_like_rollmesh(pid: int) -> bool:
    """Guards against a reused pid: the process named in mesh.json must be a rollmesh one."""
    try:
        command_line = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return True  # no /proc to ask: trust mesh.json
    return b"rollmesh" in command_line


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])
