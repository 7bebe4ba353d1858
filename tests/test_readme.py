"""The README and docs/ do not lie: the README's first commands and length, every CLI line they
show, their links and anchors, the repository paths they name, the JSON request examples, and
the mesh picture.

(The wire-contract table in docs/wire-contract.md is checked against the code by test_schemas.py;
the synopses of commands by test_docs_cli_synopses.py.)
"""

from __future__ import annotations

import glob
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from rollmesh.cli import build_parser
from rollmesh.messages.subjects import ROLLOUT_REQUESTED

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

REPO_ROOT = Path(__file__).resolve().parent.parent
README_PATH = REPO_ROOT / "README.md"
README = README_PATH.read_text()
DOCS = [README_PATH, *sorted((REPO_ROOT / "docs").glob("*.md")), REPO_ROOT / "benchmarks" / "README.md"]
README_MAX_LINES = 200  # issue 24: the README is a front door; the reference lives in docs/
FENCE = re.compile(r"^```[a-z]*\n(.*?)^```", flags=re.DOTALL | re.MULTILINE)
# Paths of the repository a page may name in prose: checked to exist (globs: to match something).
REPO_PATH = re.compile(r"(?<![\w./<>-])((?:rollmesh|tests|examples|scripts|deploy|benchmarks|docs)/[\w./*-]*[\w/*])")


def name_of(doc: Path) -> str:
    return str(doc.relative_to(REPO_ROOT))


def code_blocks(text: str) -> list[str]:
    return FENCE.findall(text)


def prose(text: str) -> str:
    """The page without its fenced code blocks (where commands may name files they create)."""
    return FENCE.sub("", text)


def prose_paths(text: str) -> list[str]:
    """Repository paths the prose names, commands in inline code left out (their arguments may be
    files the command creates)."""
    without_commands = re.sub(r"`(?:python3?|rollmesh|make|bash) [^`]*`", "", prose(text))
    return REPO_PATH.findall(without_commands)


def command_lines(text: str) -> list[str]:
    """Shell lines in code blocks, continuation lines joined, comments and prompts dropped."""
    lines = []
    for block in code_blocks(text):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("  #")[0].strip().removeprefix("$ ")
            if line:
                lines.append(line)
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(doc: Path) -> set[str]:
    seen: dict[str, int] = {}
    found = set()
    for heading in re.findall(r"^#{1,6} (.+)$", prose(doc.read_text()), flags=re.MULTILINE):
        base = slug(heading)
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def test_the_first_two_commands_are_make_demo_then_make_test():
    # The same check the project's hooks run.
    found = [re.sub(r"^\s*(\$ )?", "", line) for line in README.splitlines()
             if re.match(r"^\s*(\$ )?make [a-z]+", line)]
    assert found[:2] == ["make demo", "make test"]


def test_the_readme_is_a_front_door_of_at_most_200_lines():
    assert len(README.splitlines()) <= README_MAX_LINES


def test_every_make_target_it_names_exists():
    makefile = (REPO_ROOT / "Makefile").read_text()
    for doc in DOCS:
        for target in set(re.findall(r"`make ([a-z]+)`|^make ([a-z]+)$", doc.read_text(), flags=re.MULTILINE)):
            name = target[0] or target[1]
            assert re.search(rf"^{name}:", makefile, flags=re.MULTILINE), (name_of(doc), name)


@pytest.mark.parametrize("doc", DOCS, ids=name_of)
def test_every_rollmesh_command_shown_parses(doc: Path):
    text = doc.read_text()
    parser = build_parser()
    shown = [line for line in command_lines(text) if line.startswith("rollmesh ")]
    # The README's inline commands are whole ones; elsewhere an inline `rollmesh submit` may only
    # name the command (test_docs_cli_synopses.py checks the flags those spans show).
    inline = re.findall(r"`(rollmesh (?:demo|submit|up|down|watch)[^`]*)`", text) if doc == README_PATH else []
    for line in shown + [span for span in inline if "[" not in span and "..." not in span]:
        args = parser.parse_args(shlex.split(line)[1:])
        assert callable(args.handler), f"{name_of(doc)}: {line}"


