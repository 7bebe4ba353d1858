"""The batches of a supervised stage (``sft``, ``midtrain``): rows of its dataset in the stage's
order, rendered (rollmesh/training/sft_render.py), cut to ``max_seq_len`` and gathered until a step
holds ``batch_tokens`` real tokens.

Knows rollmesh.data, the stage config and the renderer; nothing of torch, NATS or Ray (the trainer
packs and trains what it returns). A batch names each example by its group id
(``<stage>/e<epoch>/i<index>``, as an rl stage's prompts), so the trainer's ledger records which
rows each step trained, and the position after the batch, so a resumed stage reads on from there.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from rollmesh.chat.chat_model import ChatModel
from rollmesh.chat.errors import TemplateRenderError
from rollmesh.data import BadRowError, EpochOrder, PromptReader, open_dataset
from rollmesh.run_config import StageConfig
from rollmesh.training.prompt_ids import PromptRef
from rollmesh.training.sft_render import SftExample, render_chat_example, render_text_example

_log = structlog.get_logger("rollmesh.training.supervised")


@dataclass
class SupervisedBatch:
    sequences: list[tuple[list[int], list[int]]]
    groups: list[str]
    next_position: int
    epoch: int
    tokens: int  # real tokens
    trained_tokens: int  # tokens with loss
    mismatches: int = 0  # examples whose loss mask disagrees with the template's assistant spans
    bad_rows: list[str] = field(default_factory=list)


class SupervisedSource:
    """One supervised stage's data, read batch by batch from a position."""

    def __init__(self, stage: StageConfig, name: str, chat: ChatModel, *, max_seq_len: int,
                 on_bad_row: Callable[[BadRowError], None] | None = None) -> None:
        self.stage, self.name, self.chat = stage, name, chat
        self.max_seq_len = max_seq_len
        self.dataset = open_dataset(stage.data)
        self.num_rows = len(self.dataset)
        self._bad: list[str] = []
        self.reader = PromptReader(self.dataset, stage.fields, stage.kind,
                                   EpochOrder(self.num_rows, shuffle=stage.shuffle, seed=stage.seed),
                                   lambda error: self._bad.append(str(error)))
        self.on_bad_row = on_bad_row

    def batch(self, position: int, *, end_position: int | None = None) -> SupervisedBatch:
        """Examples from ``position`` until ``batch_tokens`` real tokens (at least one example),
        never reading at or past ``end_position`` (the end of the stage's last epoch)."""
        sequences: list[tuple[list[int], list[int]]] = []
        groups: list[str] = []
        tokens = trained = mismatches = 0
        epoch = self.reader.order.at(position)[0]
        self._bad = []
        while tokens < self.stage.batch_tokens and (end_position is None or position < end_position):
            next_position, row, epoch, index = self.reader.read(position)
            if end_position is not None and next_position > end_position:
                break  # the good row found lies past the stage's end: it belongs to no epoch of it
            position = next_position
            try:
                example = self._render(row)
            except TemplateRenderError as exc:
                # The template refuses the row's messages: a bad row like any other.
                error = BadRowError(self.dataset.path, self.dataset.row_label(index), f"chat template: {exc}")
                self._bad.append(str(error))
                continue
            if not any(example.loss_mask):
                continue  # nothing to learn from (e.g. cut before its first trained token)
            sequences.append((example.ids, example.loss_mask))
            groups.append(PromptRef(self.name, epoch, index).group_id)
            tokens += len(example.ids)
            trained += sum(example.loss_mask)
            mismatches += 1 if example.mismatches else 0
        for reason in self._bad:
            _log.warning("bad_row_skipped", stage=self.name, reason=reason)
        return SupervisedBatch(sequences, groups, position, epoch, tokens, trained, mismatches, list(self._bad))

    def _render(self, row) -> SftExample:
        if self.stage.kind == "midtrain":
            return render_text_example(self.chat, row.prompt_text or "", max_len=self.max_seq_len)
        example = render_chat_example(self.chat, row.messages, tools=row.tools, loss_roles=self.stage.loss_roles)
        if len(example.ids) > self.max_seq_len:  # cut, as a sequence longer than a row cannot pack
            example = SftExample(example.ids[: self.max_seq_len], example.loss_mask[: self.max_seq_len],
                                 example.mismatches)
        return example

    def close(self) -> None:
        self.dataset.close()


def model_context(model_path: str) -> int:
    """The model's context length (config.json's max_position_embeddings): rows pack up to it."""
    config = json.loads((Path(model_path) / "config.json").read_text())
    return int(config.get("max_position_embeddings") or config.get("max_seq_len") or 2048)
