"""Feeder resume: a `rollmesh train` RL stage SIGKILLed twice and resumed; is any prompt skipped or
trained twice?

The job: a 500-prompt arithmetic JSONL dataset generated here ({"prompt": "What is 3 + 4?",
"answer": "7"}), one `rl` stage over it (`epochs = 1`, shuffled, reward `exact_match`, at most 4
new tokens), the demo model (`model.path` unset), Serve off, 4 groups of 2 rollouts a step: 125
trainer steps. `python -m rollmesh.cli train RUN.toml --run-dir DIR` runs in its own session; at a
seeded random point (after a random number of lines, 10% to 80% of the stage's steps, appeared in
DIR/train/steps.jsonl, plus a random part of a step's time so the kill can land mid-step) the
whole process group is SIGKILLed (`os.killpg`), every process of the job is checked gone (the
process tree as it was just before the kill, the process group, and anything whose command line
names DIR: one survivor fails the benchmark), and `rollmesh train --resume DIR` continues it. The
second kill lands during the first resume; the second resume runs to the end.

Counting (``count_consumption``): a prompt is consumed when the trainer's ledger
(DIR/trainer/ledger.jsonl; a line per durable step, ``groups`` = the group ids it consumed, each
``<stage>/e<epoch>/i<index>``; torn lines ignored, as the trainer ignores them) records its dataset
index. ``skipped`` = epoch-0 indices never consumed; ``repeated`` = consumed index occurrences
beyond the first (over the stage's groups of every epoch, so a row read again in epoch 1 in place
of an epoch-0 row counts). ``ours`` = skipped + repeated. Target: both 0.

Baseline (``naive_resume_errors``): a resume that derives its data position from the trainer's
step count alone, as a driver without a durable cursor restarts: position N = S x groups_per_step,
S the stage's durable steps (the ledger's last step minus the stage's start step, from the cursor
file). It is computed at each kill of the same run, from the ledger and DIR/train/feeder.json
copied right after the kill, before resuming. Positions are places in the stage's reading order
(``EpochOrder``: epoch x rows + the row's place in that epoch's permutation). With C the positions
the ledger shows consumed (|C| = N: each step consumes groups_per_step groups; dynamic sampling is
off), the exact rule is:

- skipped: positions p < N not in C. They were published (everything below the cursor's
  next_position was, and next_position >= |C| = N) and still in flight at the kill; the naive
  resume reads on from N and never publishes them again, and their in-flight rollouts die with
  the job that held them (a driver without a cursor has no record of what is in flight);
- repeated: positions p >= N in C. They were trained before the kill (groups are consumed in
  completion order, not publish order, so some later positions finish before earlier ones), and
  the naive resume, reading every position from N to the stage's end, publishes them again.

Both are equal (k out-of-order completions give k of each) and zero when the trainer happened to
consume exactly positions 0..N-1. The rule assumes the naive driver keeps nothing else: in-flight
work dies with it, and what it publishes again gets fresh rollout ids, so it is trained again.
(On rollmesh's mesh the request queue outlives the job and rollout ids are derived from the
prompt, so the trainer's idempotency keys would absorb much of it; the baseline is the driver,
not this mesh with its cursor file removed, which restarts the stage from position 0.) Each
kill's figure is what a naive resume at that point would have got wrong; they are summed over the
kills. After the first kill the state is our resumed job's, and the resume itself reorders
completions for some steps (requests the killed rollout worker had taken come back only after
their ack wait), which a driver whose in-flight work died would not see.

Two kills are two samples of where completion order stood, so ``baseline_every_step`` applies the
same rule to every durable step of the finished run's ledger (each a state a kill could have
left, the reordered stretches after our resumes included): mean and max per kill point.

``ratio`` = (baseline + 1) / (ours + 1) (``ratio_definition`` in the JSON): both counts can be 0.

    python benchmarks/feeder_resume.py [--rows 500] [--kills 2] [--seed 21] [--keep]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from rollmesh.data.order import EpochOrder
from rollmesh.training.prompt_ids import parse_group_id

STAGE = "rl"
GROUPS_PER_STEP = 4
N_SAMPLES = 2
DATA_SEED = 7  # the stage's shuffle seed
KILL_WINDOW = (0.10, 0.80)  # kills land between these fractions of the stage's steps
# A job that writes no step line for this long is reported as hung (steps take seconds; a mesh
# start takes about a minute on 2 busy cores).
STALL_S = 600.0
SURVIVOR_GRACE_S = 30.0  # killed processes' exit is asynchronous: how long they may take to go


# --- plain helpers (tests/test_benchmark_feeder_resume.py) ---------------------------------------

def read_ledger_groups(path: Path) -> list[tuple[int, list[str]]]:
    """(step, group ids) of each durable ledger line; lines torn by a kill are skipped."""
    steps = []
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return steps
    for line in text.splitlines():
        try:
            entry = json.loads(line)
            steps.append((int(entry["step"]), list(entry.get("groups", []))))
        except (ValueError, TypeError, KeyError):
            continue
    return steps


def stage_refs(steps: list[tuple[int, list[str]]], stage: str = STAGE):
    """The stage's consumed prompts (PromptRef), in ledger order, repeats kept."""
    refs = []
    for _, groups in steps:
        for group_id in groups:
            ref = parse_group_id(group_id)
            if ref is not None and ref.stage == stage:
                refs.append(ref)
    return refs


