"""The trainer's plain logic: admit trajectories, train GRPO steps, publish weight versions.

Knows the training backend, the mesh ports (rollmesh.ports) and the wire contract; not Ray, not nats-py. A
trajectory's JetStream message is acknowledged only when the step that consumed it has written
its new weights (or the trajectory was rejected), so a trainer killed mid-step loses nothing; a
redelivered trajectory is recognised by its rollout_id and never trained twice.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog
from opentelemetry import trace

from rollmesh.ports import MessageContext, Publisher, Subscription
from rollmesh.checkpoint.torch_format import save_torch_checkpoint
from rollmesh.config import ModelConfig, TrainerConfig
from rollmesh.engine.tokenizer import ByteTokenizer
from rollmesh.engine.weights import save_weights
from rollmesh.messages import (
    CheckpointSaved,
    RolloutCompleted,
    RolloutFailed,
    TrainerStepped,
    WeightsPublished,
)
from rollmesh.messages.subjects import (
    CHECKPOINT_SAVED,
    ROLLOUT_COMPLETED,
    ROLLOUT_FAILED,
    TRAINER_STEPPED,
    WEIGHTS_PUBLISHED,
)
from rollmesh.rollout.tasks import DemonstrableTask
from rollmesh.training.admission import Group, GroupBuffer, GroupMember, version_lag
from rollmesh.training.grpo import PolicySample
from rollmesh.training.torch_backend import TrainerBackend
from rollmesh.training.warm_start import demonstration_batch

_log = structlog.get_logger("rollmesh.trainer")
_tracer = trace.get_tracer("rollmesh.trainer")

# Weight files older than this many versions behind the newest are deleted.
KEEP_WEIGHT_FILES = 8
# How often a waiting trajectory tells JetStream it is still being worked on.
IN_PROGRESS_EVERY_S = 10.0


class TrainerLogic:
    def __init__(
        self,
        config: TrainerConfig,
        model_config: ModelConfig,
        backend: TrainerBackend,
        publisher: Publisher,
        *,
        run_dir: Path,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self.model_config = model_config
        self.backend = backend
        self.publisher = publisher
        self.weights_dir = Path(run_dir) / "weights"
        self.checkpoint_dir = Path(run_dir) / "checkpoints"
        self.clock = clock
        self.version = 0
        self.step = 0
        self.buffer = GroupBuffer(config.group_size)
        self._seen: set[str] = set()
        self._consumed: dict[str, asyncio.Future[None]] = {}
        self._train_lock = asyncio.Lock()
        self.dropped_stale = 0
        self.ungrouped = 0

    def subscriptions(self) -> list[Subscription]:
        # Every trajectory of a step waits un-acked until the step is durable, so the consumer
        # must allow a few steps' worth of messages in flight.
        in_flight = self.config.group_size * self.config.groups_per_step * 4
        return [
            Subscription(ROLLOUT_COMPLETED, self.handle_completed, "jetstream",
                         durable="trainer_completed", max_concurrent=in_flight),
            Subscription(ROLLOUT_FAILED, self.handle_failed, "jetstream",
                         durable="trainer_failed", max_concurrent=in_flight),
        ]

    def stats(self) -> dict[str, Any]:
        return {"step": self.step, "version": self.version, "dropped_stale": self.dropped_stale,
                "ungrouped": self.ungrouped,
                "open_groups": self.buffer.open_groups(), "ready_groups": len(self.buffer.ready)}

    async def handle_completed(self, message: RolloutCompleted, ctx: MessageContext) -> None:
        if message.purpose != "train" or not self._first_time(message.rollout_id):
            return
        if not message.group_id and self.config.group_size > 1:
            # GRPO needs a group; an ungrouped trajectory would wait forever for its peers.
            self.ungrouped += 1
            return
        lag = version_lag(message.versions, self.version)
        sample = None
        if lag <= self.config.max_staleness:
            sample = PolicySample(message.tokens, message.loss_mask, message.logprobs, 0.0)
        else:
            self.dropped_stale += 1
        await self._admit(message.group_id or message.rollout_id,
                          GroupMember(message.rollout_id, message.reward, sample, lag), ctx)

    async def handle_failed(self, message: RolloutFailed, ctx: MessageContext) -> None:
        if message.purpose != "train" or not self._first_time(message.rollout_id):
            return
        if not message.group_id and self.config.group_size > 1:
            return
        await self._admit(message.group_id or message.rollout_id,
                          GroupMember(message.rollout_id, 0.0, None), ctx)

    def _first_time(self, rollout_id: str) -> bool:
        if rollout_id in self._seen:
            return False
        self._seen.add(rollout_id)
        return True

    async def _admit(self, group_id: str, member: GroupMember, ctx: MessageContext) -> None:
        consumed = asyncio.get_running_loop().create_future()
        self._consumed[member.rollout_id] = consumed
        self.buffer.add(group_id, member)
        if len(self.buffer.ready) >= self.config.groups_per_step:
            await self._train_ready_groups()
        while not consumed.done():
            await asyncio.wait({consumed}, timeout=IN_PROGRESS_EVERY_S)
            if not consumed.done():
                await ctx.in_progress()
        consumed.result()

    async def _train_ready_groups(self) -> None:
        async with self._train_lock:
            while len(self.buffer.ready) >= self.config.groups_per_step:
                groups = self.buffer.take(self.config.groups_per_step)
                try:
                    await self._train_step(groups)
                except BaseException as exc:
                    self._settle(groups, exc)
                    raise
                self._settle(groups, None)

    def _settle(self, groups: list[Group], error: BaseException | None) -> None:
        for group in groups:
            for member in group.members:
                future = self._consumed.pop(member.rollout_id, None)
                if future is None or future.done():
                    continue
                if error is None:
                    future.set_result(None)
                else:
                    # Not durable: forget it so the redelivery is trained, and nak this one.
                    self._seen.discard(member.rollout_id)
                    future.set_exception(RuntimeError(f"train step failed: {error!r}"))

    async def _train_step(self, groups: list[Group]) -> None:
        started = self.clock()
        samples = [sample for group in groups for sample in group.trainable_samples()]
        rewards = [reward for group in groups for reward in group.rewards()]
        lags = [member.version_lag for group in groups for member in group.members if member.sample]
        with _tracer.start_as_current_span(
            "train_step", attributes={"step": self.step + 1, "samples": len(samples),
                                      "groups": len(groups)},
        ):
            stats: dict[str, float] = {"loss": 0.0}
            if samples:
                stats = await asyncio.to_thread(self.backend.policy_step, samples)
                await self._publish_weights(trainer_step=self.step + 1)
            self.step += 1
        message = TrainerStepped(
            step=self.step, weight_version=self.version, loss=float(stats.get("loss", 0.0)),
            reward_mean=sum(rewards) / len(rewards) if rewards else 0.0,
            num_samples=len(samples), num_groups=len(groups), max_version_lag=max(lags, default=0),
            dropped_stale=self.dropped_stale, duration_s=self.clock() - started,
        )
        await self.publisher.publish(TRAINER_STEPPED, message)
        _log.info("trainer_stepped", step=self.step, weight_version=self.version,
                  reward_mean=round(message.reward_mean, 4), samples=len(samples))
        if self.config.checkpoint_every and self.step % self.config.checkpoint_every == 0:
            await self.save_checkpoint()

    async def _publish_weights(self, *, trainer_step: int) -> WeightsPublished:
        # The version only advances once its file is written and announced: a failed save must
        # not make the redelivered trajectories look one version staler than they are.
        version = self.version + 1
        with _tracer.start_as_current_span("weights_publish", attributes={"weight_version": version}):
            path = self.weights_dir / f"v{version:06d}.safetensors"
            sha256, num_bytes = await asyncio.to_thread(save_weights, self.backend.state_dict(), path)
            message = WeightsPublished(version=version, path=str(path), sha256=sha256,
                                       num_bytes=num_bytes, trainer_step=trainer_step,
                                       published_at=self.clock())
            await self.publisher.publish(WEIGHTS_PUBLISHED, message)
        self.version = version
        stale = self.weights_dir / f"v{version - KEEP_WEIGHT_FILES:06d}.safetensors"
        stale.unlink(missing_ok=True)
        return message

    async def warm_start(self, task: DemonstrableTask, *, steps: int, batch_size: int, lr: float,
                         tool_fraction: float, seed: int) -> dict[str, float]:
        """Supervised warm start on the task's demonstrations, then publish the new version."""
        tokenizer = ByteTokenizer(self.model_config.vocab_size)
        rng = random.Random(seed)
        loss = float("nan")
        with _tracer.start_as_current_span("warm_start", attributes={"steps": steps}):
            for _ in range(steps):
                batch = demonstration_batch(task, tokenizer, rng, size=batch_size,
                                            tool_fraction=tool_fraction)
                loss = await asyncio.to_thread(self.backend.sft_step, batch, lr=lr)
            if steps:
                await self._publish_weights(trainer_step=self.step)
        return {"loss": loss, "weight_version": self.version}

    async def save_checkpoint(self) -> CheckpointSaved:
        path = self.checkpoint_dir / f"step_{self.step:08d}"
        model_config = {field: getattr(self.model_config, field) for field in self.model_config.__struct_fields__}
        await asyncio.to_thread(save_torch_checkpoint, path, self.backend.state_dict(),
                                model_config=model_config, step=self.step, weight_version=self.version)
        message = CheckpointSaved(step=self.step, weight_version=self.version, path=str(path),
                                  format="torch", model_config=model_config)
        await self.publisher.publish(CHECKPOINT_SAVED, message)
        return message
