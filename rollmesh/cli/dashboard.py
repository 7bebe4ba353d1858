"""``rollmesh dashboard``: print the URL of the running mesh's live dashboard.

Knows argparse and ``mesh.json`` (through ``cli.target``); never imports Ray or nats-py. The URL
is the one the mesh wrote when it deployed its Serve app (``dashboard_url``); a mesh started with
``--no-serve`` or ``dashboard.enabled = false`` has none, which is an error saying so.
"""

from __future__ import annotations

import argparse
from typing import Any

from rollmesh.cli.errors import EXIT_OK, CliError
from rollmesh.cli.target import add_target_options, load_cli_config, read_cli_mesh_address


def register(subparsers: Any, common: argparse.ArgumentParser) -> None:
    dashboard = subparsers.add_parser(
        "dashboard", parents=[common], help="print the URL of the mesh's live dashboard",
        description="Print the URL of the live dashboard (rollouts in flight, reward curve, weight "
                    "versions, sandbox pool, accelerator timeline, failures) that the mesh serves "
                    "on its Serve app's port, as written in its mesh.json.")
    add_target_options(dashboard, nats=False)
    dashboard.set_defaults(handler=run_dashboard)


def run_dashboard(args: argparse.Namespace) -> int:
    config = load_cli_config(args)
    info = read_cli_mesh_address(args, config)
    if not info.dashboard_url:
        raise CliError(f"the mesh in {info.run_dir} serves no dashboard (it was started with "
                       "--no-serve, serve.enabled = false or dashboard.enabled = false)")
    print(info.dashboard_url)
    return EXIT_OK