@dataclass(frozen=True)
class Consumption:
    consumed: int  # group occurrences of the stage in the ledger
    distinct: int  # distinct dataset indices among them
    skipped: int  # epoch-0 indices never consumed
    repeated: int  # index occurrences beyond the first


def count_consumption(steps: list[tuple[int, list[str]]], num_rows: int, stage: str = STAGE) -> Consumption:
    refs = stage_refs(steps, stage)
    by_index = Counter(ref.index for ref in refs)
    epoch0 = {ref.index for ref in refs if ref.epoch == 0}
    return Consumption(consumed=len(refs), distinct=len(by_index),
                       skipped=sum(1 for index in range(num_rows) if index not in epoch0),
                       repeated=sum(count - 1 for count in by_index.values()))


def position_of(order: EpochOrder, epoch: int, index: int) -> int:
    """Where (epoch, index) comes in the stage's reading order."""
    if not order.shuffle:
        return epoch * order.num_rows + index
    permutation = order.permutation(epoch)
    return epoch * order.num_rows + int((permutation == index).nonzero()[0][0])


@dataclass(frozen=True)
class NaiveResume:
    steps: int  # the stage's durable steps at the kill
    naive_position: int  # steps x groups_per_step
    next_position: int  # the feeder cursor's
    consumed: int  # distinct positions the ledger shows consumed (= naive_position, as each step takes its groups)
    skipped: int
    repeated: int


def naive_resume_errors(steps: list[tuple[int, list[str]]], cursor: dict, order: EpochOrder,
                        groups_per_step: int, stage: str = STAGE) -> NaiveResume:
    """What a resume from position steps x groups_per_step would skip and repeat (module docstring)."""
    done = max((step for step, _ in steps), default=cursor["start_step"]) - cursor["start_step"]
    naive = done * groups_per_step
    consumed = {position_of(order, ref.epoch, ref.index) for ref in stage_refs(steps, stage)}
    return NaiveResume(steps=done, naive_position=naive, next_position=int(cursor["next_position"]),
                       consumed=len(consumed),
                       skipped=sum(1 for position in range(naive) if position not in consumed),
                       repeated=sum(1 for position in consumed if position >= naive))


def naive_errors_at_every_step(steps: list[tuple[int, list[str]]], start_step: int, order: EpochOrder,
                               groups_per_step: int, stage: str = STAGE) -> list[NaiveResume]:
    """The same rule at every durable step of a ledger: each is a state a kill could have left."""
    cursor = {"start_step": start_step, "next_position": -1}  # next_position: not known afterwards
    return [naive_resume_errors(steps[:count], cursor, order, groups_per_step, stage)
            for count in range(1, len(steps) + 1)]


def kill_points(rng: random.Random, total_steps: int, kills: int) -> list[int]:
    """``kills`` distinct step-line counts in the kill window, ascending."""
    low, high = (max(1, round(fraction * total_steps)) for fraction in KILL_WINDOW)
    return sorted(rng.sample(range(low, high + 1), kills))


def arithmetic_rows(count: int, seed: int) -> list[dict[str, str]]:
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        a, b, op = rng.randint(0, 20), rng.randint(0, 20), rng.choice("+-*")
        value = a + b if op == "+" else a - b if op == "-" else a * b
        rows.append({"prompt": f"What is {a} {op} {b}?", "answer": str(value)})
    return rows


RUN_FILE = """\
# benchmarks/feeder_resume.py: one RL stage over {rows} prompts, killed and resumed.
[serve]
enabled = false

[trainer]
groups_per_step = {groups_per_step}
n_samples_per_prompt = {n_samples}

[[stages]]
kind = "rl"
data = "{data}"
epochs = 1
shuffle = true
seed = {seed}
sampling = {{max_new_tokens = 4}}

[[stages.rewards]]
name = "exact_match"
"""


