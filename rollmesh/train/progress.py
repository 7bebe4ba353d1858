"""How a training job shows its steps: a progress bar on a terminal, else one ``key=value`` line
per step (``stage kind step reward loss tokens_per_s trainer_idle_pct``), which logs and scripts
read.

Knows rich and the step record; nothing of the mesh.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TextIO

from rollmesh.train.feeder import StepRecord


@contextmanager
def step_reporter(stream: TextIO) -> Iterator[tuple[Callable[[str], None], Callable[[StepRecord], None]]]:
    """``(report, on_step)``: ``report`` prints a line; ``on_step`` shows a step."""
    if not stream.isatty():
        def line(text: str) -> None:
            print(text, file=stream, flush=True)

        yield line, lambda record: line(record.line())
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(file=stream)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("{task.fields[metrics]}"), TimeElapsedColumn(), console=console) as progress:
        bars: dict[str, int] = {}

        def on_step(record: StepRecord) -> None:
            if record.stage not in bars:
                bars[record.stage] = progress.add_task(f"{record.stage} ({record.kind})", total=None, metrics="")
            progress.update(bars[record.stage], completed=record.step,
                            metrics=(f"reward {record.reward:.3f}  " if record.reward is not None else "")
                            + f"loss {record.loss:.3f}  "
                                    f"{record.tokens_per_s:.0f} tok/s  trainer idle {record.trainer_idle_pct:.0f}%")

        yield (lambda text: progress.console.print(text, highlight=False)), on_step
