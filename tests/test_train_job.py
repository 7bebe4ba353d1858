"""``rollmesh train`` run for real, as a user runs it (a subprocess that starts its own mesh): an RL
stage on a JSONL dataset with built-in and import-path rewards, a job SIGKILLed with its whole
process group and resumed without skipping or repeating a prompt, and run files refused before
anything starts."""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rollmesh.training.prompt_ids import parse_group_id

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

ROLLMESH = [sys.executable, "-m", "rollmesh.cli"]
JOB_TIMEOUT_S = 400.0  # a guard against a hang, never a timing assertion
LINE_KEYS = ("stage", "kind", "step", "reward", "loss", "tokens_per_s", "trainer_idle_pct")

# An import-path reward returning named scores; its module lives in the test's directory, on the
# job's PYTHONPATH (Ray's workers inherit it), as a user's own package would be installed.
REWARD_MODULE = '''
def answered(sample):
    """1 for any non-empty final answer; the length as a second named score."""
    return {"reward": 1.0 if sample.final_text.strip() else 0.0, "chars": float(len(sample.final_text))}
'''


def write_job(tmp_path: Path, *, rows: int, stop: str, extra_rewards: str = "", namespace: str,
              before: str = "") -> Path:
    data = tmp_path / "arith.jsonl"
    data.write_text("".join(json.dumps({"question": f"What is {i} + {i % 5}?", "solution": str(i + i % 5)}) + "\n"
                            for i in range(rows)))
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": f"What is {i} + 1?"}, {"role": "assistant", "content": str(i + 1)}]}) + "\n"
        for i in range(rows)))
    run_file = tmp_path / "run.toml"
    run_file.write_text(f'''
namespace = "{namespace}"
[trainer]
groups_per_step = 2
n_samples_per_prompt = 2
[serve]
enabled = false
# Short timers (as the suite's other meshes have): a killed job's un-acked requests come back in
# seconds, not the default minute.
[nats]
rollout_ack_wait_s = 6.0
{before}
[[stages]]
kind = "rl"
data = "arith.jsonl"
fields = {{prompt = "question", answer = "solution"}}
{stop}
max_groups_ahead = 2
sampling = {{temperature = 1.0, max_new_tokens = 6}}
[[stages.rewards]]
name = "math"
{extra_rewards}
''')
    return run_file


def job_env(tmp_path: Path) -> dict[str, str]:
    (tmp_path / "job_rewards.py").write_text(REWARD_MODULE)
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))}


def ledger_groups(run_dir: Path) -> collections.Counter[str]:
    groups: collections.Counter[str] = collections.Counter()
    for line in (run_dir / "trainer" / "ledger.jsonl").read_text().splitlines():
        try:
            groups.update(json.loads(line).get("groups", []))
        except ValueError:
            continue  # torn by the kill
    return groups


def test_an_sft_then_rl_job_killed_mid_rl_resumes_trains_every_prompt_once_and_leaves_its_results(tmp_path):
    rows = 16  # one epoch: 8 steps of 2 groups
    # A supervised warm start first, with its own lr: the trainer is restarted between the stages.
    run_file = write_job(tmp_path, rows=rows, stop="epochs = 1", namespace="trainjob", before='''
[[stages]]
kind = "sft"
data = "chat.jsonl"
steps = 2
batch_tokens = 64
trainer = {lr = 1e-3}
''', extra_rewards='''
[[stages.rewards]]
fn = "job_rewards:answered"
weight = 0.5
''')
    run_dir, env = tmp_path / "run", job_env(tmp_path)
    with open(tmp_path / "first.log", "w") as log:
        first = subprocess.Popen([*ROLLMESH, "train", str(run_file), "--run-dir", str(run_dir)], stdout=log,
                                 stderr=subprocess.STDOUT, cwd=tmp_path, env=env, start_new_session=True)
    steps_file = run_dir / "train" / "steps.jsonl"
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while not (steps_file.exists() and steps_file.read_text().count('"kind": "rl"') >= 2):
        assert first.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
        assert time.monotonic() < deadline, "the job made no two rl steps"
        time.sleep(0.2)  # polling a file another process writes; bounded by the deadline
    os.killpg(first.pid, signal.SIGKILL)  # the job, its NATS server and its Ray, mid-stage
    first.wait()

    # Stopped again by SIGTERM once it is back: the mesh it started is stopped with it (exit 130).
    with open(tmp_path / "second.log", "w") as log:
        second = subprocess.Popen([*ROLLMESH, "train", "--resume", str(run_dir)], stdout=log,
                                  stderr=subprocess.STDOUT, cwd=tmp_path, env=env, start_new_session=True)
    while "mesh up" not in (tmp_path / "second.log").read_text():  # (mesh.json: the killed one's is there)
        assert second.poll() is None, (tmp_path / "second.log").read_text()[-3000:]
        assert time.monotonic() < deadline + JOB_TIMEOUT_S, "the resumed job started no mesh"
        time.sleep(0.2)  # polling a file another process writes; bounded by the deadline
    second.send_signal(signal.SIGTERM)
    assert second.wait(timeout=JOB_TIMEOUT_S) == 130, (tmp_path / "second.log").read_text()[-3000:]
    assert not (run_dir / "mesh.json").exists()  # the mesh was stopped, not left behind
    assert subprocess.run(["pgrep", "-g", str(second.pid)], capture_output=True).returncode == 1  # nothing left

    resumed = subprocess.run([*ROLLMESH, "train", "--resume", str(run_dir)], capture_output=True, text=True,
                             timeout=JOB_TIMEOUT_S, cwd=tmp_path, env=env)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    refs = [parse_group_id(group) for group in ledger_groups(run_dir).elements()]
    sft = [ref for ref in refs if ref.stage == "sft"]
    refs = [ref for ref in refs if ref.stage != "sft"]
    assert sft and all(ref.epoch == 0 for ref in sft)  # the warm start's examples, by row
    assert all(ref is not None and (ref.stage, ref.epoch) == ("rl", 0) for ref in refs)
    consumed = collections.Counter(ref.index for ref in refs)
    assert sorted(consumed) == list(range(rows))  # none skipped
    assert max(consumed.values()) == 1  # none repeated

    # Not a terminal: one key=value line per step, with exactly the keys users' scripts read.
    lines = [line for line in resumed.stdout.splitlines() if line.startswith("stage=")]
    assert lines and [dict(pair.split("=", 1) for pair in line.split())["step"] for line in lines][-1] == "8"
    for line in lines:
        fields = dict(pair.split("=", 1) for pair in line.split())
        assert tuple(fields) == LINE_KEYS and fields["kind"] == "rl"
    summary = json.loads((run_dir / "summary.json").read_text())
    for key in ("first_window_reward", "last_window_reward", "eval_reward_first", "eval_reward_last",
                "steps", "rollouts", "weight_versions", "stages"):
        assert key in summary
    warm, stage = summary["stages"]
    assert (warm["name"], warm["kind"], warm["steps"]) == ("sft", "sft", 2) and warm["last"]["reward"] is None
    assert warm["last"]["loss"] < warm["first"]["loss"] or warm["first"]["loss"] > 0
    assert (stage["name"], stage["kind"]) == ("rl", "rl") and stage["steps"] == summary["steps"] <= 8
    # Each named reward is its own metric: the built-in's and the import path's (with its parts),
    # on every step that recorded rollouts. (A step's record tallies the rollouts completed since
    # the previous one: a last step whose rollouts all completed earlier records none.)
    records = [json.loads(line) for line in (run_dir / "train" / "steps.jsonl").read_text().splitlines()]
    tallied = [record["rewards"] for record in records if record["kind"] == "rl" and record["rollouts"]]
    assert tallied and all({"math", "answered", "answered/chars"} <= set(rewards) for rewards in tallied)
    final = Path(summary["final_model"])
    assert final == run_dir / "final_model"
    assert {"config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors.index.json"} <= {
        path.name for path in final.iterdir()}


