"""``rollmesh submit``: publish rollout requests (from a JSONL file or a built-in task), maybe wait.

Knows the wire contract, the bus (JetStream publish through ``BusPublisher``, so a request is
stored before it counts as submitted) and the task plugins (to sample inputs); not Ray. A bad
JSONL line is reported with its number and skipped; the others are published.

Traced as ``rollmesh.cli`` (``cli_tracer``): each request is published inside a ``submit`` span
(``rl.rollout_id``), so its NATS headers carry a ``traceparent`` and the rollout joins the CLI's
trace. Spans are exported only where the OTEL_* variables (or an ``otlp`` config) say; the
default ``jsonl`` is off here, so no traces.jsonl lands in the working directory.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
from opentelemetry import trace

from rollmesh.cli.cli_tracing import cli_tracer
from rollmesh.cli.errors import EXIT_FAILURE, EXIT_OK, EXIT_USAGE, CliError
from rollmesh.cli.events import completed_versions
from rollmesh.cli.target import (
    add_target_options,
    bus_errors_as_cli_errors,
    find_mesh,
    load_cli_config,
    positive_float,
    positive_int,
)
from rollmesh.config import RollmeshConfig
from rollmesh.mesh_address import MeshAddress
from rollmesh.messages import RolloutCompleted, RolloutFailed, RolloutRequested, SamplingParams
from rollmesh.messages.subjects import ROLLOUT_COMPLETED, ROLLOUT_FAILED, ROLLOUT_REQUESTED
from rollmesh.telemetry.conventions import SPAN_SUBMIT, message_attributes
from rollmesh.telemetry.tracing import flush_tracing



def register(subparsers: Any, common: argparse.ArgumentParser) -> None:
    submit = subparsers.add_parser(
        "submit", parents=[common], help="publish rollout requests",
        description="Publish RolloutRequested messages (JetStream, durable) from a JSONL file or "
                    "sampled from a built-in task; with --wait, wait for each result.")
    source = submit.add_mutually_exclusive_group(required=True)
    source.add_argument("--file", type=Path, metavar="JSONL",
                        help="one RolloutRequested JSON object per line ('-' for stdin)")
    source.add_argument("--task", metavar="NAME",
                        help="sample inputs of this registered task (e.g. molar_mass) or import path")
    sampled = submit.add_argument_group("with --task")
    sampled.add_argument("--count", type=positive_int, default=8, metavar="N",
                         help="how many rollouts (default: %(default)s)")
    sampled.add_argument("--seed", type=int, default=None, metavar="S", help="input sampling seed")
    sampled.add_argument("--held-out", action="store_true", help="sample held-out (evaluation) inputs")
    sampled.add_argument("--purpose", choices=("train", "eval"), default="train",
                         help="train: the trainer learns from them; eval: it does not (default: %(default)s)")
    sampled.add_argument("--n-samples-per-prompt", type=positive_int, default=None, metavar="G",
                         help="rollouts per GRPO group sharing one input (default: config trainer.n_samples_per_prompt)")
    sampled.add_argument("--max-new-tokens", type=positive_int, default=40, metavar="N",
                         help="tokens per generation (default: %(default)s)")
    sampled.add_argument("--temperature", type=float, default=1.0, metavar="T", help="sampling temperature (default: %(default)s)")
    sampled.add_argument("--max-turns", type=positive_int, default=4, metavar="N", help="turns per rollout (default: %(default)s)")
    add_target_options(submit)
    submit.add_argument("--wait", action="store_true",
                        help="wait for every request's completion or failure and print a table")
    submit.add_argument("--timeout", type=positive_float, default=600.0, metavar="S",
                        help="with --wait: seconds to wait for results (default: %(default)s)")
    submit.set_defaults(handler=run_submit)


@dataclass
class ParsedRequests:
    requests: list[RolloutRequested] = field(default_factory=list)
    # (line number, reason) of every line that was not published
    bad_lines: list[tuple[int, str]] = field(default_factory=list)


def parse_request_lines(lines: list[str]) -> ParsedRequests:
    """Decode JSONL lines with the subject's own decoder; blank lines are skipped."""
    parsed = ParsedRequests()
    first_line_of: dict[str, int] = {}
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            request = ROLLOUT_REQUESTED.decode(line.encode())
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            parsed.bad_lines.append((number, f"not a valid RolloutRequested: {exc}"))
            continue
        if request.rollout_id in first_line_of:
            # JetStream would silently drop it as a duplicate: say so instead.
            parsed.bad_lines.append((number, f"rollout_id {request.rollout_id!r} repeats line "
                                             f"{first_line_of[request.rollout_id]}"))
            continue
        first_line_of[request.rollout_id] = number
        parsed.requests.append(request)
    return parsed


