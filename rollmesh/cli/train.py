"""``rollmesh train RUN.toml``: run a training job's ``[[stages]]`` on a mesh.

Knows argparse, the config loader, the checks a run file must pass before anything starts, and
how to reach a mesh: one of its own (started here, stopped at the end), or a running one, attached
with ``--run-dir`` (its mesh.json) or ``--nats-url`` and ``--ray-address``. ``--resume RUN_DIR``
continues a stopped or killed job from its run directory (its train/job.json and data cursor),
attached to the mesh running there if there is one, else on a mesh of its own started again.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path
from typing import Any

from rollmesh.cli.errors import EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE, CliError
from rollmesh.cli.mesh import mesh_process_alive
from rollmesh.cli.target import model_dir_arg, namespace_arg
from rollmesh.config import ConfigError, RollmeshConfig, load_config, load_run_config
from rollmesh.mesh_address import MeshAddress, MeshNotFoundError, new_run_dir, read_mesh_address


def register(subparsers: Any, common: argparse.ArgumentParser) -> None:
    train = subparsers.add_parser(
        "train", parents=[common], help="run a training job: the [[stages]] of a run file",
        description="Run RUN.toml's [[stages]] in order on a mesh (started here, or a running one with "
                    "--run-dir or --nats-url and --ray-address), then write the final Hugging Face "
                    "checkpoint (final_model/) and summary.json into the run directory. RUN.toml is "
                    "an ordinary rollmesh config file (docs/training.md).")
    train.add_argument("run_file", nargs="?", type=Path, metavar="RUN.toml", help="the run file")
    train.add_argument("--resume", type=Path, metavar="RUN_DIR",
                       help="continue the stopped or killed job of RUN_DIR: no prompt is skipped or repeated")
    where = train.add_argument_group("which mesh (default: start one, stopped at the end)")
    where.add_argument("--run-dir", type=Path, metavar="DIR",
                       help="the run directory: a running mesh's (attach to it) or a new one")
    where.add_argument("--nats-url", metavar="URL", help="attach to the mesh on this NATS server (with --ray-address)")
    where.add_argument("--ray-address", metavar="ADDR", help="the attached mesh's Ray cluster (with --nats-url)")
    train.add_argument("--namespace", type=namespace_arg, metavar="NS", help="subject namespace")
    train.add_argument("--model", type=model_dir_arg, metavar="DIR", help="the model directory (model.path)")
    train.add_argument("--no-serve", action="store_true", help="do not deploy the Serve inference app")
    train.set_defaults(handler=run_train_command)


def run_train_command(args: argparse.Namespace) -> int:
    config, run_dir = _job_config(args)
    check_run_file(config)
    attach = _attach_target(args, config)
    if run_dir is None:
        run_dir = Path(attach.run_dir) if attach and attach.run_dir else new_run_dir(config.run_root)
    run_dir = Path(run_dir).resolve()
    if args.resume is None:
        _refuse_earlier_job(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    print(f"train: {len(config.stages)} stage(s); run dir {run_dir}", flush=True)
    try:
        summary = asyncio.run(run_job(config, run_dir, attach))
    except asyncio.CancelledError:  # SIGINT or SIGTERM: the mesh it started is stopped
        print(f"train: stopped; continue with `rollmesh train --resume {run_dir}`", file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
    print(f"summary: {run_dir / 'summary.json'}")
    print(f"final model: {summary['final_model']}")
    return EXIT_OK


def _job_config(args: argparse.Namespace) -> tuple[RollmeshConfig, Path | None]:
    overrides = {"namespace": args.namespace, "model.path": args.model, "nats.url": args.nats_url,
                 "ray.address": args.ray_address, "serve.enabled": False if args.no_serve else None}
    overrides = {key: value for key, value in overrides.items() if value is not None}
    try:
        if args.resume is not None:
            if args.run_file or args.run_dir or args.config:
                raise CliError("--resume continues a job with its own config: it takes no RUN.toml, "
                               "--run-dir or --config", exit_code=EXIT_USAGE)
            return _resumed_job_config(args.resume, overrides), args.resume
        if args.run_file is None:
            raise CliError("give a run file (rollmesh train RUN.toml) or --resume RUN_DIR", exit_code=EXIT_USAGE)
        if args.config is not None:
            raise CliError("the run file is the config: give RUN.toml or --config, not both", exit_code=EXIT_USAGE)
        if args.run_root is not None:
            overrides["run_root"] = str(args.run_root)
        return load_config(args.run_file, overrides=overrides), args.run_dir
    except ConfigError as exc:
        raise CliError(f"bad config: {exc}", exit_code=EXIT_USAGE) from exc


def _resumed_job_config(run_dir: Path, overrides: dict[str, Any]) -> RollmeshConfig:
    """The job's own config (train/job.json), whether it started its mesh or attached to one."""
    from rollmesh.train.job import job_config_path

    job_file = job_config_path(run_dir)
    if not job_file.is_file():
        raise CliError(f"{run_dir} holds no training job to resume (no {job_file.relative_to(run_dir)})",
                       exit_code=EXIT_USAGE)
    return load_run_config(job_file.parent, overrides=overrides, file_name=job_file.name)


