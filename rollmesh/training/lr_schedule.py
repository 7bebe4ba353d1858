"""The learning rate of a policy step: a linear warmup from a fresh optimizer, then constant.

Knows torch optimizers and this package's mixed-precision AdamW (``optimizer_adamw``), whose
learning rate lives in its frozen ``config``; nothing of models or losses.

Why warmup: a fresh Adam moves every weight by about ``lr`` on its first updates, whatever the
gradient's size, because its second moment starts from one noisy batch. An RL stage starts its
optimizer fresh after supervised training, and at the learning rate that later learns well its
first steps can undo what the supervised stages taught (benchmarks/README.md, "Training pipeline").
"""

from __future__ import annotations

from typing import Any

import msgspec


def warmup_lr(lr: float, steps_done: int, warmup_steps: int) -> float:
    """``lr`` x (steps_done + 1) / warmup_steps for the first ``warmup_steps`` steps, then ``lr``."""
    if warmup_steps <= 0 or steps_done >= warmup_steps:
        return lr
    return lr * (steps_done + 1) / warmup_steps


def set_lr(optimizer: Any, lr: float) -> None:
    """Set the learning rate of the next ``step``: a torch (or megatron) optimizer's param groups,
    or the ``config`` of an ``optimizer_adamw`` optimizer."""
    config = getattr(optimizer, "config", None)
    if config is not None and hasattr(config, "lr") and not hasattr(optimizer, "param_groups"):
        optimizer.config = msgspec.structs.replace(config, lr=lr)
        return
    for group in optimizer.param_groups:
        group["lr"] = lr
