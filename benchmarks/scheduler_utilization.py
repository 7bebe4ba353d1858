"""GPU scheduler: busy utilization with idle accelerators lent to simulation jobs, vs a static split.

Replays the shipped trace (benchmarks/traces/scheduler_mix.swf: simulation jobs, and
scheduler_mix_rl.toml: an RL run's phases; see docs/scheduler.md for how they were generated) on
64 accelerators through the discrete-event simulator, once per policy, the same policy code the
live scheduler runs:

* ours: ``LendingScheduler``: RL roles first; EASY backfill of idle accelerators around RL's
  announced demand; preemption by cost with grace periods; decode loans; preemption
  deadlines past a reservation by as much as jobs were seen to release early, within an RL wait
  budget of 2% (``busy_without_rl_slack``: the same with none). A role whose demand falls lends
  its accelerators by releasing its memory and takes them back by resuming it: the simulator
  charges the release and resume times measured here first, on the local engine
  (``role_release_s`` / ``role_resume_s``: medians of 5 release/resume cycles of a 22M Llama with
  8 parked sessions, CPU; ``busy_free_role_swap``: as if free, the figure before they were
  measured; ``busy_if_role_swap_10s``: an assumed 10 s each, the order of a GPU server's weights
  and KV over PCIe; ``busy_pinned_role_devices``: each role must get back its own devices, as the
  live scheduler would; ``busy_without_role_lending``: roles keep their guaranteed accelerators
  for the whole run, as a live mesh does today).
* baseline: ``StaticReservationScheduler``: RL keeps its peak demand reserved the whole run;
  simulation jobs run FIFO on the rest, never lent RL's idle accelerators, never preempted.

``ours``/``baseline``: busy utilization (goodput: accelerator-seconds of useful work over all
accelerator-seconds of the RL run; work lost to preemption does not count). ``ratio`` = ours /
baseline. ``rl_slowdown``: the RL run's extra time waiting for accelerators, over its length
alone. ``lost_fraction``: what preemption cost jobs (lost progress, saving on request,
reloading) over the accelerator-seconds they held. ``rl_idle``: the share of the cluster RL
roles hold but do not compute with (part of what their phases demand), which no lending can use.
The simulations are deterministic; only the release and resume times are measured (and vary).

    python benchmarks/scheduler_utilization.py [--swf PATH] [--rl PATH] [--accelerators 64]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from pathlib import Path

import msgspec

from common import NoEos, build_hf_llama, parameter_count, print_result, setup_threads
from rollmesh.scheduling import (
    JobDefaults,
    LendingScheduler,
    RlRunSpec,
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


def measure_role_swap(cycles: int = 5) -> tuple[float, float, int]:
    """Median seconds of the local engine's release_memory and resume_memory, and the bytes one
    release moves, with 8 sessions' KV parked (what a decode worker idle between waves holds)."""
    from rollmesh.config import InferenceConfig, ModelConfig
    from rollmesh.engine.local_engine import LocalEngine
    from rollmesh.engine.models import load_hf_model
    from rollmesh.engine.protocols import GenerateOptions
    from rollmesh.messages.base import SamplingParams

    setup_threads()
    hf_model, directory = build_hf_llama()
    model = load_hf_model(directory)

    async def run() -> tuple[float, float, int]:
        engine = LocalEngine(ModelConfig(), InferenceConfig(max_batch=8, kv_block_size=16), model=model,
                             tokenizer=NoEos())
        releases, resumes, moved = [], [], 0
        async with engine:
            sampling = SamplingParams(temperature=0.0, max_new_tokens=32)
            await asyncio.gather(*(engine.generate(list(range(3 + i, 203 + i)), sampling, request_id=f"s{i}",
                                                   options=GenerateOptions(session_id=f"s{i}")) for i in range(8)))
            for _ in range(cycles):
                started = time.perf_counter()
                moved = (await engine.release_memory()).bytes_moved
                releases.append(time.perf_counter() - started)
                started = time.perf_counter()
                await engine.resume_memory()
                resumes.append(time.perf_counter() - started)
        return statistics.median(releases), statistics.median(resumes), moved

    release_s, resume_s, moved = asyncio.run(run())
    print(f"local engine ({parameter_count(hf_model) / 1e6:.0f}M Llama, 8 parked sessions, CPU): release "
          f"{release_s * 1e3:.1f} ms, resume {resume_s * 1e3:.1f} ms, {moved / 2**20:.1f} MiB of KV moved "
          "(on CPU the weights already are in host memory)")
    return release_s, resume_s, moved


