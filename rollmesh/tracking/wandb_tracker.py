"""The Weights & Biases tracker: one wandb run in ``<run_dir>/wandb``.

Knows the ``wandb`` package. ``mode`` "offline" (or "" with ``WANDB_MODE=offline``) needs no
network and no account: the run is written under ``<run_dir>/wandb/offline-run-*`` and
``wandb sync <run_dir>/wandb`` uploads it later. The settings keep wandb light: no console
capture, no system metrics or machine metadata (which probe cloud metadata endpoints), no code,
git or pip snapshot. wandb's service process (wandb-core) is shut down by ``close`` so nothing
outlives the tracker; a process therefore holds one wandb tracker at a time.

``resume_id`` continues a run (W&B's ``resume="allow"``): online, the same run goes on; offline,
each session is its own ``offline-run-*`` folder with the same run id, and ``wandb sync --append``
uploads the later ones into it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import wandb


# Every metric's x axis: the training job's trainer step.
STEP_KEY = "trainer_step"


class WandbTracker:
    backend = "wandb"

    def __init__(self, run_dir: Path, *, project: str, run_name: str, mode: str,
                 config: dict[str, Any], resume_id: str | None = None) -> None:
        settings = wandb.Settings(
            console="off", x_disable_stats=True, x_disable_meta=True, x_disable_machine_info=True,
            disable_git=True, disable_code=True, save_code=False, x_save_requirements=False,
            silent=True, quiet=True, reinit="create_new")
        # mode None: wandb follows WANDB_MODE (online when unset), as "" promises.
        try:
            self._run = wandb.init(project=project, name=run_name, dir=str(run_dir), config=config,
                                   mode=mode or None, settings=settings, id=resume_id,
                                   resume="allow" if resume_id else None)
            self._run.define_metric(STEP_KEY)
            self._run.define_metric("*", step_metric=STEP_KEY)
        except BaseException:
            wandb.teardown()  # a refused init (no API key online) leaves wandb-core running
            raise
        self._closed = False

    @property
    def run_id(self) -> str:
        return self._run.id

    @property
    def directory(self) -> Path:
        """The run's own directory (``offline-run-*`` or ``run-*`` under ``<run_dir>/wandb``)."""
        return Path(self._run.dir).parent

    def log_scalars(self, step: int, scalars: dict[str, float]) -> None:
        # Against trainer_step, not W&B's own step: an evaluation of step 4 finishes after step 5
        # was logged, and W&B drops a step= below its current one.
        self._run.log({**scalars, STEP_KEY: step})

    def log_table(self, name: str, step: int, rows: list[dict[str, Any]]) -> None:
        columns = list(dict.fromkeys(key for row in rows for key in row))
        table = wandb.Table(columns=columns, data=[[row.get(c) for c in columns] for row in rows])
        self._run.log({name: table, STEP_KEY: step})

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._run.finish()
        finally:
            wandb.teardown()  # stops wandb-core, which otherwise lives until the process exits
