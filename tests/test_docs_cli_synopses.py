"""The `rollmesh ...` synopses in README.md and docs/*.md agree with the argument parser.

A synopsis is an inline code span that starts with ``rollmesh <command>`` and shows an optional
part (``[``), e.g. ``rollmesh watch [--count N] [--timeout S]``; code spans in the same paragraph
or list item that start with ``--`` continue it. Every flag of the command's parser must appear
in each of its synopses, except the options documented once for all commands (the global options
and the "which mesh" options, named in README's CLI paragraph), and every flag that any
``rollmesh ...`` span shows must exist. Example commands with concrete values and no ``[`` are
not synopses; test_readme.py parses those.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from rollmesh.cli import build_parser

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

REPO_ROOT = Path(__file__).resolve().parent.parent
DOCS = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
SHARED_GROUP = "which mesh"  # rollmesh/cli/target.py add_target_options


@dataclass(frozen=True)
class Shown:
    """One ``rollmesh ...`` code span, where it is, and the flags it (with its continuations) shows."""
    where: str
    command: tuple[str, ...]
    text: str
    flags: frozenset[str]
    synopsis: bool


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def command_parser(path: tuple[str, ...]) -> argparse.ArgumentParser:
    parser = build_parser()
    for name in path:
        parser = subcommands(parser)[name]
    return parser


def global_flags() -> set[str]:
    parser = build_parser()
    return {flag for action in parser._actions for flag in action.option_strings}


def own_and_shared_flags(parser: argparse.ArgumentParser) -> tuple[set[str], set[str]]:
    """(flags a synopsis must show, flags documented once for every command)."""
    shared = {flag for group in parser._action_groups if group.title == SHARED_GROUP
              for action in group._group_actions for flag in action.option_strings}
    flags = {flag for action in parser._actions for flag in action.option_strings if flag.startswith("--")}
    shared |= global_flags() & flags
    return flags - shared, shared


def prose_items(text: str) -> list[str]:
    """Paragraphs and list items (a nested item is its own), fenced code blocks left out."""
    items: list[list[str]] = []
    current: list[str] = []
    fenced = False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            items.append(current)
            current = []
            continue
        if fenced:
            continue
        if not line.strip() or re.match(r"^\s*[-*] ", line) or line.startswith(("#", "|")):
            items.append(current)
            current = []
        if line.strip():
            current.append(line.strip())
    items.append(current)
    return [" ".join(item) for item in items if item]


def command_of(words: list[str]) -> tuple[str, ...]:
    """The subcommand path of ``rollmesh WORDS...``, global options before it skipped."""
    parser, path = build_parser(), []
    takes_value = {flag for action in parser._actions if action.nargs != 0 for flag in action.option_strings}
    words = list(words)
    while words:
        word = words.pop(0)
        names = subcommands(parser)
        if not path and word in global_flags():
            if word in takes_value and words:
                words.pop(0)
            continue
        if word not in names:
            break
        parser = names[word]
        path.append(word)
    return tuple(path)


def shown_commands() -> list[Shown]:
    found = []
    for doc in DOCS:
        for item in prose_items(doc.read_text()):
            spans = re.findall(r"`([^`]+)`", item)
            continuation = [span for span in spans if span.startswith("--")]
            for span in spans:
                words = span.split()
                if len(words) < 2 or words[0] != "rollmesh":
                    continue
                command = command_of(words[1:])
                synopsis = "[" in span
                flags = set(FLAG.findall(span))
                if synopsis:
                    flags |= {flag for more in continuation for flag in FLAG.findall(more)}
                found.append(Shown(f"{doc.name}: `{span}`", command, span, frozenset(flags), synopsis))
    return found


SHOWN = shown_commands()
SYNOPSES = [shown for shown in SHOWN if shown.synopsis]


def test_the_docs_show_a_synopsis_of_every_command_they_describe():
    shown = {synopsis.command for synopsis in SYNOPSES}
    assert {("up",), ("down",), ("submit",), ("watch",), ("demo",), ("convert",), ("serve",),
            ("sandbox", "run"), ("sandbox", "lease"), ("sched", "simulate"), ("dashboard",),
            ("train",)} <= shown


@pytest.mark.parametrize("synopsis", SYNOPSES, ids=lambda shown: shown.where)
def test_a_synopsis_shows_every_flag_of_its_command(synopsis: Shown):
    assert synopsis.command, synopsis.where
    must_show, _ = own_and_shared_flags(command_parser(synopsis.command))
    missing = must_show - synopsis.flags
    assert not missing, f"{synopsis.where} leaves out {sorted(missing)}"


@pytest.mark.parametrize("shown", SHOWN, ids=lambda shown: shown.where)
def test_every_flag_a_command_shows_exists(shown: Shown):
    parser = command_parser(shown.command)
    own, shared = own_and_shared_flags(parser)
    unknown = shown.flags - own - shared
    assert not unknown, f"{shown.where}: `rollmesh {' '.join(shown.command)}` has no {sorted(unknown)}"


def test_the_options_left_out_of_synopses_are_documented_once_for_all():
    readme = (REPO_ROOT / "README.md").read_text()
    paragraph = next(item for item in prose_items(readme) if item.startswith("Every command but"))
    shared = set().union(*(own_and_shared_flags(command_parser(shown.command))[1] for shown in SYNOPSES))
    undocumented = shared - {"--help"} - set(FLAG.findall(paragraph))
    assert not undocumented, f"README's paragraph on shared options leaves out {sorted(undocumented)}"