def without_role_lending(run: RlRunSpec) -> RlRunSpec:
    """The run with every role holding at least its guarantee in every phase (a live mesh without
    lend_role_accelerators), computing the same work: busy shares scaled to what is held."""
    phases = []
    for phase in run.phases:
        demand = {role: max(phase.demand.get(role, 0), share.guaranteed) for role, share in run.roles.items()}
        busy = {role: (phase.demand.get(role, 0) * phase.busy.get(role, 1.0) / count if count else 1.0)
                for role, count in demand.items()}
        phases.append(msgspec.structs.replace(phase, demand=demand, busy=busy))
    return msgspec.structs.replace(run, phases=phases)


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
    release_s, resume_s, moved = measure_role_swap()
    swap = dict(role_release_s=release_s, role_resume_s=resume_s)
    alone = simulate(LendingScheduler(capacity), capacity, [], [run])
    ours = simulate(LendingScheduler(capacity), capacity, jobs, [run], **swap)
    baseline = simulate(StaticReservationScheduler(capacity, reserved=run.peak_demand()), capacity, jobs, [run])
    describe("alone", alone)
    describe("ours", ours)
    describe("baseline", baseline)
    # How much the figure depends on what a preemption costs a job (the trace's SWF jobs take
    # JobDefaults: save on request in 30 s, reload in 60 s): the same run with both halved.
    cheaper = JobDefaults(checkpoint_s=15.0, restart_cost_s=30.0)
    halved = simulate(LendingScheduler(capacity), capacity, swf_trace_jobs(trace, cheaper), [run], **swap)
    describe("halved", halved)
    no_slack = simulate(LendingScheduler(capacity, rl_wait_budget=0.0), capacity, jobs, [run], **swap)
    describe("no slack", no_slack)
    free_swap = simulate(LendingScheduler(capacity), capacity, jobs, [run])
    describe("free swap", free_swap)
    slow_swap = simulate(LendingScheduler(capacity), capacity, jobs, [run], role_release_s=10.0, role_resume_s=10.0)
    describe("10 s swap", slow_swap)
    pinned = simulate(LendingScheduler(capacity, role_devices_pinned=True), capacity, jobs, [run], **swap)
    describe("pinned", pinned)
    kept = simulate(LendingScheduler(capacity), capacity, jobs, [without_role_lending(run)])
    describe("kept", kept)
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
        role_release_s=round(release_s, 5), role_resume_s=round(resume_s, 5), role_swap_bytes=moved,
        busy_free_role_swap=round(free_swap.totals.busy_utilization, 4),
        busy_if_role_swap_10s=round(slow_swap.totals.busy_utilization, 4),
        rl_slowdown_if_role_swap_10s=round(slow_swap.rl_slowdown, 4),
        busy_pinned_role_devices=round(pinned.totals.busy_utilization, 4),
        rl_slowdown_pinned_role_devices=round(pinned.rl_slowdown, 4),
        busy_without_role_lending=round(kept.totals.busy_utilization, 4),
        preemptions=ours.preemptions, kills=ours.kills, jobs_finished=ours.jobs_finished,
        baseline_jobs_finished=baseline.jobs_finished, accelerators=capacity,
        hours=round(window / 3600, 2),
    )


if __name__ == "__main__":
    main()
