"""``rollmesh up --metrics-port``: carried to the foreground child, checked, and into the config."""

from __future__ import annotations

import pytest

from rollmesh.cli import build_parser, main
from rollmesh.cli.mesh import _up_overrides, child_command
from rollmesh.cli.target import load_cli_config

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("port", ["0", "9500"])
def test_the_metrics_port_reaches_the_child_and_the_config(tmp_path, port):
    args = build_parser().parse_args(["up", "--no-serve", "--metrics-port", port])
    command = child_command(args, tmp_path / "run")
    tail = command[command.index("up"):]
    assert tail[tail.index("--metrics-port") + 1] == port  # 0 too: it means "any free port"
    child_args = build_parser().parse_args(command[3:])
    config = load_cli_config(child_args, _up_overrides(child_args))
    assert config.telemetry.metrics_port == int(port)


def test_without_the_flag_the_config_keeps_its_port(tmp_path):
    args = build_parser().parse_args(["up", "--no-serve"])
    assert "--metrics-port" not in child_command(args, tmp_path / "run")
    assert load_cli_config(args, _up_overrides(args)).telemetry.metrics_port == 9464


@pytest.mark.parametrize("port", ["-1", "65536", "http"])
def test_a_port_out_of_range_is_a_usage_error(port, capsys):
    assert main(["up", "--metrics-port", port]) == 2
    assert "--metrics-port" in capsys.readouterr().err
