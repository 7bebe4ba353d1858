"""``rollmesh sched``: submit simulation jobs to a running mesh's GPU scheduler, ask it for its
status, or replay a workload trace against its policy offline.

``submit-sim`` publishes a ``SimJobSubmitted`` (durable: it waits in JetStream for the scheduler)
and ``status`` asks the scheduler (request/reply), both over NATS to the mesh ``mesh.json``
names (or ``--nats-url``); nothing imports Ray. ``simulate`` needs no mesh at all. TRACE is SWF (``.swf``) or the
ML jobs CSV (``.csv``); ``--rl PHASES`` adds RL runs (repeat it for several, sharing fairly).
Prints the utilization table, writes a utilization-over-time PNG, and ends with one JSON line:
``busy_utilization``, ``allocated_utilization``, ``rl_slowdown``, ``lost_fraction``. The policy's
parameters come from the config's ``[scheduler]`` section, as in the mesh.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from rollmesh.cli.errors import EXIT_OK, EXIT_USAGE, CliError
from rollmesh.cli.target import (
    add_target_options,
    bus_errors_as_cli_errors,
    find_mesh,
    load_cli_config,
    positive_float,
    positive_int,
)


def register(subparsers: Any, common: argparse.ArgumentParser) -> None:
    sched = subparsers.add_parser("sched", parents=[common], help="the GPU scheduler: simulate its policy on a trace",
                                  description="The GPU scheduler that lends idle accelerators to simulation jobs.")
    commands = sched.add_subparsers(dest="sched_command", metavar="SUBCOMMAND", required=True)
    simulate = commands.add_parser(
        "simulate", parents=[common], help="replay a trace (SWF or ML jobs CSV) and report utilization",
        description="Replay simulation jobs (SWF, or a CSV with the header "
                    "job_id,submit_s,accelerators,duration_s,expected_s,grace_s,checkpoint_interval_s,"
                    "checkpoint_s,restart_cost_s) and RL runs' phases (TOML) against the lending policy. "
                    "Without --rl the jobs replay alone. The last line of output is one JSON object.")
    simulate.add_argument("trace", type=Path, metavar="TRACE")
    simulate.add_argument("--rl", type=Path, action="append", default=[], metavar="PHASES",
                          help="an RL run's phases file (TOML); repeat for several runs")
    simulate.add_argument("--accelerators", type=int, metavar="N",
                          help="cluster size (default: the SWF header's MaxProcs, else the config's "
                               "scheduler.total_gpus)")
    simulate.add_argument("--policy", choices=("lending", "static"), default="lending",
                          help="lending (default), or static: RL keeps its peak reserved, jobs run FIFO on the rest")
    simulate.add_argument("--plot", type=Path, metavar="PNG",
                          help="where to write the plot (default: TRACE's name with .utilization.png, here)")
    simulate.set_defaults(handler=run_simulate)

    submit = commands.add_parser(
        "submit-sim", parents=[common], help="submit a preemptible simulation job to the running mesh",
        description="Queue COMMAND as a simulation job on lent accelerators. The job is told where to "
                    "checkpoint ($ROLLMESH_JOB_CHECKPOINT_DIR, the same at every restart); a preemption "
                    "is SIGTERM, after which it must checkpoint and exit within --grace seconds or be "
                    "killed. Example: rollmesh sched submit-sim --accelerators 2 --duration 3600 "
                    "--grace 30 --checkpoint-s 5 -- python md.py")
    add_target_options(submit)
    submit.add_argument("--job-id", metavar="ID", help="the job's id (default: sim-<random>)")
    submit.add_argument("--accelerators", type=positive_int, required=True, metavar="N")
    submit.add_argument("--duration", type=positive_float, required=True, metavar="S",
                        help="expected run time in seconds (backfill plans with it)")
    submit.add_argument("--grace", type=float, default=60.0, metavar="S",
                        help="seconds it may take to leave after a preemption request (default 60)")
    submit.add_argument("--checkpoint-interval", type=float, default=0.0, metavar="S",
                        help="it checkpoints on its own every S seconds (default 0: not periodically)")
    submit.add_argument("--checkpoint-s", type=float, metavar="S",
                        help="seconds it needs to checkpoint when asked (default: it cannot save on request)")
    submit.add_argument("--restart-cost", type=float, default=0.0, metavar="S",
                        help="seconds a restart spends reloading before it makes progress")
    submit.add_argument("job_command", nargs=argparse.REMAINDER, metavar="-- COMMAND ...")
    submit.set_defaults(handler=run_submit_sim)

    status = commands.add_parser("status", parents=[common], help="the scheduler's roles, jobs and utilization",
                                 description="Ask the running mesh's GPU scheduler what it holds and lends.")
    add_target_options(status)
    status.add_argument("--json", action="store_true", help="print the status as one JSON object")
    status.add_argument("--timeout", type=positive_float, default=5.0, metavar="S",
                        help="seconds to wait for the scheduler's answer (default 5)")
    status.set_defaults(handler=run_status)


def run_simulate(args: argparse.Namespace) -> int:
    from rollmesh.config import load_config
    from rollmesh.scheduling import (
        LendingScheduler,
        StaticReservationScheduler,
        TraceFormatError,
        read_ml_jobs,
        read_rl_phases,
        read_swf,
        simulate,
        swf_trace_jobs,
    )
    from rollmesh.scheduling.utilization_plot import write_utilization_png

    config = load_config(args.config).scheduler
    try:
        capacity = args.accelerators
        if args.trace.suffix.lower() == ".csv":
            jobs = read_ml_jobs(args.trace)
        else:
            swf = read_swf(args.trace)
            jobs = swf_trace_jobs(swf)
            capacity = capacity or swf.max_processors()
        runs = [read_rl_phases(path) for path in args.rl]
    except OSError as exc:
        raise CliError(f"cannot read {exc.filename}: {exc.strerror}", exit_code=EXIT_USAGE) from exc
    except TraceFormatError as exc:
        raise CliError(str(exc), exit_code=EXIT_USAGE) from exc
    capacity = capacity or config.total_gpus
    if not capacity or capacity < 1:
        raise CliError("how many accelerators? pass --accelerators N", exit_code=EXIT_USAGE)
    if args.policy == "static":
        policy: Any = StaticReservationScheduler(capacity, reserved=sum(run.peak_demand() for run in runs))
    else:
        policy = LendingScheduler(capacity, max_loan_grace_s=config.max_loan_grace_s,
                                  rl_wait_budget=config.rl_wait_budget)
    result = simulate(policy, capacity, jobs, runs)
    _print_table(args, capacity, result)
    plot = args.plot or Path(f"{args.trace.stem}.utilization.png")
    write_utilization_png(result, plot, title=f"{args.trace.name}, {args.policy} policy")
    print(f"plot: {plot}")
    print(json.dumps(result.figures()))
    return EXIT_OK


def _print_table(args: argparse.Namespace, capacity: int, result: Any) -> None:
    from rich.console import Console
    from rich.table import Table

    totals = result.totals
    table = Table(title=f"{args.trace.name} on {capacity} accelerators, {args.policy} policy")
    table.add_column("figure")
    table.add_column("value", justify="right")
    rows = [
        ("window", f"{totals.window_s / 3600:.2f} h"),
        ("busy utilization (goodput)", f"{totals.busy_utilization:.4f}"),
        ("allocated utilization", f"{totals.allocated_utilization:.4f}"),
        ("held by RL roles", f"{totals.rl_held_s / (capacity * totals.window_s):.4f}" if totals.window_s else "0"),
        ("jobs submitted / finished / rejected",
         f"{result.jobs_submitted} / {result.jobs_finished} / {result.jobs_rejected}"),
        ("preemptions / kills", f"{result.preemptions} / {result.kills}"),
        ("work lost to preemption (share of job time)", f"{result.lost_fraction:.4f}"),
    ]
    rows += [(f"RL run {run.run_id}: waited / alone / slowdown",
              f"{run.waited_s:.0f} s / {run.alone_s / 3600:.2f} h / {run.slowdown:.4f}") for run in result.rl_runs]
    for name, value in rows:
        table.add_row(name, value)
    Console(width=100).print(table)


def run_submit_sim(args: argparse.Namespace) -> int:
    import asyncio
    import time
    import uuid

    import msgspec

    from rollmesh.messages import SimJobSubmitted

    command = args.job_command[1:] if args.job_command[:1] == ["--"] else args.job_command
    if not command:
        raise CliError("which command? give it after --", exit_code=EXIT_USAGE)
    try:
        job = msgspec.convert(dict(
            job_id=args.job_id or f"sim-{uuid.uuid4().hex[:12]}", command=command, accelerators=args.accelerators,
            expected_duration_s=args.duration, grace_s=args.grace, checkpoint_interval_s=args.checkpoint_interval,
            checkpoint_s=args.checkpoint_s, restart_cost_s=args.restart_cost, submitted_at=time.time()),
            SimJobSubmitted)
    except msgspec.ValidationError as exc:
        raise CliError(f"bad job: {exc}", exit_code=EXIT_USAGE) from exc
    config = load_cli_config(args)
    target = find_mesh(args, config, role="mesh")
    subject = asyncio.run(_publish_job(target, job))
    print(f"submitted {job.job_id} ({job.accelerators} accelerator(s)) to {subject}")
    return EXIT_OK


async def _publish_job(target: Any, job: Any) -> str:
    from rollmesh.bus.publisher import BusPublisher
    from rollmesh.bus.streams import StreamLimits, ensure_streams
    from rollmesh.messages.subjects import SIM_SUBMITTED

    with bus_errors_as_cli_errors(target):
        nc = await target.connect("rollmesh-sched", role="mesh")
    try:
        js = nc.jetstream()
        # Idempotent: the job is kept even when no scheduler has created the streams yet.
        await ensure_streams(js, target.namespace, StreamLimits(replicas=target.nats.replicas))
        await BusPublisher(nc, js, target.namespace).publish(SIM_SUBMITTED, job)
        return SIM_SUBMITTED.format(target.namespace)
    finally:
        await nc.close()


def run_status(args: argparse.Namespace) -> int:
    import asyncio

    import msgspec

    config = load_cli_config(args)
    target = find_mesh(args, config, role="mesh")
    status = asyncio.run(_ask_status(target, args.timeout))
    if args.json:
        print(json.dumps(msgspec.to_builtins(status)))
        return EXIT_OK
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"GPU scheduler of {target.namespace}: {status.capacity} accelerators")
    table.add_column("holder")
    table.add_column("state / accelerators", justify="right")
    for role, count in sorted(status.roles.items()):
        busy = status.roles_busy.get(role.split(".")[0])
        table.add_row(f"role {role}", str(count) if busy is None else f"{count} ({busy:.0%} busy)")
    for job_id, state in sorted(status.jobs.items()):
        table.add_row(f"job {job_id}", state)
    Console(width=100).print(table)
    print(f"busy {status.busy_utilization:.3f}, allocated {status.allocated_utilization:.3f}, "
          f"preemptions {status.preemptions}, kills {status.kills}, "
          f"lost {status.lost_accelerator_s:.0f} accelerator-s, RL waited {status.rl_queueing_s:.0f} s")
    return EXIT_OK


async def _ask_status(target: Any, timeout_s: float) -> Any:
    from rollmesh.bus.errors import NoRespondersError, RequestTimeoutError
    from rollmesh.bus.publisher import BusPublisher
    from rollmesh.messages import SchedulerStatusRequest
    from rollmesh.messages.subjects import SCHED_STATUS

    with bus_errors_as_cli_errors(target):
        nc = await target.connect("rollmesh-sched", role="mesh")
    try:
        return await BusPublisher(nc, nc.jetstream(), target.namespace).request(
            SCHED_STATUS, SchedulerStatusRequest(), timeout_s)
    except (NoRespondersError, RequestTimeoutError) as exc:
        raise CliError(f"no GPU scheduler answered on {SCHED_STATUS.format(target.namespace)}: is the mesh up?") \
            from exc
    finally:
        await nc.close()