def test_the_readme_shows_the_cli_commands():
    assert len([line for line in command_lines(README) if line.startswith("rollmesh ")]) >= 5


def test_the_quickstart_uses_up_submit_watch_down():
    shown = " ".join(command_lines(README))
    for command in ("rollmesh up", "rollmesh submit --task molar_mass --count 8 --wait", "rollmesh watch",
                    "rollmesh down"):
        assert command in shown


@pytest.mark.parametrize("doc", DOCS, ids=name_of)
def test_every_relative_link_points_at_a_file_and_its_anchor_at_a_heading(doc: Path):
    for target in re.findall(r"\]\(([^)\s]+)\)", prose(doc.read_text())):
        if "://" in target or target.startswith("mailto:"):
            continue
        path, _, anchor = target.partition("#")
        linked = (doc.parent / path).resolve() if path else doc
        assert linked.exists(), f"{name_of(doc)} links to {target}"
        if anchor and linked.suffix == ".md":
            assert anchor in anchors(linked), f"{name_of(doc)} links to {target}: no such heading"


@pytest.mark.parametrize("doc", DOCS, ids=name_of)
def test_every_repository_path_named_in_prose_exists(doc: Path):
    for named in prose_paths(doc.read_text()):
        if "*" in named:
            assert glob.glob(str(REPO_ROOT / named)), f"{name_of(doc)} names {named}, which matches nothing"
        else:
            assert (REPO_ROOT / named).exists(), f"{name_of(doc)} names {named}, which does not exist"


def test_the_architecture_page_walks_a_rollout_through_real_files():
    page = (REPO_ROOT / "docs" / "architecture.md").read_text()
    named = {path for path in prose_paths(page) if path.startswith("rollmesh/")}
    # The walk's landmarks, in the order a rollout meets them.
    landmarks = ["rollmesh/cli/submit.py", "rollmesh/rollout/agent_loop.py", "rollmesh/rollout/rollout_sandbox.py",
                 "rollmesh/engine/decode.py", "rollmesh/rollout/tool_runner.py", "rollmesh/bus/rollout_states.py",
                 "rollmesh/training/trainer_logic.py", "rollmesh/engine/weight_follower.py",
                 "rollmesh/checkpoint/resharder.py"]
    assert set(landmarks) <= named
    positions = [page.index(landmark) for landmark in landmarks]
    assert positions == sorted(positions)


def test_the_readme_says_where_the_gpu_only_list_is():
    section = README.split("## What runs only on a GPU", 1)[1].split("\n## ", 1)[0]
    assert "(docs/gpu.md)" in section
    assert "What runs only on a GPU" in (REPO_ROOT / "docs" / "gpu.md").read_text()


def test_the_json_request_examples_are_valid_rollout_requests():
    pages = [README, (REPO_ROOT / "docs" / "wire-contract.md").read_text()]
    examples = [block for page in pages for block in code_blocks(page) if block.lstrip().startswith("{")]
    assert len(examples) >= 2
    for block in examples:
        request = ROLLOUT_REQUESTED.decode(block.encode())
        assert request.task == "molar_mass"
    payloads = [payload for page in pages
                for payload in re.findall(r"'(\{\"type\":\"rollout\.requested\".*?\})'", page)]
    assert payloads
    for payload in payloads:
        assert ROLLOUT_REQUESTED.decode(payload.encode()).rollout_id


def test_the_mesh_picture_is_what_its_script_draws(tmp_path: Path):
    assert "](docs/mesh.svg)" in README
    drawn = tmp_path / "mesh.svg"
    run = subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "draw_mesh.py"), "--out", str(drawn)],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert drawn.read_bytes() == (REPO_ROOT / "docs" / "mesh.svg").read_bytes(), \
        "run `python scripts/draw_mesh.py` and commit docs/mesh.svg"


def test_ci_runs_make_test():
    ci = REPO_ROOT / ".ci" / "run"
    assert os.access(ci, os.X_OK)
    text = ci.read_text()
    assert text.startswith("#!/usr/bin/env bash") and "set -euo pipefail" in text and "make test" in text
