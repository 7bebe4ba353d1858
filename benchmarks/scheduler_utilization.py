"""GPU scheduler: busy utilization with idle accelerators lent to simulation jobs, vs a static split.

Replays the shipped trace (benchmarks/traces/scheduler_mix.swf: simulation jobs, and
scheduler_mix_rl.toml: an RL run's phases; see docs/scheduler.md for how they were generated) on
64 accelerators through the discrete-event simulator, once per policy, the same policy code the
live scheduler runs:

* ours: ``LendingScheduler``: RL roles first; EASY backfill of idle accelerators around RL's
  announced demand; preemption by cost with grace periods; elastic decode loans; preemption
  deadlines past a reservation by as much as jobs were seen to release early, within an RL wait
  budget of 2% (``busy_without_rl_slack``: the same with none).
* baseline: ``StaticReservationScheduler``: RL keeps its peak demand reserved the whole run;
  simulation jobs run FIFO on the rest, never lent RL's idle accelerators, never preempted.

``ours``/``baseline``: busy utilization (goodput: accelerator-seconds of useful work over all
accelerator-seconds of the RL run; work lost to preemption does not count). ``ratio`` = ours /
baseline. ``rl_slowdown``: the RL run's extra time waiting for accelerators, over its length
alone. ``lost_fraction``: what preemption cost jobs (lost progress, saving on request,
reloading) over the accelerator-seconds they held. ``rl_idle``: the share of the cluster RL
roles hold but do not compute with (part of what their phases demand), which no lending can use.
Deterministic: no timing is measured, so one run of each is the figure.

    python benchmarks/scheduler_utilization.py [--swf PATH] [--rl PATH] [--accelerators 64]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from common import print_result
from rollmesh.scheduling import (
    JobDefaults,
    LendingScheduler,
    StaticReservationScheduler,
    read_rl_phases,
    read_swf,
    simulate,
    swf_trace_jobs,
)

TRACES = Path(__file__).resolve().parent / "traces"


def describe(name: str, result) -> None:
    figures = result.figures()
    print(f"{name:>8}: busy {figures['busy_utilization']:.4f}, allocated {figures['allocated_utilization']:.4f}, "
          f"RL slowdown {figures['rl_slowdown']:.4f}, lost {figures['lost_fraction']:.4f}; jobs finished "
          f"{result.jobs_finished}/{result.jobs_submitted}, preemptions {result.preemptions}, kills {result.kills}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--swf", type=Path, default=TRACES / "scheduler_mix.swf")
    parser.add_argument("--rl", type=Path, default=TRACES / "scheduler_mix_rl.toml")
    parser.add_argument("--accelerators", type=int, default=64)
    args = parser.parse_args()
    capacity = args.accelerators
    run = read_rl_phases(args.rl)
    trace = read_swf(args.swf)
    jobs = swf_trace_jobs(trace)
    window = run.duration_s()
    offered = sum(job.duration_s * job.job.accelerators for job in jobs if job.submit_s < window)
    rl_idle = sum(phase.duration_s * count * (1 - phase.busy.get(role, 1.0))
                  for phase in run.phases for role, count in phase.demand.items())
    print(f"trace: {len(jobs)} simulation jobs offering {offered / (capacity * window):.3f} of {capacity} accelerators "
          f"over the {window / 3600:.1f} h RL run; RL peak {run.peak_demand()}, idle share held by RL "
          f"{rl_idle / (capacity * window):.4f}")
    alone = simulate(LendingScheduler(capacity), capacity, [], [run])
    ours = simulate(LendingScheduler(capacity), capacity, jobs, [run])
    baseline = simulate(StaticReservationScheduler(capacity, reserved=run.peak_demand()), capacity, jobs, [run])
    describe("alone", alone)
    describe("ours", ours)
    describe("baseline", baseline)
    # How much the figure depends on what a preemption costs a job (the trace's SWF jobs take
    # JobDefaults: save on request in 30 s, reload in 60 s): the same run with both halved.
    cheaper = JobDefaults(checkpoint_s=15.0, restart_cost_s=30.0)
    halved = simulate(LendingScheduler(capacity), capacity, swf_trace_jobs(trace, cheaper), [run])
    describe("halved", halved)
    no_slack = simulate(LendingScheduler(capacity, rl_wait_budget=0.0), capacity, jobs, [run])
    describe("no slack", no_slack)
    print(f"RL run alone: {alone.rl_runs[0].makespan_s / 3600:.2f} h; with our policy "
          f"{ours.rl_runs[0].makespan_s / 3600:.2f} h (waited {ours.rl_runs[0].waited_s:.0f} s)")
    ours_busy, baseline_busy = ours.totals.busy_utilization, baseline.totals.busy_utilization
    print_result(
        "scheduler_utilization", ours_busy, baseline_busy, "busy utilization (goodput share of the cluster)",
        ours_busy / baseline_busy,
        rl_slowdown=round(ours.rl_slowdown, 4), lost_fraction=round(ours.lost_fraction, 4),
        allocated=round(ours.totals.allocated_utilization, 4),
        baseline_allocated=round(baseline.totals.allocated_utilization, 4),
        baseline_rl_slowdown=round(baseline.rl_slowdown, 4), rl_idle=round(rl_idle / (capacity * window), 4),
        busy_if_preemption_halved=round(halved.totals.busy_utilization, 4),
        busy_without_rl_slack=round(no_slack.totals.busy_utilization, 4),
        preemptions=ours.preemptions, kills=ours.kills, jobs_finished=ours.jobs_finished,
        baseline_jobs_finished=baseline.jobs_finished, accelerators=capacity,
        hours=round(window / 3600, 2),
    )


if __name__ == "__main__":
    main()
