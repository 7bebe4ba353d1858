"""The `rollmesh` command's parsing, help, exit codes and the logic behind its options.

No NATS and no Ray here; see test_cli_bus.py (real nats-server) and test_cli_processes.py
(up/down against stand-in processes).
"""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest

from rollmesh.cli import build_parser, main
from rollmesh.cli.demo import DEMO_SIZES, demo_overrides
from rollmesh.cli.events import weight_versions
from rollmesh.cli.mesh import child_command
from rollmesh.cli.submit import parse_request_lines, sample_requests
from rollmesh.config import load_config
from rollmesh.demo.run_file import demo_job_config
from rollmesh.rollout.molar_mass import is_held_out

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


@pytest.fixture(autouse=True)
def restore_logging_config():
    """``main`` sets up structlog once per process, as a CLI should; in the test process that
    must not leak into the tests that come after (they set it up themselves, at their level)."""
    import structlog

    import rollmesh.telemetry.logging as logging_setup

    saved, configured = structlog.get_config(), logging_setup._configured
    yield
    structlog.configure(**saved)
    logging_setup._configured = configured

COMMANDS = ["up", "down", "submit", "watch", "demo"]


@pytest.mark.parametrize("command", [[], *[[name] for name in COMMANDS]], ids=["rollmesh", *COMMANDS])
def test_help_exits_zero_for_the_command_and_every_subcommand(command, capsys):
    assert main([*command, "--help"]) == 0
    assert f"usage: rollmesh {' '.join(command)}".strip() in capsys.readouterr().out


