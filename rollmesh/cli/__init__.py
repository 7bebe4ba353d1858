"""The ``rollmesh`` command: ``up``, ``down``, ``submit``, ``watch``, ``demo``, ``serve``, ``sandbox``,
``convert``, ``sched``, ``dashboard``, ``check-template``.

Knows argparse and the modules of this package, one per subcommand family, each of which registers its
own options and handler. Nothing heavy is imported until a handler needs it, so ``--help`` is
instant and ``submit``/``watch`` never import Ray. Exit codes: 0 ok, 1 failure, 2 usage error;
an error is one line on stderr (a traceback only with ``--debug``).
"""

from __future__ import annotations

import argparse
import sys
import traceback
from pathlib import Path

from rollmesh.cli import (
    check_template as cli_check_template,
    convert as cli_convert,
    dashboard as cli_dashboard,
    demo as cli_demo,
    mesh as cli_mesh,
    sandbox as cli_sandbox,
    sched as cli_sched,
    serve as cli_serve,
    submit as cli_submit,
    train as cli_train,
    watch as cli_watch,
)
from rollmesh.cli.errors import EXIT_FAILURE, EXIT_INTERRUPTED, EXIT_USAGE, CliError


def _add_global_options(parser: argparse.ArgumentParser, *, suppress: bool) -> None:
    # Accepted before and after the subcommand; after it, an option only overrides when given.
    def default(value: object) -> object:
        return argparse.SUPPRESS if suppress else value

    parser.add_argument("--config", type=Path, metavar="PATH", default=default(None),
                        help="TOML config (default: rollmesh/deploy_defaults/local.toml)")
    parser.add_argument("--run-root", type=Path, metavar="DIR", default=default(None),
                        help="where run directories live (default: config run_root, .rollmesh/runs)")
    parser.add_argument("--debug", action="store_true", default=default(False),
                        help="show tracebacks and info-level logs")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rollmesh",
        description="Asynchronous RL for tool-using LLM agents: a mesh of Ray actors over NATS.",
        epilog="Quickstart: rollmesh up; rollmesh submit --task molar_mass --count 8 --wait; "
               "rollmesh watch; rollmesh down. Or the whole demo: rollmesh demo.")
    _add_global_options(parser, suppress=False)
    common = argparse.ArgumentParser(add_help=False)
    _add_global_options(common, suppress=True)
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in (cli_mesh, cli_submit, cli_watch, cli_train, cli_demo, cli_serve, cli_sandbox, cli_convert, cli_sched,
                   cli_dashboard, cli_check_template):
        module.register(subparsers, common)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help (0) or a usage error (2)
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    _setup_logging(args)
    try:
        return args.handler(args)
    except KeyboardInterrupt:
        print("rollmesh: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except CliError as exc:
        if args.debug:
            traceback.print_exc()
        print(f"rollmesh: error: {exc.message}", file=sys.stderr)
        if exc.detail:
            print(exc.detail, file=sys.stderr)
        return exc.exit_code
    except Exception as exc:  # anything else still gets one line, not a traceback
        if args.debug:
            traceback.print_exc()
        print(f"rollmesh: error: {_one_line(exc)}", file=sys.stderr)
        return EXIT_FAILURE


def _setup_logging(args: argparse.Namespace) -> None:
    """Library logs stay quiet in a terminal; the detached mesh (``up --foreground``) logs at info
    level to its mesh.log."""
    from rollmesh.telemetry.logging import setup_logging

    level = "debug" if args.debug else "info" if getattr(args, "foreground", False) else "warning"
    setup_logging(f"rollmesh-{args.command}", level)


def _one_line(exc: BaseException) -> str:
    """``Type: message`` on one line; a wrapped cause is named when the message is empty."""
    text = " ".join(str(exc).split())
    if not text and exc.__cause__ is not None:
        text = _one_line(exc.__cause__)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__