def _refuse_earlier_job(run_dir: Path) -> None:
    """A run directory holds one training job: a new one would mix its cursor and steps with it."""
    from rollmesh.train.job import job_config_path

    if job_config_path(run_dir).is_file():
        raise CliError(f"{run_dir} already holds a training job: continue it with "
                       f"`rollmesh train --resume {run_dir}`, or give another --run-dir", exit_code=EXIT_USAGE)


def check_run_file(config: RollmeshConfig) -> None:
    """Everything a run file can get wrong, found before any mesh starts (a usage error)."""
    from rollmesh.train.checks import RunFileError, check_stages

    try:
        check_stages(config)
    except RunFileError as exc:
        raise CliError(f"bad run file: {exc}", exit_code=EXIT_USAGE) from exc


def _attach_target(args: argparse.Namespace, config: RollmeshConfig) -> MeshAddress | None:
    """The running mesh to attach to (its NATS and Ray), or None to start one. The job connects
    to its NATS with the config's TLS and no credentials (an open NATS)."""
    if bool(args.nats_url) != bool(args.ray_address):
        raise CliError("attaching by address needs both --nats-url and --ray-address", exit_code=EXIT_USAGE)
    access = {"nats_tls": config.security.nats_tls, "nats": config.nats}
    if args.nats_url:
        return MeshAddress(nats_url=args.nats_url, namespace=config.namespace,
                           run_dir=str(args.run_dir) if args.run_dir else "", ray_address=args.ray_address,
                           ray_namespace=f"rollmesh-{config.namespace}", **access)
    run_dir = args.resume if args.resume is not None else args.run_dir
    if run_dir is None:
        return None
    try:
        found = read_mesh_address(run_dir, run_root=config.run_root)
    except MeshNotFoundError:
        return None  # no mesh running there: the job starts its own in that directory
    if not mesh_process_alive(found.pid):
        return None  # the mesh.json of a mesh that was killed: the job starts its mesh again
    return replace(found, **access)


async def run_job(config: RollmeshConfig, run_dir: Path, attach: MeshAddress | None) -> dict[str, Any]:
    """The job of ``config`` in ``run_dir``: on the mesh ``attach`` names, else one started here."""
    from rollmesh.tracking import TrackerError
    from rollmesh.train.job import TrainJob
    from rollmesh.train.progress import step_reporter

    with step_reporter(sys.stdout) as (report, on_step):
        job = TrainJob(config, run_dir=run_dir, run_name=run_dir.name, report=report, on_step=on_step)
        try:
            trackers = job.open_trackers()  # a tracker that cannot open stops the job before a mesh starts
        except TrackerError as exc:
            raise CliError(f"cannot open the experiment tracker: {exc}", exit_code=EXIT_USAGE) from exc
        try:
            return await _run_job(job, config, run_dir, attach, report)
        finally:
            trackers.close()


def _cancel_on_signals() -> None:
    """SIGINT and SIGTERM cancel the job (whose mesh, if it started one, is then stopped):
    installed again after Ray starts, as ray.init takes SIGTERM for itself."""
    loop, job = asyncio.get_running_loop(), asyncio.current_task()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, job.cancel)


async def _run_job(job: Any, config: RollmeshConfig, run_dir: Path, attach: MeshAddress | None,
                   report: Any) -> dict[str, Any]:
    from rollmesh.train.job import MeshHandle, mesh_config_for

    _cancel_on_signals()
    if attach is not None:
        with _attached_ray(attach):
            import ray

            trainer = ray.get_actor("trainer", namespace=attach.ray_namespace)
            _cancel_on_signals()
            return await job.run(MeshHandle(attach, trainer))
    from rollmesh.launcher import Mesh

    mesh = Mesh(mesh_config_for(config), run_dir=run_dir)
    address = await mesh.start()  # a start cut short (a signal) stops what came up (Mesh.start)
    _cancel_on_signals()
    report(f"mesh up: NATS {address.nats_url}")
    try:
        return await job.run(MeshHandle(address.only("mesh"), mesh.trainer,
                                        restart_trainer=mesh.restart_trainer))
    finally:
        await mesh.stop()


def _attached_ray(attach: MeshAddress) -> ExitStack:
    import ray

    from rollmesh.local_ray import LocalRayEnvironment

    stack = ExitStack()
    if attach.ray_auth_token_file:  # a Ray the mesh started: loopback, its token
        host = attach.ray_address.rsplit(":", 1)[0].strip("[]")
        environment = LocalRayEnvironment(token_file=attach.ray_auth_token_file, node_ip_address=host)
        environment.apply()
        stack.callback(environment.restore)
    ray.init(address=attach.ray_address, include_dashboard=False, log_to_driver=False)
    stack.callback(ray.shutdown)
    return stack