def test_installed_entry_point_answers_help():
    rollmesh = Path(sys.executable).parent / "rollmesh"
    if not rollmesh.exists():
        pytest.skip("the project is not installed in this environment")
    done = subprocess.run([str(rollmesh), "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0
    for command in COMMANDS:
        assert command in done.stdout


@pytest.mark.parametrize("argv", [
    [],
    ["launch"],
    ["submit"],                                       # --file or --task is required
    ["submit", "--file", "x.jsonl", "--task", "molar_mass"],
    ["submit", "--task", "molar_mass", "--count", "0"],
    ["watch", "--namespace", "not.a.token"],
    ["submit", "--task", "molar_mass", "--run-dir", "d", "--nats-url", "nats://x:1"],
], ids=["no-command", "unknown-command", "no-source", "two-sources", "zero-count", "bad-namespace",
        "run-dir-and-url"])
def test_usage_errors_exit_2(argv, capsys):
    assert main(argv) == 2
    assert "usage:" in capsys.readouterr().err


def test_global_options_are_accepted_before_and_after_the_subcommand():
    parser = build_parser()
    before = parser.parse_args(["--config", "a.toml", "--run-root", "runs", "watch"])
    after = parser.parse_args(["watch", "--config", "a.toml", "--run-root", "runs", "--debug"])
    assert before.config == after.config == Path("a.toml")
    assert before.run_root == after.run_root == Path("runs")
    assert (before.debug, after.debug) == (False, True)


def test_a_missing_mesh_is_one_line_and_exit_1(tmp_path, capsys):
    assert main(["--run-root", str(tmp_path / "runs"), "watch"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("rollmesh: error: no runs under")
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_a_bad_config_file_is_a_usage_error(tmp_path, capsys):
    config = tmp_path / "bad.toml"
    config.write_text("[trainer]\nlearning_rate = 1\n")  # unknown field: configs forbid them
    assert main(["--config", str(config), "submit", "--task", "molar_mass", "--nats-url", "nats://127.0.0.1:1"]) == 2
    assert "bad config" in capsys.readouterr().err


def test_up_spawns_a_foreground_child_for_the_run_dir_it_chose(tmp_path):
    args = build_parser().parse_args(["--config", "deploy/security.toml", "up", "--no-serve",
                                      "--namespace", "ns1", "--ray-address", "auto"])
    command = child_command(args, tmp_path / "run")
    assert command[:3] == [sys.executable, "-m", "rollmesh.cli"]
    assert command[command.index("--config") + 1] == str(Path("deploy/security.toml").resolve())
    tail = command[command.index("up"):]
    assert tail[:4] == ["up", "--foreground", "--run-dir", str((tmp_path / "run").resolve())]
    assert {"--no-serve"} <= set(tail)
    assert tail[tail.index("--namespace") + 1] == "ns1"
    assert tail[tail.index("--ray-address") + 1] == "auto"
    assert "--nats-url" not in tail
    # The child parses what the parent wrote.
    child_args = build_parser().parse_args(command[3:])
    assert child_args.foreground and child_args.no_serve and child_args.namespace == "ns1"


def test_demo_options_size_the_demo_run_file(tmp_path):
    args = build_parser().parse_args(["demo", "--rl-steps", "3", "--sft-steps", "0", "--eval-every", "2",
                                      "--eval-size", "4", "--groups-per-step", "2", "--n-samples-per-prompt", "4",
                                      "--no-serve"])
    config = load_config(overrides={k: v for k, v in demo_overrides(args).items() if v is not None},
                         environ={})
    assert (config.trainer.groups_per_step, config.trainer.n_samples_per_prompt) == (2, 4)
    assert config.serve.enabled is False
    # The sizes go into the demo's run file: no warm start (0 steps), 3 RL steps, its evaluation.
    job = demo_job_config(config, tmp_path, **{size: getattr(args, size) for size in DEMO_SIZES})
    assert [(stage.kind, stage.steps) for stage in job.stages] == [("rl", 3)]
    assert (job.eval[0].eval_every, job.eval[0].size) == (2, 4)
    with_warm_start = demo_job_config(config, tmp_path, rl_steps=3, sft_steps=5)
    warm = with_warm_start.stages[0]
    assert (warm.kind, warm.steps) == ("sft", 5)
    assert len(Path(warm.data).read_text().splitlines()) == 5 * 64  # its demonstrations, written


def test_request_lines_are_decoded_with_line_numbers_for_the_bad_ones():
    lines = [
        '{"rollout_id": "a", "task": "molar_mass", "task_input": {"formula": "H2O"}}',
        "",
        "{not json",
        '{"rollout_id": 5, "task": "molar_mass"}',
        '{"rollout_id": "a", "task": "molar_mass"}',
        '{"rollout_id": "b", "task": "molar_mass", "max_turns": 0}',
        '{"rollout_id": "c", "task": "molar_mass", "purpose": "eval"}',
    ]
    parsed = parse_request_lines(lines)
    assert [r.rollout_id for r in parsed.requests] == ["a", "c"]
    assert [number for number, _ in parsed.bad_lines] == [3, 4, 5, 6]
    reasons = dict(parsed.bad_lines)
    assert "$.rollout_id" in reasons[4]
    assert "repeats line 1" in reasons[5]
    assert "$.max_turns" in reasons[6]


def test_sampled_requests_share_one_input_per_group_and_respect_held_out():
    config = load_config(environ={})
    args = build_parser().parse_args(["submit", "--task", "molar_mass", "--count", "5", "--n-samples-per-prompt", "2",
                                      "--seed", "3", "--held-out", "--purpose", "eval"])
    requests = sample_requests(args, config)
    assert len({r.rollout_id for r in requests}) == 5
    groups = [r.group_id for r in requests]
    assert groups[0] == groups[1] != groups[2] == groups[3] != groups[4]
    assert requests[0].task_input == requests[1].task_input
    assert all(r.task == "molar_mass" and r.purpose == "eval" for r in requests)
    assert all(is_held_out(r.task_input["formula"]) for r in requests)
    again = sample_requests(args, config)  # the seed fixes the inputs, not the ids
    assert [r.task_input for r in again] == [r.task_input for r in requests]
    assert again[0].rollout_id != requests[0].rollout_id


def test_an_unknown_task_is_a_usage_error(capsys):
    assert main(["submit", "--task", "no_such_task", "--nats-url", "nats://127.0.0.1:1"]) == 2
    assert "unknown task 'no_such_task'" in capsys.readouterr().err


@pytest.mark.parametrize(("versions", "shown"), [
    ([], "-"),
    ([-1, -1], "-"),
    ([-1, 3, 3, -1, 3], "3"),
    ([-1, 2, 3, 4, -1, 4], "2-4"),
    ([1, 3, 4, 7], "1,3-4,7"),
])
def test_weight_versions_are_shown_as_ranges_without_prompt_tokens(versions, shown):
    assert weight_versions(versions) == shown


def test_weight_versions_ranges_cover_exactly_the_generated_versions():
    def expand(text: str) -> set[int]:
        found: set[int] = set()
        for part in [] if text == "-" else text.split(","):
            low, _, high = part.partition("-")
            found |= set(range(int(low), int(high or low) + 1))
        return found

    rng = random.Random(0)
    for _ in range(200):
        versions = [rng.randint(-1, 12) for _ in range(rng.randint(0, 20))]
        assert expand(weight_versions(versions)) == {v for v in versions if v >= 0}


def test_request_options_outside_the_contract_are_usage_errors(capsys):
    assert main(["submit", "--task", "molar_mass", "--temperature", "50", "--nats-url", "nats://127.0.0.1:1"]) == 2
    assert "$.sampling.temperature" in capsys.readouterr().err


def test_up_and_serve_take_a_model_directory_as_model_path(demo_model_dir, tmp_path, monkeypatch):
    from rollmesh.cli.mesh import _up_overrides
    from rollmesh.cli.target import load_cli_config

    monkeypatch.chdir(demo_model_dir.parent)  # a relative DIR is made absolute
    up = build_parser().parse_args(["up", "--model", demo_model_dir.name])
    assert up.model == str(demo_model_dir)
    command = child_command(up, tmp_path / "run")
    assert command[command.index("--model") + 1] == str(demo_model_dir)
    config = load_cli_config(up, _up_overrides(up))
    assert config.model.path == str(demo_model_dir)  # wins over ROLLMESH_MODEL__PATH too

    serve = build_parser().parse_args(["serve", "--model", str(demo_model_dir)])
    assert serve.model == str(demo_model_dir)


@pytest.mark.parametrize("command", ["up", "serve"])
def test_a_model_that_is_no_model_directory_is_a_usage_error(command, tmp_path, capsys):
    assert main([command, "--model", str(tmp_path)]) == 2
    assert "is not a model directory (no config.json)" in capsys.readouterr().err


def test_resume_takes_no_model(demo_model_dir, tmp_path, capsys):
    assert main(["up", "--resume", str(tmp_path), "--model", str(demo_model_dir)]) == 2
    assert "--model" in capsys.readouterr().err