def test_a_job_attaches_to_a_running_mesh_which_outlives_it(tmp_path):
    run_file = write_job(tmp_path, rows=8, stop="steps = 1", namespace="trainattach")
    run_dir, env = tmp_path / "mesh", job_env(tmp_path)
    # The run file is an ordinary config: the mesh starts with its trainer and rollout settings.
    up = subprocess.run([*ROLLMESH, "--config", str(run_file), "up", "--run-dir", str(run_dir), "--timeout", "240"],
                        capture_output=True, text=True, timeout=JOB_TIMEOUT_S, cwd=tmp_path, env=env)
    assert up.returncode == 0, up.stdout + up.stderr
    try:
        job = subprocess.run([*ROLLMESH, "train", str(run_file), "--run-dir", str(run_dir)], capture_output=True,
                             text=True, timeout=JOB_TIMEOUT_S, cwd=tmp_path, env=env)
        assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]
        assert "mesh up" not in job.stdout  # attached: it started no mesh of its own
        assert json.loads((run_dir / "summary.json").read_text())["steps"] == 1
        assert (run_dir / "mesh.json").exists()  # the mesh outlives the job

        # A run directory holds one job: another is refused (resume this one, or go elsewhere).
        again = subprocess.run([*ROLLMESH, "train", str(run_file), "--run-dir", str(run_dir)], capture_output=True,
                               text=True, timeout=120, cwd=tmp_path, env=env)
        assert again.returncode == 2 and "already holds a training job" in again.stderr, again.stderr[-2000:]
    finally:
        down = subprocess.run([*ROLLMESH, "down", "--run-dir", str(run_dir), "--timeout", "60"],
                              capture_output=True, text=True, timeout=180, cwd=tmp_path, env=env)
    assert down.returncode == 0, down.stdout + down.stderr


@pytest.mark.parametrize(("stage", "message"), [
    ('kind = "rl"\ndata = "nowhere.jsonl"\nsteps = 1\n[[stages.rewards]]\nname = "math"', "nowhere.jsonl: no such file"),
    ('kind = "rl"\ndata = "arith.jsonl"\nsteps = 1\n[[stages.rewards]]\nfn = "no_such_pkg_q:f"', "no_such_pkg_q"),
    ('kind = "pretrain"\ndata = "arith.jsonl"\nsteps = 1', "pretrain"),
    ('kind = "rl"\ndata = "arith.jsonl"\n[[stages.rewards]]\nname = "math"', "exactly one of steps, epochs or tokens"),
])
def test_a_bad_run_file_is_a_usage_error_before_any_mesh_starts(tmp_path, stage, message):
    (tmp_path / "arith.jsonl").write_text('{"prompt": "1+1?", "answer": "2"}\n')
    run_file = tmp_path / "bad.toml"
    run_file.write_text(f"[[stages]]\n{stage}\n")
    job = subprocess.run([*ROLLMESH, "train", str(run_file), "--run-dir", str(tmp_path / "run")],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert job.returncode == 2, job.stdout + job.stderr
    assert message in job.stderr
    assert not (tmp_path / "run" / "config.json").exists()  # nothing started
