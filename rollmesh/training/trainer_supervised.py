"""The trainer's supervised steps: the demo-style warm start on a task's demonstrations, one step
on given conversations, and a supervised stage's steps (sft, midtrain) read from its data.

Knows the backend's ``sft_step``, the supervised batches (supervised.py) and packing; nothing of
NATS. A mixin of ``TrainerLogic``, whose state it uses: ``backend``, ``config``, ``model_config``,
``step``, ``version``, ``busy``, ``_train_lock``, ``_supervised``, and whose ``_commit_step``
makes each step durable (its weights, then its ledger line, with the stage's place) exactly as an
RL step is, and ``_chat_model`` and ``save_checkpoint``.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

from opentelemetry import trace

from rollmesh.rollout.tasks import DemonstrableTask
from rollmesh.run_config import StageConfig
from rollmesh.training.packing import pack_sequences
from rollmesh.training.supervised import SupervisedSource, model_context
from rollmesh.training.warm_start import conversation_sequence, demonstration_batch

_tracer = trace.get_tracer("rollmesh.trainer")
# A chat conversation for ``sft_step``: its messages and the tools it declares (or None).
Conversation = tuple[list[dict[str, Any]], list[dict[str, Any]] | None]


class SupervisedTraining:
    async def warm_start(self, task: DemonstrableTask, *, steps: int, batch_size: int, lr: float,
                         exact_fraction: float, seed: int) -> dict[str, float]:
        """Supervised warm start on the task's demonstrations, then publish the new version."""
        chat = await self._chat_model()
        rng = random.Random(seed)
        loss = float("nan")
        with _tracer.start_as_current_span("warm_start", attributes={"steps": steps}):
            for _ in range(steps):
                # Rendering and tokenizing 64 conversations takes tens of ms: off the event loop.
                batch = await asyncio.to_thread(demonstration_batch, task, chat, rng, size=batch_size,
                                                exact_fraction=exact_fraction)
                loss = await asyncio.to_thread(self.backend.sft_step, batch, lr=lr)
            if steps:
                await self._commit_step(self.step, [], new_weights=True)
        return {"loss": loss, "weight_version": self.version}

    async def sft_step(self, conversations: list[Conversation], *, lr: float) -> float:
        """One supervised step on whole chat conversations, each (messages, tools) tokenized as a
        rollout would (``warm_start.conversation_sequence``); weights are published by the next
        ``warm_start`` commit or policy step, not here."""
        chat = await self._chat_model()
        batch = await asyncio.to_thread(
            lambda: [conversation_sequence(chat, messages, tools=tools) for messages, tools in conversations])
        return await asyncio.to_thread(self.backend.sft_step, batch, lr=lr)

    async def supervised_step(self, stage: StageConfig, name: str, *, position: int, tokens_before: int,
                              end_position: int | None = None) -> dict[str, Any]:
        """One step of a supervised stage (sft, midtrain): the next ``batch_tokens`` of its data
        from ``position``, packed and trained, then made durable with the stage's new place in
        the ledger (atomic with its weights: a resumed stage reads on from the ledger, never
        twice). Its weights are announced like an RL step's."""
        source = await self._supervised_source(stage, name)
        started = self.clock()
        batch = await asyncio.to_thread(source.batch, position, end_position=end_position)
        stats: dict[str, float] = {"loss": 0.0}
        async with self._train_lock:
            with self.busy.busy(), _tracer.start_as_current_span(
                    "supervised_step", attributes={"step": self.step + 1, "stage": name,
                                                   "examples": len(batch.sequences), "tokens": batch.tokens}):
                if batch.sequences:
                    rows = pack_sequences(batch.sequences, source.max_seq_len)
                    result = await asyncio.to_thread(self.backend.sft_step, rows, lr=self.config.lr)
                    stats = result if isinstance(result, dict) else {"loss": float(result)}
                await self._commit_step(
                    self.step + 1, [], batch.groups, new_weights=bool(batch.sequences),
                    cursor={"stage": name, "next_position": batch.next_position,
                            "tokens": tokens_before + batch.tokens})
        if self.config.checkpoint_every and self.step % self.config.checkpoint_every == 0:
            await self.save_checkpoint()  # as an RL step's: weights, optimizer, RNG, pruned to keep_checkpoints
        return {"step": self.step, "weight_version": self.version, "loss": float(stats.get("loss", 0.0)),
                "tokens": batch.tokens, "trained_tokens": batch.trained_tokens,
                "examples": len(batch.sequences), "next_position": batch.next_position, "epoch": batch.epoch,
                "mismatches": batch.mismatches, "bad_rows": batch.bad_rows, "num_rows": source.num_rows,
                "duration_s": self.clock() - started}

    async def reset_optimizers(self) -> None:
        """Fresh optimizer moments with this trainer's settings (a new stage: a restored state
        would carry the last stage's lr). Reloading the weights in place is the backends' way to
        start the optimizer (and the KL reference) afresh."""
        await asyncio.to_thread(lambda: self.backend.load_state_dict(self.backend.state_dict()))

    async def _supervised_source(self, stage: StageConfig, name: str) -> SupervisedSource:
        """The stage's data, opened once (its offset index is built in one pass)."""
        if self._supervised is None or self._supervised.name != name:
            if self._supervised is not None:
                self._supervised.close()
            chat = await self._chat_model()
            max_seq_len = stage.max_seq_len or model_context(self.model_config.path)
            self._supervised = await asyncio.to_thread(SupervisedSource, stage, name, chat, max_seq_len=max_seq_len)
        return self._supervised
