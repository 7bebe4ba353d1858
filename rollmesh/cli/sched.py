"""``rollmesh sched simulate TRACE``: replay a workload trace against the GPU scheduler's policy.

Knows the scheduling package and argparse; no mesh, Ray or NATS. TRACE is SWF (``.swf``) or the
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
        policy = LendingScheduler(capacity, max_loan_grace_s=config.max_loan_grace_s)
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
