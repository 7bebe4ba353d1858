"""The README's commands, run for real: the quickstart against a background mesh (with the shell
lines of docs/wire-contract.md that find its NATS URL), and the demo.

Each command runs as the user would run it (a ``rollmesh`` subprocess), so the README cannot
drift from what works. Both start their own mesh (NATS + Ray in a child process): the slowest
tests in the suite, kept smoke-sized.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

ROLLMESH = [sys.executable, "-m", "rollmesh.cli"]
REPO_ROOT = Path(__file__).resolve().parent.parent


def run(args: list[str], *, timeout: float, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*ROLLMESH, *args], capture_output=True, text=True, timeout=timeout, cwd=cwd)


def shell_lines(page: str, *variables: str) -> list[str]:
    """The console lines of a page that set these shell variables, comments dropped."""
    lines = (REPO_ROOT / page).read_text().splitlines()
    return [line.split("  #")[0] for line in lines if line.startswith(tuple(f"{v}=" for v in variables))]


def test_quickstart_up_submit_down(tmp_path: Path) -> None:
    # The default run root, under the working directory: the docs' lines and the bare client
    # find the run the way a user's shell would.
    run_root = tmp_path / ".rollmesh" / "runs"
    up = run(["--run-root", str(run_root), "up", "--no-serve", "--timeout", "180"], timeout=240, cwd=tmp_path)
    assert up.returncode == 0, up.stdout + up.stderr
    try:
        (run_dir,) = list(run_root.iterdir())
        mesh = json.loads((run_dir / "mesh.json").read_text())
        assert mesh["nats_url"].startswith("nats://127.0.0.1:")
        submit = run(["--run-root", str(run_root), "submit", "--task", "molar_mass", "--count", "8",
                      "--wait", "--timeout", "120"], timeout=180, cwd=tmp_path)
        assert submit.returncode == 0, submit.stdout + submit.stderr
        assert submit.stdout.count("completed") >= 8
        # How the docs get the NATS URL, and the bare client's default: the latest run's mesh.json.
        shown = shell_lines("docs/wire-contract.md", "RUN", "NATS_URL")
        assert len(shown) == 2
        url = subprocess.run(["bash", "-c", "\n".join([*shown, 'echo "$NATS_URL"'])], capture_output=True,
                             text=True, timeout=60, cwd=tmp_path)
        assert url.stdout.strip() == mesh["nats_url"], url.stderr
        env = {key: value for key, value in os.environ.items() if key != "ROLLMESH_RUN_ROOT"}
        bare = subprocess.run([sys.executable, str(REPO_ROOT / "examples" / "bare_nats_client.py"),
                               "--timeout", "120"], capture_output=True, text=True, timeout=180,
                              cwd=tmp_path, env=env)
        assert bare.returncode == 0, bare.stdout + bare.stderr
        assert "completed bare-" in bare.stdout
    finally:
        down = run(["--run-root", str(run_root), "down", "--timeout", "60"], timeout=120, cwd=tmp_path)
    assert down.returncode == 0, down.stdout + down.stderr
    assert not (run_dir / "mesh.json").exists()


def test_smoke_sized_demo_writes_summary_and_curve(tmp_path: Path) -> None:
    run_dir = tmp_path / "demo-run"
    demo = run(["demo", "--run-dir", str(run_dir), "--rl-steps", "3", "--sft-steps", "10",
                "--eval-every", "2", "--eval-size", "8", "--groups-per-step", "2", "--n-samples-per-prompt", "4",
                "--no-serve"], timeout=400, cwd=tmp_path)
    assert demo.returncode == 0, demo.stdout[-3000:] + demo.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    for key in ("first_window_reward", "last_window_reward", "eval_reward_first", "eval_reward_last"):
        assert 0.0 <= summary[key] <= 1.0
    assert summary["steps"] == 3
    assert summary["rollouts"] >= 3 * 2 * 4
    # The warm start publishes one version; an RL step publishes one only when some group's
    # rewards differ (ten supervised steps rarely give the model a right answer).
    assert summary["weight_versions"] >= 1
    assert len(summary["reward_per_step"]) == 3
    assert (run_dir / "reward_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert Path(summary["final_model"], "model.safetensors.index.json").exists()
    # The demo is a training job: its warm start an sft stage, its RL an rl stage, its evals [[eval]].
    assert [(stage["name"], stage["kind"], stage["steps"]) for stage in summary["stages"]] == [
        ("warm_start", "sft", 10), ("rl", "rl", 3)]
    assert "stage=rl kind=rl step=3 " in demo.stdout
    assert [entry["step"] for entry in summary["evaluations"]] == sorted(entry["step"] for entry in summary["evaluations"])
    assert len(summary["evaluations"]) >= 2  # before training, every 2 steps, at the end
