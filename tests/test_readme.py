"""The README does not lie: its first commands, its links, its CLI lines and its JSON example.

(The wire-contract table is checked against the code by test_schemas.py.)
"""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

import pytest

from rollmesh.cli import build_parser
from rollmesh.messages.subjects import ROLLOUT_REQUESTED

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

REPO_ROOT = Path(__file__).resolve().parent.parent
README = (REPO_ROOT / "README.md").read_text()


def code_blocks() -> list[str]:
    return re.findall(r"^```[a-z]*\n(.*?)^```", README, flags=re.DOTALL | re.MULTILINE)


def command_lines() -> list[str]:
    """Shell lines in code blocks, continuation lines joined, comments dropped."""
    lines = []
    for block in code_blocks():
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("  #")[0].strip()
            if line:
                lines.append(line)
    return lines


def test_the_first_two_commands_are_make_demo_then_make_test():
    # The same check the project's hooks run.
    found = [re.sub(r"^\s*(\$ )?", "", line) for line in README.splitlines()
             if re.match(r"^\s*(\$ )?make [a-z]+", line)]
    assert found[:2] == ["make demo", "make test"]


def test_every_make_target_it_names_exists():
    makefile = (REPO_ROOT / "Makefile").read_text()
    for target in set(re.findall(r"`?make ([a-z]+)`?", README)):
        assert re.search(rf"^{target}:", makefile, flags=re.MULTILINE), target


def test_every_rollmesh_command_it_shows_parses():
    parser = build_parser()
    shown = [line for line in command_lines() if line.startswith("rollmesh ")]
    assert len(shown) >= 5
    inline = re.findall(r"`(rollmesh (?:demo|submit|up|down|watch)[^`]*)`", README)
    for line in shown + [text for text in inline if "[" not in text and "..." not in text]:
        args = parser.parse_args(shlex.split(line)[1:])
        assert callable(args.handler), line


def test_the_quickstart_uses_up_submit_watch_down():
    shown = " ".join(command_lines())
    for command in ("rollmesh up", "rollmesh submit --task molar_mass --count 8 --wait", "rollmesh watch",
                    "rollmesh down"):
        assert command in shown


def test_every_relative_link_points_at_a_file():
    for target in re.findall(r"\]\(([^)#]+)\)", README):
        if "://" not in target:
            assert (REPO_ROOT / target).exists(), target


def test_the_json_request_example_is_a_valid_rollout_request():
    examples = [block for block in code_blocks() if block.lstrip().startswith("{")]
    assert examples
    for block in examples:
        request = ROLLOUT_REQUESTED.decode(block.encode())
        assert request.task == "molar_mass"
    for payload in re.findall(r"'(\{\"type\":\"rollout\.requested\".*?\})'", README):
        assert ROLLOUT_REQUESTED.decode(payload.encode()).rollout_id


def test_ci_runs_make_test():
    ci = REPO_ROOT / ".ci" / "run"
    assert os.access(ci, os.X_OK)
    text = ci.read_text()
    assert text.startswith("#!/usr/bin/env bash") and "set -euo pipefail" in text and "make test" in text
