"""Supervised warm-start data from a task's demonstrations.

Knows the task plugin Protocol and the byte tokenizer; not Ray, NATS or torch. A share of the
demonstrations skips the tool (``tool_fraction`` uses it), so the warm-started policy only
sometimes calls the calculator and RL has something real to learn.
"""

from __future__ import annotations

import random

from rollmesh.engine.tokenizer import ByteTokenizer
from rollmesh.rollout.tasks import DemonstrableTask


def demonstration_batch(
    task: DemonstrableTask,
    tokenizer: ByteTokenizer,
    rng: random.Random,
    *,
    size: int,
    tool_fraction: float,
) -> list[tuple[list[int], list[int]]]:
    """``size`` (tokens, loss_mask) pairs of training-split episodes, each ending in a trained EOS."""
    batch = []
    for task_input in task.sample_task_inputs(rng, size, held_out=False):
        segments = task.demonstration(task_input, uses_tool=rng.random() < tool_fraction, rng=rng)
        tokens, mask = [tokenizer.bos_id], [0]
        for text, trained in segments:
            ids = tokenizer.encode(text)
            tokens.extend(ids)
            mask.extend([int(trained)] * len(ids))
        tokens.append(tokenizer.eos_id)
        mask.append(1)
        batch.append((tokens, mask))
    return batch
