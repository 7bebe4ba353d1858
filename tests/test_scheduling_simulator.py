"""Trace readers (SWF, ML jobs CSV, RL phases), the simulator on hand-checkable traces, and
``rollmesh sched simulate`` end to end on the shipped trace."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from rollmesh.cli import main
from rollmesh.scheduling import (
    JobDefaults,
    LendingScheduler,
    RlRunSpec,
    SimJob,
    StaticReservationScheduler,
    TraceFormatError,
    TraceJob,
    read_ml_jobs,
    read_rl_phases,
    read_swf,
    simulate,
    swf_trace_jobs,
)

pytestmark = pytest.mark.unit

TRACES = Path(__file__).resolve().parent.parent / "benchmarks" / "traces"
SWF_HEADER = "; Version: 2.2\n; MaxProcs: 8\n;\n"
CSV_HEADER = "job_id,submit_s,accelerators,duration_s,expected_s,grace_s,checkpoint_interval_s,checkpoint_s,restart_cost_s\n"


def swf_line(number: int, *, submit=0, run=100, procs=2, requested=200, status=1) -> str:
    return f"{number} {submit} -1 {run} {procs} -1 -1 {procs} {requested} -1 {status} 1 -1 -1 1 1 -1 -1\n"


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


# --- readers -----------------------------------------------------------------------------------

def test_swf_reader_keeps_the_header_and_reads_minus_one_as_unknown(tmp_path):
    trace = read_swf(write(tmp_path, "t.swf", SWF_HEADER + swf_line(1) + "\n" + swf_line(2, submit=5, requested=-1)))
    assert trace.header["MaxProcs"] == "8" and trace.max_processors() == 8
    first, second = trace.jobs
    assert (first.job_number, first.run_time, first.allocated_processors, first.requested_time) == (1, 100.0, 2, 200.0)
    assert first.wait_time is None and first.think_time is None and first.line == 4
    assert second.requested_time is None


def test_swf_jobs_replay_summary_lines_with_the_requested_time_as_estimate(tmp_path):
    text = (SWF_HEADER + swf_line(1) + swf_line(2, status=2) + swf_line(3, run=0)
            + swf_line(4, run=50, requested=-1))
    jobs = swf_trace_jobs(read_swf(write(tmp_path, "t.swf", text)), JobDefaults(grace_s=7.0))
    assert [(j.job.job_id, j.duration_s, j.job.expected_duration_s) for j in jobs] == [("1", 100.0, 200.0),
                                                                                       ("4", 50.0, 50.0)]
    assert jobs[0].job.grace_s == 7.0


@pytest.mark.parametrize(("line", "reason"), [
    ("1 0 -1 100 2 -1 -1 2 200 -1 1 1 -1 -1 1 1 -1\n", "17 fields"),
    ("1 0 -1 100 two -1 -1 2 200 -1 1 1 -1 -1 1 1 -1 -1\n", "allocated_processors is 'two'"),
    ("1 0 -1 100 2.5 -1 -1 2 200 -1 1 1 -1 -1 1 1 -1 -1\n", "not a whole number"),
    ("1 0 -1 -5 2 -1 -1 2 200 -1 1 1 -1 -1 1 1 -1 -1\n", "run_time is '-5'"),
], ids=["short-line", "not-a-number", "fractional-count", "negative"])
def test_a_malformed_swf_line_is_a_typed_error_with_its_line_number(tmp_path, line, reason):
    path = write(tmp_path, "bad.swf", SWF_HEADER + swf_line(1) + line)
    with pytest.raises(TraceFormatError, match=reason) as error:
        read_swf(path)
    assert (error.value.path, error.value.line) == (str(path), 5)


def test_ml_jobs_csv_reads_defaults_for_empty_cells(tmp_path):
    path = write(tmp_path, "jobs.csv", "# two jobs\n" + CSV_HEADER + "a,0,2,100,,60,0,,30\nb,10,1,50,80,30,600,5,0\n")
    a, b = read_ml_jobs(path)
    assert a == TraceJob(submit_s=0.0, duration_s=100.0, job=SimJob(
        job_id="a", accelerators=2, expected_duration_s=100.0, grace_s=60.0, checkpoint_interval_s=0.0,
        checkpoint_s=None, restart_cost_s=30.0))
    assert (b.job.expected_duration_s, b.job.checkpoint_s, b.job.checkpoint_interval_s) == (80.0, 5.0, 600.0)


@pytest.mark.parametrize(("rows", "line", "reason"), [
    ("a,0,2,100,,60,0,,30\nb,0,x,100,,60,0,,30\n", 4, "accelerators is 'x'"),
    ("a,0,2,100,,60,0,,30\nb,0,2,100\n", 4, "4 columns"),
    ("a,0,0,100,,60,0,,30\n", 3, "a whole number >= 1"),
    ("a,0,1,100,,60,0,,30\na,0,1,100,,60,0,,30\n", 4, "appears twice"),
], ids=["not-a-number", "short-row", "zero-accelerators", "duplicate"])
def test_a_malformed_csv_row_is_a_typed_error_with_its_line_number(tmp_path, rows, line, reason):
    path = write(tmp_path, "jobs.csv", "# comment\n" + CSV_HEADER + rows)
    with pytest.raises(TraceFormatError, match=reason) as error:
        read_ml_jobs(path)
    assert error.value.line == line


def test_a_csv_without_the_header_is_refused(tmp_path):
    with pytest.raises(TraceFormatError, match="header") as error:
        read_ml_jobs(write(tmp_path, "jobs.csv", "a,0,2,100,,60,0,,30\n"))
    assert error.value.line == 1


def test_rl_phases_naming_an_undeclared_role_or_breaking_a_constraint_are_refused(tmp_path):
    roles = 'roles.trainer = { guaranteed = 2 }\n'
    with pytest.raises(TraceFormatError, match="decode"):
        read_rl_phases(write(tmp_path, "a.toml", roles + 'phases = [{ name = "x", duration_s = 1.0, demand = { decode = 1 } }]\n'))
    with pytest.raises(TraceFormatError, match="duration_s"):
        read_rl_phases(write(tmp_path, "b.toml", roles + 'phases = [{ name = "x", duration_s = -1.0 }]\n'))


# --- the simulator -----------------------------------------------------------------------------

def rl_run(tmp_path: Path, notice: float, *, first=2, second=4) -> RlRunSpec:
    return read_rl_phases(write(tmp_path, "rl.toml", (
        'roles.trainer = { guaranteed = 4, priority = 1 }\n'
        f'phases = [{{ name = "wait", duration_s = 100.0, notice_s = {notice}, demand = {{ trainer = {first} }}, '
        'busy = { trainer = 0.5 } },\n'
        f'  {{ name = "train", duration_s = 100.0, demand = {{ trainer = {second} }} }}]\n')))


def sim_job(job_id="sim", accelerators=2, duration=150.0, **spec) -> TraceJob:
    spec.setdefault("grace_s", 10.0)
    spec.setdefault("checkpoint_s", 5.0)
    return TraceJob(submit_s=0.0, duration_s=duration, job=SimJob(
        job_id=job_id, accelerators=accelerators, expected_duration_s=duration, **spec))


def test_jobs_alone_replay_fifo_until_the_last_one_ends():
    jobs = [sim_job("a", 2, 100.0), sim_job("b", 4, 50.0)]
    for policy in (LendingScheduler(4), StaticReservationScheduler(4, reserved=0)):
        result = simulate(policy, 4, jobs)
        # a on 2 accelerators over 0-100; b needs all 4, so 100-150.
        assert result.totals.window_s == 150.0
        assert result.totals.busy_utilization == pytest.approx((2 * 100 + 4 * 50) / (4 * 150))
        assert result.figures()["rl_slowdown"] == 0.0 and result.jobs_finished == 2


def test_a_loan_is_asked_back_before_the_announced_phase_so_rl_never_waits(tmp_path):
    result = simulate(LendingScheduler(4), 4, [sim_job()], [rl_run(tmp_path, notice=100.0)])
    # The job borrows 2 over 0-100, is asked at 90 (grace 10), saves 90 s of work by 95 and
    # leaves; the trainer gets all 4 at 100. RL: 2 x 0.5 x 100 + 4 x 100 busy; the job 2 x 90.
    assert result.rl_runs[0].waited_s == 0.0 and result.rl_slowdown == 0.0
    assert result.totals.busy_s == pytest.approx(100 + 400 + 180)
    assert result.totals.allocated_s == pytest.approx(2 * 100 + 4 * 100 + 2 * 95)
    assert result.totals.busy_utilization == pytest.approx(680 / 800)
    assert result.lost_fraction == pytest.approx(2 * 5 / (2 * 95))  # its 5 s of saving
    assert result.preemptions == 1 and result.kills == 0


def test_unannounced_demand_waits_for_the_grace_period_and_counts_as_slowdown(tmp_path):
    result = simulate(LendingScheduler(4), 4, [sim_job()], [rl_run(tmp_path, notice=0.0)])
    # Asked at 100 with deadline 110, it computes to 100, saves until 105: the trainer waits 5 s.
    assert result.rl_runs[0].waited_s == pytest.approx(5.0)
    assert result.rl_slowdown == pytest.approx(5.0 / 200.0)


def test_a_job_deaf_to_preemption_is_killed_at_the_deadline_and_loses_its_work(tmp_path):
    result = simulate(LendingScheduler(4), 4, [sim_job()], [rl_run(tmp_path, notice=100.0)],
                      ignores_preemption={"sim"})
    assert result.kills == 1 and result.rl_slowdown == 0.0
    assert result.totals.lost_s == pytest.approx(2 * 100.0)
    assert result.totals.busy_s == pytest.approx(100 + 400)


def test_the_static_baseline_keeps_the_rl_peak_reserved(tmp_path):
    result = simulate(StaticReservationScheduler(4, reserved=4), 4, [sim_job()], [rl_run(tmp_path, notice=100.0)])
    assert result.jobs_rejected == 1  # 2 accelerators outside a 4-accelerator reservation: none
    assert result.totals.busy_s == pytest.approx(100 + 400)


def test_a_job_that_released_early_once_computes_until_rl_starts_the_next_time(tmp_path):
    spec = read_rl_phases(write(tmp_path, "rl.toml", (
        'roles.trainer = { guaranteed = 4, priority = 1 }\n'
        'phases = [{ name = "wait", duration_s = 100.0, notice_s = 100.0, demand = { trainer = 2 } },\n'
        '  { name = "train", duration_s = 100.0, notice_s = 100.0, demand = { trainer = 4 } },\n'
        '  { name = "wait", duration_s = 100.0, notice_s = 100.0, demand = { trainer = 2 } },\n'
        '  { name = "train", duration_s = 100.0, demand = { trainer = 4 } }]\n')))
    job = sim_job(duration=1000.0)
    without = simulate(LendingScheduler(4, rl_wait_budget=0.0), 4, [job], [spec])
    within = simulate(LendingScheduler(4), 4, [job], [spec])
    # Asked to leave, it starts saving 10 s before its deadline and releases 5 s before it (its
    # margin). Without slack it leaves at 95 and 295; having seen that, the policy gives it until
    # 305 the second time, so it computes 5 s longer and leaves at 300, as the trainer starts.
    assert without.rl_slowdown == within.rl_slowdown == 0.0
    assert within.totals.busy_s - without.totals.busy_s == pytest.approx(2 * 5.0)


@pytest.mark.parametrize("budget", [0.0, 0.02], ids=["no-rl-slack", "rl-slack"])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_with_every_grace_within_the_notice_backfill_never_delays_rl(tmp_path, seed, budget):
    rng = random.Random(seed)
    phases = ",\n".join(
        f'{{ name = "p{i}", duration_s = {rng.randint(50, 900)}.0, notice_s = 300.0, '
        f'demand = {{ trainer = {rng.choice([0, 4, 8, 16])}, decode = {rng.choice([0, 2, 8])} }} }}'
        for i in range(30))
    spec = read_rl_phases(write(tmp_path, "rl.toml", (
        'roles.trainer = { guaranteed = 16, priority = 1 }\n'
        'roles.decode = { guaranteed = 8, elastic_limit = 4 }\n'
        f"phases = [\n{phases}]\n")))
    jobs = [TraceJob(submit_s=rng.uniform(0, 5000), duration_s=(d := rng.uniform(30, 3000)), job=SimJob(
        job_id=str(i), accelerators=rng.choice([1, 2, 4, 8]), expected_duration_s=d * rng.uniform(1, 2),
        grace_s=rng.uniform(0, 300), checkpoint_s=rng.choice([None, 5.0]),
        checkpoint_interval_s=rng.choice([0.0, 600.0]), restart_cost_s=rng.uniform(0, 60))) for i in range(120)]
    result = simulate(LendingScheduler(32, rl_wait_budget=budget), 32, jobs, [spec])
    # Slack only ever meets jobs that release that early: on this mixed fleet RL still never waits.
    assert result.rl_runs[0].waited_s == 0.0
    assert result.preemptions > 0  # lending happened, and was taken back in time


# --- the CLI -----------------------------------------------------------------------------------

def test_sched_simulate_on_the_shipped_trace_prints_figures_and_writes_the_plot(tmp_path, capsys):
    plot = tmp_path / "utilization.png"
    code = main(["sched", "simulate", str(TRACES / "scheduler_mix.swf"), "--rl", str(TRACES / "scheduler_mix_rl.toml"),
                 "--plot", str(plot)])
    out = capsys.readouterr().out
    assert code == 0
    figures = json.loads(out.strip().splitlines()[-1])
    assert set(figures) == {"busy_utilization", "allocated_utilization", "rl_slowdown", "lost_fraction"}
    assert 0 < figures["busy_utilization"] <= figures["allocated_utilization"] <= 1
    assert "busy utilization" in out
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sched_simulate_replays_a_csv_alone_and_refuses_a_bad_trace(tmp_path, capsys):
    jobs = write(tmp_path, "jobs.csv", CSV_HEADER + "a,0,2,100,,60,0,,30\n")
    assert main(["sched", "simulate", str(jobs), "--accelerators", "4", "--plot", str(tmp_path / "p.png")]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["busy_utilization"] == 0.5
    bad = write(tmp_path, "bad.swf", SWF_HEADER + "1 2 3\n")
    assert main(["sched", "simulate", str(bad)]) == 2
    assert "bad.swf:4" in capsys.readouterr().err


def test_lending_a_roles_memory_costs_rl_its_release_then_its_resume(tmp_path):
    # Two roles take turns on 4 accelerators: the prefill phase's 4 go to the trainer at 100.
    spec = read_rl_phases(write(tmp_path, "swap.toml", (
        'roles.prefill = { guaranteed = 2 }\nroles.trainer = { guaranteed = 2 }\n'
        'phases = [{ name = "gen", duration_s = 100.0, demand = { prefill = 2 } },\n'
        '  { name = "train", duration_s = 100.0, demand = { trainer = 2 } }]\n')))
    free = simulate(LendingScheduler(4), 4, [], [spec])
    assert free.rl_runs[0].makespan_s == pytest.approx(200.0)
    costly = simulate(LendingScheduler(4), 4, [], [spec], role_release_s=5.0, role_resume_s=3.0)
    # Resume before the first phase (3 s); at the change, prefill releases (5 s), then the
    # trainer is granted and resumes (3 s): 11 s of waiting, the accelerators held idle.
    assert costly.rl_runs[0].waited_s == pytest.approx(11.0)
    assert costly.rl_runs[0].makespan_s == pytest.approx(211.0)
    assert costly.totals.busy_s == pytest.approx(free.totals.busy_s)
    assert costly.totals.allocated_s > free.totals.allocated_s