def sample_requests(args: argparse.Namespace, config: RollmeshConfig) -> list[RolloutRequested]:
    """``--count`` requests of ``--task``, ``--n-samples-per-prompt`` per group sharing one input."""
    task = _find_task(args.task, config.rollout.tasks)
    if not callable(getattr(task, "sample_task_inputs", None)):
        raise CliError(f"task {task.name!r} cannot sample its own inputs; use --file", exit_code=EXIT_USAGE)
    n_samples = args.n_samples_per_prompt or config.trainer.n_samples_per_prompt
    groups = -(-args.count // n_samples)
    rng = random.Random(args.seed)
    inputs = task.sample_task_inputs(rng, groups, held_out=args.held_out)
    batch = f"cli-{uuid.uuid4().hex[:8]}"
    sampling = SamplingParams(temperature=args.temperature, max_new_tokens=args.max_new_tokens)
    now = time.time()
    requests = [
        RolloutRequested(rollout_id=f"{batch}-{index:04d}", task=task.name,
                         task_input=inputs[index // n_samples], group_id=f"{batch}-g{index // n_samples:03d}",
                         purpose=args.purpose, sampling=sampling, max_turns=args.max_turns, requested_at=now)
        for index in range(args.count)
    ]
    try:  # Struct constructors do not check constraints; the mesh's decoder would refuse them
        ROLLOUT_REQUESTED.decode(ROLLOUT_REQUESTED.encode(requests[0]))
    except msgspec.ValidationError as exc:
        raise CliError(f"invalid request options: {exc}", exit_code=EXIT_USAGE) from exc
    return requests


def _find_task(name: str, registered: list[str]) -> Any:
    from rollmesh.rollout.tasks import load_task

    paths = [name] if ":" in name else registered
    for path in paths:
        try:
            task = load_task(path)
        except (ImportError, AttributeError, ValueError) as exc:
            raise CliError(f"cannot load task {path!r}: {exc}") from exc
        if ":" in name or task.name == name:
            return task
    raise CliError(f"unknown task {name!r}; registered in config rollout.tasks: {', '.join(registered)}",
                   exit_code=EXIT_USAGE)


def run_submit(args: argparse.Namespace) -> int:
    config = load_cli_config(args)
    if args.file is not None:
        parsed = _read_file(args.file)
        for number, reason in parsed.bad_lines:
            print(f"{args.file}:{number}: {reason}", file=sys.stderr)
        requests = parsed.requests
    else:
        parsed = ParsedRequests()
        requests = sample_requests(args, config)
        n_samples = args.n_samples_per_prompt or config.trainer.n_samples_per_prompt
        if args.purpose == "train" and len(requests) % n_samples:
            print(f"warning: {len(requests)} requests do not fill groups of {n_samples}; the trainer "
                  "only trains full groups", file=sys.stderr)
    if not requests:
        print("nothing to publish", file=sys.stderr)
        return EXIT_FAILURE if parsed.bad_lines else EXIT_OK
    target = find_mesh(args, config)
    tracer = cli_tracer(config.telemetry)
    try:
        outcome = asyncio.run(_submit(target, requests, tracer, wait=args.wait,
                                      timeout_s=args.timeout, bad_lines=len(parsed.bad_lines)))
    finally:
        flush_tracing()  # the batch processor would drop what is still queued at exit
    failed = bool(parsed.bad_lines)
    waited = [r for r in requests if r.rollout_id not in outcome.duplicates]
    if args.wait and waited:
        failed = _print_results(waited, outcome.results) or failed
    return EXIT_FAILURE if failed else EXIT_OK


def _report_published(subject: str, requests: list[RolloutRequested], duplicates: list[str],
                      bad_lines: int) -> None:
    print(f"published {len(requests) - len(duplicates)} rollout request(s) to {subject}"
          + (f"; {bad_lines} bad line(s) skipped" if bad_lines else ""), flush=True)
    if duplicates:
        print(f"warning: {len(duplicates)} request(s) dropped by JetStream as repeats of rollout ids "
              f"published within its duplicate window: {', '.join(duplicates[:5])}"
              + (" ..." if len(duplicates) > 5 else ""), file=sys.stderr)


def _read_file(path: Path) -> ParsedRequests:
    try:
        text = sys.stdin.read() if str(path) == "-" else path.read_text()
    except OSError as exc:
        raise CliError(f"cannot read {path}: {exc.strerror or exc}") from exc
    return parse_request_lines(text.splitlines())


async def _submit(target: MeshAddress, requests: list[RolloutRequested], tracer: trace.Tracer, *,
                  wait: bool, timeout_s: float, bad_lines: int) -> ResultCollector:
    from rollmesh.bus.publisher import BusPublisher
    from rollmesh.bus.streams import StreamLimits, ensure_streams
    from rollmesh.bus.watcher import BusWatcher

    with bus_errors_as_cli_errors(target):
        nc = await target.connect("rollmesh-submit", role="client")
    watcher = BusWatcher(nc, target.namespace, name="rollmesh-submit")
    try:
        js = nc.jetstream()
        # Idempotent: requests are stored even when no mesh has created the streams yet. A
        # secured client may not create streams; its mesh made them before it was ready.
        if not target.secured:
            await ensure_streams(js, target.namespace, StreamLimits(replicas=target.nats.replicas))
        collector = ResultCollector({r.rollout_id for r in requests})
        if wait:  # subscribe before publishing, so no result can slip past
            for subject in (ROLLOUT_COMPLETED, ROLLOUT_FAILED):
                await watcher.watch(subject, collector.record)
        publisher = BusPublisher(nc, js, target.namespace)
        for request in requests:
            with tracer.start_as_current_span(
                SPAN_SUBMIT, attributes=message_attributes(request.rollout_id, None)
            ):
                ack = await publisher.publish(ROLLOUT_REQUESTED, request)
            if ack is not None and ack.duplicate:  # JetStream dropped it as a repeat
                collector.skip_duplicate(request.rollout_id)
        _report_published(ROLLOUT_REQUESTED.format(target.namespace), requests, collector.duplicates,
                          bad_lines)
        if wait and collector.pending:
            await collector.wait(timeout_s, show_progress=sys.stdout.isatty())
        return collector
    finally:
        await watcher.close(drain_timeout_s=0)
        await nc.close()


class ResultCollector:
    """Completions and failures of the rollout ids we submitted; everything else is ignored."""

    def __init__(self, rollout_ids: set[str]) -> None:
        self.pending = set(rollout_ids)
        self.results: dict[str, RolloutCompleted | RolloutFailed] = {}
        # Dropped by JetStream as repeats of a request published within its duplicate window.
        self.duplicates: list[str] = []
        self._changed = asyncio.Event()

    def skip_duplicate(self, rollout_id: str) -> None:
        self.pending.discard(rollout_id)
        self.duplicates.append(rollout_id)

    def record(self, event: RolloutCompleted | RolloutFailed) -> None:
        if event.rollout_id in self.pending:
            self.pending.discard(event.rollout_id)
            self.results[event.rollout_id] = event
            self._changed.set()

    async def wait(self, timeout_s: float, *, show_progress: bool) -> None:
        total = len(self.pending) + len(self.results)
        progress = None
        if show_progress:
            from rich.progress import Progress

            progress = Progress(transient=True)
            bar = progress.add_task("waiting for results", total=total)
            progress.start()
        deadline = time.monotonic() + timeout_s
        try:
            while self.pending and time.monotonic() < deadline:
                self._changed.clear()
                try:
                    await asyncio.wait_for(self._changed.wait(), timeout=deadline - time.monotonic())
                except TimeoutError:
                    break
                if progress is not None:
                    progress.update(bar, completed=len(self.results))
        finally:
            if progress is not None:
                progress.stop()


def _print_results(requests: list[RolloutRequested], results: dict[str, Any]) -> bool:
    """The results table; True if any rollout failed or never reported."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title="rollouts")
    for column in ("rollout_id", "status", "reward", "turns", "tool calls", "versions"):
        table.add_column(column, justify="right" if column in {"reward", "turns", "tool calls"} else "left")
    failed = 0
    for request in requests:
        result = results.get(request.rollout_id)
        if isinstance(result, RolloutCompleted):
            table.add_row(request.rollout_id, "completed", f"{result.reward:.3f}", str(result.turns),
                          str(result.tool_calls), completed_versions(result))
            continue
        failed += 1
        if isinstance(result, RolloutFailed):
            table.add_row(request.rollout_id, f"failed: {result.kind}", "-", str(result.turns), "-",
                          "-")
        else:
            table.add_row(request.rollout_id, "no result (timed out)", "-", "-", "-", "-")
    # Off a terminal rich assumes 80 columns and would wrap cells; logs read better unwrapped.
    console = Console() if sys.stdout.isatty() else Console(width=200)
    console.print(table)
    rewards = [r.reward for r in results.values() if isinstance(r, RolloutCompleted)]
    if rewards:
        console.print(f"mean reward {sum(rewards) / len(rewards):.3f} over {len(rewards)} completed")
    if failed:
        reasons = sorted({f"{r.kind}: {r.reason}" for r in results.values() if isinstance(r, RolloutFailed)})
        for reason in reasons[:5]:
            print(f"  {reason}", file=sys.stderr)
        print(f"{failed} of {len(requests)} rollout(s) failed or did not finish", file=sys.stderr)
    return failed > 0