# --- the job ---------------------------------------------------------------------------------------

class JobFailed(RuntimeError):
    pass


def count_lines(path: Path) -> int:
    try:
        return path.read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


def start_job(args: list[str], log: Path) -> subprocess.Popen:
    with log.open("ab") as out:
        return subprocess.Popen([sys.executable, "-m", "rollmesh.cli", "train", *args], stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)


def log_tail(log: Path, lines: int = 40) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


def wait_for_lines(job: subprocess.Popen, steps_file: Path, target: int, log: Path) -> list[float]:
    """Until steps_file has ``target`` lines; returns the times new lines were seen."""
    seen, times, last_change = count_lines(steps_file), [], time.monotonic()
    while seen < target:
        if job.poll() is not None:
            raise JobFailed(f"the job exited ({job.returncode}) at {seen} step lines, before {target}:\n"
                            f"{log_tail(log)}")
        if time.monotonic() - last_change > STALL_S:
            raise JobFailed(f"no new step line for {STALL_S:.0f} s at {seen} lines (hung?):\n{log_tail(log)}")
        time.sleep(0.05)  # polling a file another process appends to
        now_seen = count_lines(steps_file)
        if now_seen != seen:
            seen, last_change = now_seen, time.monotonic()
            times.append(last_change)
    return times


def wait_for_exit(job: subprocess.Popen, steps_file: Path, log: Path) -> int:
    """The job's exit status; a job that writes no step line for STALL_S is reported hung."""
    seen, last_change = count_lines(steps_file), time.monotonic()
    while job.poll() is None:
        if time.monotonic() - last_change > STALL_S:
            raise JobFailed(f"no new step line for {STALL_S:.0f} s at {seen} lines and no exit (hung?):\n"
                            f"{log_tail(log)}")
        time.sleep(0.2)  # polling a file another process appends to
        if count_lines(steps_file) != seen:
            seen, last_change = count_lines(steps_file), time.monotonic()
    return job.returncode


def kill_job(job: subprocess.Popen, run_dir: Path) -> int:
    """SIGKILL the job's process group; fail when any process of it survives. The number killed."""
    import psutil

    pgid = os.getpgid(job.pid)
    root = psutil.Process(job.pid)
    tree = [root, *root.children(recursive=True)]
    os.killpg(pgid, signal.SIGKILL)
    job.wait()
    deadline = time.monotonic() + SURVIVOR_GRACE_S
    while True:
        survivors = {p.pid: p for p in tree if _alive(p)}
        for proc in psutil.process_iter(["pid", "cmdline"]):
            try:
                if proc.pid != os.getpid() and (os.getpgid(proc.pid) == pgid
                                                or str(run_dir) in " ".join(proc.info["cmdline"] or [])):
                    if _alive(proc):
                        survivors[proc.pid] = proc
            except (ProcessLookupError, psutil.Error):
                continue
        if not survivors or time.monotonic() > deadline:
            break
        time.sleep(0.2)  # reaping is the kernel's and init's, not ours to signal
    if survivors:
        described = [f"{pid} {_describe(proc)}" for pid, proc in survivors.items()]
        raise JobFailed(f"{len(survivors)} process(es) of the killed job survived SIGKILL of its group "
                        f"{SURVIVOR_GRACE_S:.0f} s later:\n" + "\n".join(described))
    return len(tree)


def _alive(proc) -> bool:
    import psutil

    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _describe(proc) -> str:
    try:
        return " ".join(proc.cmdline())[:200]
    except Exception:  # noqa: BLE001 - gone while described
        return "?"


