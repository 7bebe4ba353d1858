"""``rollmesh check-template MODEL_DIR``: whether a model's chat template keeps rollouts token-exact.

Knows argparse, rich and the chat package's ``template_check``, which runs the fixed conversations
through the rollout path's appender and gives each a verdict; this module only prints them: a
table, then one JSON line last on stdout. Exit codes: 0 no case is a bug, 1 some case is, 2 the
directory is not a readable model (one error line on stderr, no JSON). Needs no mesh.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from rollmesh.cli.errors import EXIT_FAILURE, EXIT_OK, EXIT_USAGE, CliError

_VERDICT_STYLE = {"exact": "green", "expected": "cyan", "bug": "bold red", "unsupported": "yellow"}


def register(subparsers: Any, common: argparse.ArgumentParser) -> None:
    check = subparsers.add_parser(
        "check-template", parents=[common], help="check that a model's chat template keeps rollouts token-exact",
        description="Run a fixed set of conversations (tool calls, parallel calls, tool errors, three turns, "
                    "reasoning on and off, arguments as a JSON string and as an object, with and without a "
                    "system prompt) through the rollout path's token-exact appender, the model's turns written "
                    "in its family's own format, and compare each with a whole render of the conversation. "
                    "Exit 0 when no case is a bug, 1 otherwise, 2 when MODEL_DIR is not a readable model.")
    # A string, not a Path: the JSON line names the directory as given.
    check.add_argument("model_dir", metavar="MODEL_DIR",
                       help="a Hugging Face model directory (tokenizer files with the chat template)")
    check.set_defaults(handler=run_check_template)


def run_check_template(args: argparse.Namespace) -> int:
    from rollmesh.chat.errors import ModelDirectoryError
    from rollmesh.chat.model_dir import ModelDirectory
    from rollmesh.chat.template_check import check_template

    try:
        chat = ModelDirectory.load(args.model_dir)
    except ModelDirectoryError as exc:
        raise CliError(f"not a readable model: {exc}", exit_code=EXIT_USAGE) from exc
    report = check_template(chat)
    _print_table(args.model_dir, report)
    print(json.dumps(report.summary(args.model_dir)), flush=True)
    return EXIT_FAILURE if report.bugs else EXIT_OK


def _print_table(model: str, report: Any) -> None:
    from rich.console import Console
    from rich.table import Table

    profile = report.profile
    table = Table(title=f"check-template {model}",
                  caption=f"tool parser {profile.tool_parser or 'none'}, reasoning parser "
                          f"{profile.reasoning_parser or 'none'}, family rules {profile.family or 'none'}, "
                          f"tool-call arguments as {profile.arguments_as}")
    table.add_column("case")
    table.add_column("tokens", justify="right")
    table.add_column("verdict")
    for kind in ("special", "non_assistant", "assistant"):
        table.add_column(kind, justify="right")
    table.add_column("why")
    for result in report.results:
        verdict = f"[{_VERDICT_STYLE[result.verdict]}]{result.verdict}[/]"
        table.add_row(result.case, str(result.tokens), verdict,
                      *(str(result.differences[kind]) for kind in ("special", "non_assistant", "assistant")),
                      result.note)
    # Off a terminal rich assumes 80 columns and would wrap cells; logs read better unwrapped.
    console = Console() if sys.stdout.isatty() else Console(width=200)
    console.print(table)
