"""``rollmesh watch``: live rollout progress, completions, failures and trainer steps.

Knows the wire contract and the bus (a ``BusWatcher``: watching never takes work off the queues or
holds acks). On a terminal it draws a rich progress bar; elsewhere it prints one plain
line per event. With ``--count N`` it exits once N rollouts finished (completed or failed).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from dataclasses import dataclass, field
from typing import Any

from rollmesh.cli.errors import EXIT_FAILURE, EXIT_OK
from rollmesh.cli.events import completed_line, failed_line, progressed_line, stepped_line
from rollmesh.cli.target import (
    add_target_options,
    bus_errors_as_cli_errors,
    find_mesh,
    load_cli_config,
    positive_float,
    positive_int,
)
from rollmesh.mesh_address import MeshAddress
from rollmesh.messages import RolloutCompleted, RolloutFailed, RolloutProgressed, Subject, TrainerStepped
from rollmesh.messages.subjects import ROLLOUT_COMPLETED, ROLLOUT_FAILED, ROLLOUT_PROGRESSED, TRAINER_STEPPED

WATCHED: tuple[Subject, ...] = (ROLLOUT_PROGRESSED, ROLLOUT_COMPLETED, ROLLOUT_FAILED, TRAINER_STEPPED)


def register(subparsers: Any, common: argparse.ArgumentParser) -> None:
    watch = subparsers.add_parser(
        "watch", parents=[common], help="show live rollout and trainer progress",
        description="Follow rl.<ns>.rollout.progressed/completed/failed and rl.<ns>.trainer.stepped. "
                    "Runs until Ctrl-C, --timeout, or --count rollouts finished.")
    add_target_options(watch)
    watch.add_argument("--count", type=positive_int, metavar="N",
                       help="exit 0 after N rollouts finished (completed or failed)")
    watch.add_argument("--timeout", type=positive_float, metavar="S",
                       help="stop after S seconds (with --count: exit 1 if fewer finished)")
    watch.set_defaults(handler=run_watch)


@dataclass
class WatchTally:
    completed: int = 0
    failed: int = 0
    reward_sum: float = 0.0
    running: set[str] = field(default_factory=set)
    last_step: TrainerStepped | None = None

    @property
    def finished(self) -> int:
        return self.completed + self.failed

    def record(self, event: Any) -> None:
        if isinstance(event, RolloutProgressed):
            self.running.add(event.rollout_id)
        elif isinstance(event, RolloutCompleted):
            self.completed += 1
            self.reward_sum += event.reward
            self.running.discard(event.rollout_id)
        elif isinstance(event, RolloutFailed):
            self.failed += 1
            self.running.discard(event.rollout_id)
        elif isinstance(event, TrainerStepped):
            self.last_step = event

    def describe(self) -> str:
        mean = f"{self.reward_sum / self.completed:.3f}" if self.completed else "-"
        step = (f"  step {self.last_step.step} reward {self.last_step.reward_mean:.3f} "
                f"v{self.last_step.weight_version}" if self.last_step else "")
        return (f"completed {self.completed} (mean reward {mean})  failed {self.failed}  "
                f"running {len(self.running)}{step}")


def event_line(event: Any) -> str:
    if isinstance(event, RolloutProgressed):
        return progressed_line(event)
    if isinstance(event, RolloutCompleted):
        return completed_line(event)
    if isinstance(event, RolloutFailed):
        return failed_line(event)
    return stepped_line(event)


def run_watch(args: argparse.Namespace) -> int:
    config = load_cli_config(args)
    target = find_mesh(args, config)
    tally = WatchTally()
    try:
        done = asyncio.run(_watch(target, tally, count=args.count, timeout_s=args.timeout,
                                  terminal=sys.stdout.isatty()))
    except KeyboardInterrupt:
        done = True
    print(tally.describe(), flush=True)
    if args.count and not done:
        print(f"timed out after {args.timeout:g}s: {tally.finished} of {args.count} rollouts finished",
              file=sys.stderr)
        return EXIT_FAILURE
    return EXIT_OK


async def _watch(target: MeshAddress, tally: WatchTally, *, count: int | None, timeout_s: float | None,
                 terminal: bool) -> bool:
    """Follow events until ``count`` finished (True) or ``timeout_s`` passed (False when counting)."""
    from rollmesh.bus.watcher import BusWatcher

    with bus_errors_as_cli_errors(target):
        nc = await target.connect("rollmesh-watch", role="client")
    watcher = BusWatcher(nc, target.namespace, name="rollmesh-watch")
    finished = asyncio.Event()
    view = _TerminalView(count) if terminal else None

    def show(event: Any) -> None:
        tally.record(event)
        if view is not None:
            view.show(event, tally)
        else:
            print(event_line(event), flush=True)
        if count and tally.finished >= count:
            finished.set()

    try:
        for subject in WATCHED:  # each active at the server before "watching" is said
            await watcher.watch(subject, show)
        if not terminal:
            print(f"watching rl.{target.namespace}.* on {target.nats_url}", flush=True)
        try:
            await asyncio.wait_for(finished.wait(), timeout=timeout_s)
        except TimeoutError:
            return not count  # without --count, a timeout is just how long to watch
        return True
    finally:
        await watcher.close(drain_timeout_s=0)  # what comes after the count is not shown
        if view is not None:
            view.close()
        await nc.close()


class _TerminalView:
    """A rich progress bar (N completions with --count, else a spinner) with finished rollouts and
    trainer steps printed above it; per-turn progress only updates the counts."""

    def __init__(self, count: int | None) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
        from rich.table import Column

        def fixed(width: int) -> Column:
            return Column(min_width=width, no_wrap=True)

        columns: list[Any] = [SpinnerColumn()]
        if count:
            columns += [BarColumn(bar_width=30, table_column=fixed(30)), MofNCompleteColumn(table_column=fixed(5))]
        # The counts take what is left of the line and are cut there, never the bar.
        columns += [TimeElapsedColumn(table_column=fixed(7)),
                    TextColumn("{task.description}", table_column=Column(no_wrap=True, overflow="ellipsis", ratio=1))]
        self.progress = Progress(*columns, expand=True)
        self.bar = self.progress.add_task("waiting for events", total=count)
        self.progress.start()

    def show(self, event: Any, tally: WatchTally) -> None:
        if not isinstance(event, RolloutProgressed):
            self.progress.console.print(event_line(event), highlight=False)
        self.progress.update(self.bar, completed=tally.finished, description=tally.describe())

    def close(self) -> None:
        self.progress.stop()