def snapshot(run_dir: Path, into: Path) -> tuple[list[tuple[int, list[str]]], dict]:
    """The ledger and the feeder cursor as the kill left them, copied before anything resumes."""
    into.mkdir(parents=True)
    shutil.copy2(run_dir / "trainer" / "ledger.jsonl", into / "ledger.jsonl")
    shutil.copy2(run_dir / "train" / "feeder.json", into / "feeder.json")
    return read_ledger_groups(into / "ledger.jsonl"), json.loads((into / "feeder.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=500)
    parser.add_argument("--kills", type=int, default=2)
    parser.add_argument("--seed", type=int, default=21, help="the dataset's and the kill points'")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (kept anyway on failure)")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="rollmesh-feeder-resume-"))
    run_dir, steps_file = work / "run", work / "run" / "train" / "steps.jsonl"
    data = work / "prompts.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in arithmetic_rows(args.rows, args.seed)))
    run_file = work / "run.toml"
    run_file.write_text(RUN_FILE.format(rows=args.rows, groups_per_step=GROUPS_PER_STEP, n_samples=N_SAMPLES,
                                        data=data, seed=DATA_SEED))
    total_steps = -(-args.rows // GROUPS_PER_STEP)
    rng = random.Random(args.seed)
    points = kill_points(rng, total_steps, args.kills)
    order = EpochOrder(args.rows, shuffle=True, seed=DATA_SEED)
    print(f"work dir {work}; {total_steps} steps; kills after step lines {points}", flush=True)

    start = time.monotonic()
    kills, ok, job, lines = [], False, None, 0
    try:
        job = start_job([str(run_file), "--run-dir", str(run_dir)], work / "job-0.log")
        for number, point in enumerate(points, start=1):
            log = work / f"job-{number - 1}.log"
            # At least one step of this job's own: a kill during a resume, not during its start.
            times = wait_for_lines(job, steps_file, max(point, lines + 1), log)
            # A random part of a step's time, so a kill does not always land just after a step.
            interval = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else 1.0
            time.sleep(rng.uniform(0.0, interval))
            killed = kill_job(job, run_dir)
            lines = count_lines(steps_file)  # after the kill: a line may land while it is sent
            ledger, cursor = snapshot(run_dir, work / f"kill-{number}")
            naive = naive_resume_errors(ledger, cursor, order, GROUPS_PER_STEP)
            kills.append({"step_lines": lines, "processes_killed": killed, "durable_steps": naive.steps,
                          "naive_position": naive.naive_position, "consumed": naive.consumed,
                          "next_position": naive.next_position,
                          "outstanding": len(cursor["outstanding"]),
                          "naive_skipped": naive.skipped, "naive_repeated": naive.repeated})
            print(f"kill {number}: {json.dumps(kills[-1])}", flush=True)
            job = start_job(["--resume", str(run_dir)], work / f"job-{number}.log")
        log = work / f"job-{len(points)}.log"
        if wait_for_exit(job, steps_file, log) != 0:
            raise JobFailed(f"the last resume exited {job.returncode}:\n{log_tail(log)}")
        wall_s = time.monotonic() - start
        ledger = read_ledger_groups(run_dir / "trainer" / "ledger.jsonl")
        ours = count_consumption(ledger, args.rows)
        start_step = json.loads((run_dir / "train" / "feeder.json").read_text())["start_step"]
        every_step = naive_errors_at_every_step(ledger, start_step, order, GROUPS_PER_STEP)
        summary = json.loads((run_dir / "summary.json").read_text())
        ok = True
    finally:
        if job is not None and job.poll() is None:
            os.killpg(os.getpgid(job.pid), signal.SIGKILL)
            job.wait()
        if not ok or args.keep:
            print(f"work dir kept: {work} (logs: job-*.log, run/logs; copies at each kill: kill-*/)", flush=True)
        else:
            shutil.rmtree(work, ignore_errors=True)

    from common import print_result

    baseline_skipped = sum(kill["naive_skipped"] for kill in kills)
    baseline_repeated = sum(kill["naive_repeated"] for kill in kills)
    ours_errors, baseline = ours.skipped + ours.repeated, baseline_skipped + baseline_repeated
    print(f"consumed {ours.consumed} groups, {ours.distinct} distinct of {args.rows} rows; "
          f"summary steps {summary['steps']}; wall {wall_s:.0f} s", flush=True)
    print_result("feeder_resume", ours_errors, baseline, "prompts skipped or repeated",
                 (baseline + 1) / (ours_errors + 1),
                 ratio_definition="(baseline + 1) / (ours + 1)",
                 skipped=ours.skipped, repeated=ours.repeated, consumed=ours.consumed, distinct=ours.distinct,
                 rows=args.rows, kills=len(kills), wall_s=round(wall_s, 1),
                 baseline_skipped=baseline_skipped, baseline_repeated=baseline_repeated,
                 summary_steps=summary["steps"], kill_points=kills,
                 baseline_every_step={
                     "steps": len(every_step),
                     "mean_skipped": round(sum(n.skipped for n in every_step) / len(every_step), 3),
                     "mean_repeated": round(sum(n.repeated for n in every_step) / len(every_step), 3),
                     "max_skipped": max(n.skipped for n in every_step),
                     "max_repeated": max(n.repeated for n in every_step),
                     "steps_with_errors": sum(1 for n in every_step if n.skipped or n.repeated)})


if __name__ == "__main__":
    main()
