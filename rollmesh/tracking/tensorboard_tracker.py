"""The TensorBoard tracker: a training job's scalars and tables under ``<run_dir>/tensorboard/train``.

Knows tensorboardX (the event-file writer the mesh's own scalars use, in ``<run_dir>/tensorboard``;
TensorBoard shows the job's as the run "train" beside them). Scalars are scalar summaries; the
config and the sample tables are text summaries, which TensorBoard's Text tab renders as Markdown
(tables included) step by step. The Markdown table is written here because tensorboardX's
``add_text`` takes one string; HTML in a cell is escaped so a completion cannot break the page.
Tags allow only letters, digits and ``-/_.``: ``mean@4`` is ``mean_at_4`` (as in MLflow), any
other character ``_`` (tensorboardX would do the same, with a warning at every step).
"""

from __future__ import annotations

import html
import json
import re
from pathlib import Path
from typing import Any

from tensorboardX import SummaryWriter

TRAIN_DIR = Path("tensorboard") / "train"
_NOT_IN_TAGS = re.compile(r"[^-/\w.]")


class TensorBoardTracker:
    backend = "tensorboard"
    run_id = None  # a resumed job's events are new files in the same directory: nothing to continue

    def __init__(self, run_dir: Path, config: dict[str, Any]) -> None:
        self.directory = Path(run_dir) / TRAIN_DIR
        self.directory.mkdir(parents=True, exist_ok=True)
        # Flushed after each call (steps are seconds apart), not on tensorboardX's timer thread.
        self._writer = SummaryWriter(logdir=str(self.directory), flush_secs=3600)
        # Indented four spaces: a Markdown code block, so the JSON keeps its layout.
        text = json.dumps(config, indent=2, sort_keys=True, default=str)
        self._writer.add_text("config", "\n".join("    " + line for line in text.splitlines()),
                              global_step=0)
        self._writer.flush()

    def log_scalars(self, step: int, scalars: dict[str, float]) -> None:
        for tag, value in scalars.items():
            self._writer.add_scalar(tensorboard_tag(tag), value, global_step=step)
        self._writer.flush()

    def log_table(self, name: str, step: int, rows: list[dict[str, Any]]) -> None:
        self._writer.add_text(tensorboard_tag(name), markdown_table(rows), global_step=step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()  # idempotent in tensorboardX


def tensorboard_tag(name: str) -> str:
    return _NOT_IN_TAGS.sub("_", name.replace("@", "_at_"))


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """Rows as a Markdown table; columns in the order they first appear."""
    columns = list(dict.fromkeys(key for row in rows for key in row))
    if not columns:
        return "(no rows)"
    lines = ["| " + " | ".join(_cell(c) for c in columns) + " |",
             "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(row.get(c, "")) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def _cell(value: Any) -> str:
    text = format(value, ".6g") if isinstance(value, float) else str(value)
    # A '|' or a line break would end the cell or the row; '<br>' is the Markdown table's newline.
    return html.escape(text, quote=False).replace("|", "\\|").replace("\r\n", "\n").replace("\n", "<br>")
