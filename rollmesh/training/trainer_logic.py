"""The trainer's plain logic: admit trajectories, train GRPO steps, publish weight versions.

Knows the training backend, the chat model (supervised sequences), the mesh ports
(rollmesh.ports) and the wire contract; not Ray, not nats-py. Exactly-once: a step's order is
weights file written -> ledger line (its trajectories' idempotency keys; ``ledger.py``) ->
trajectories acknowledged -> weights announced. A trainer killed mid-step loses nothing (its
trajectories were never acknowledged; they are redelivered and trained once by the restarted
trainer, which resumes from the ledger's last weights); one killed after the ledger line
acknowledges the redelivered trajectories without training them again. Checkpoints (every
``checkpoint_every`` steps) also keep the optimizer, RNG and step position
(``training_state.py``), so a restart at a checkpointed step is exact: it trains on as if never
stopped. Admission: the generation lag of a trajectory's tokens (tool waits excluded;
``admission.py``) must be at most ``max_staleness``; the PPO ratio corrects the older tokens. A
rollout cut by ``max_new_tokens`` is trained as is, masked in its group, or trained with a penalty
reward (``overlong``); with ``drop_uniform_groups`` a group whose rewards are all equal is consumed
without counting toward a step (dynamic sampling). A rollout split into several samples (``rollout.history_rewrite = "split"``) is one
group member and one idempotency key; each of its samples trains with the member's advantage.
With ``memory`` (``trainer.weight_sync = "memory"``, ``engine/weight_memory.py``) a version is
put into shared memory and announced first, then written and recorded: workers on this node never
wait on the disk, and ``start`` numbers past any version announced but never made durable. With
``push`` (``"nccl"``/``"ipc"``: SGLang servers) a durable version is pushed into the servers
before it is announced, the files staying the fallback (``trainer_weights.py``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog
from opentelemetry import trace

from rollmesh.ports import (
    MessageContext,
    Publisher,
    RoutedExpertsStore,
    Subscription,
    TrajectoryLostError,
    TrajectoryStore,
)
from rollmesh.chat import ChatModel
from rollmesh.config import ModelConfig, TrainerConfig
from rollmesh.engine.weight_buckets import load_published
from rollmesh.engine.weight_memory import HoldsWeightBuckets
from rollmesh.messages import (
    CheckpointSaved,
    GroupDropped,
    RolloutCompleted,
    RolloutFailed,
    TokenTrace,
    TokenTraceError,
    TrainerStepped,
    WeightsPublished,
)
from rollmesh.messages.subjects import (
    CHECKPOINT_SAVED,
    GROUP_DROPPED,
    ROLLOUT_COMPLETED,
    ROLLOUT_FAILED,
    TRAINER_STEPPED,
    WEIGHTS_PUBLISHED,
)
from rollmesh.rollout.trajectory_offload import load_traces
from rollmesh.training.admission import (
    Group,
    GroupBuffer,
    GroupMember,
    generation_lag,
    summarize_lags,
    version_lag,
)
from rollmesh.training.grpo import PolicySample
from rollmesh.training.heap import return_freed_memory
from rollmesh.training.checkpoint_retention import prune_checkpoints
from rollmesh.training.supervised import SupervisedSource
from rollmesh.training.trainer_supervised import SupervisedTraining
from rollmesh.training.trainer_weights import PushesWeights, WeightPublishing
from rollmesh.training.ledger import LedgerEntry, TrainingLedger
from rollmesh.telemetry import conventions, metrics, metrics_catalog
from rollmesh.training.training_state import restore_training_state, save_training_state
from rollmesh.telemetry.busy_clock import BusyClock

if TYPE_CHECKING:  # the backend (torch) is built by the actor; this module imports without it
    from rollmesh.training.torch_backend import TrainerBackend

_log = structlog.get_logger("rollmesh.trainer")
_tracer = trace.get_tracer("rollmesh.trainer")


class TrainerLogic(SupervisedTraining, WeightPublishing):
    def __init__(
        self,
        config: TrainerConfig,
        model_config: ModelConfig,
        backend: TrainerBackend,
        publisher: Publisher,
        *,
        run_dir: Path,
        clock: Callable[[], float] = time.time,
        routed_experts: RoutedExpertsStore | None = None,
        busy: BusyClock | None = None,
        trajectories: TrajectoryStore | None = None,
        memory: HoldsWeightBuckets | None = None,
        latest_weights: Callable[[], Awaitable[WeightsPublished | None]] | None = None,
        push: PushesWeights | None = None,
    ) -> None:
        self.config = config
        # Each durable version goes into the SGLang servers without files before its announcement.
        self.push = push
        self.push_failures = 0
        # Versions go to shared memory and are announced before their files are written.
        self.memory = memory
        # The newest announced version (the weights stream): what a resumed trainer numbers past.
        self.latest_weights = latest_weights
        # The newest version number announced (memory mode announces before a step is durable,
        # so it can run ahead of ``version``): the next version is numbered past it.
        self._announced = 0
        # Train steps (the policy step and writing its weights) are the trainer's compute: the
        # GPU scheduler's busy time for what the trainer holds.
        self.busy = busy or BusyClock()
        # MoE rollouts' routed-expert rows, for routing replay in the policy step.
        self.routed_experts = routed_experts
        # Long rollouts' traces, fetched at admission when a RolloutCompleted carries a reference.
        self.trajectories = trajectories
        self.model_config = model_config
        self.backend = backend
        self.publisher = publisher
        self.weights_dir = Path(run_dir) / "weights"
        self.checkpoint_dir = Path(run_dir) / "checkpoints"
        self.ledger = TrainingLedger(Path(run_dir) / "trainer" / "ledger.jsonl")
        self.clock = clock
        self.version = 0
        self.step = 0
        self.buffer = GroupBuffer(config.n_samples_per_prompt, drop_uniform=config.drop_uniform_groups)
        # Idempotency keys consumed by a durable step (from the ledger) or waiting in a group.
        self._seen: set[str] = set()
        self._consumed: dict[str, asyncio.Future[None]] = {}
        self._train_lock = asyncio.Lock()
        self._last_weights: WeightsPublished | None = None
        self._chat: ChatModel | None = None
        self.dropped_stale = 0
        self.ungrouped = 0
        self.duplicates = 0
        self.lost_trajectories = 0
        self.skipped_truncated = 0
        self.dropped_groups = 0
        self._supervised: SupervisedSource | None = None
        self.resumed_from_step: int | None = None
        # Trajectories admitted and waiting for the step that trains them.
        metrics.observe(metrics_catalog.QUEUE_DEPTH, self,
                        lambda trainer: [(len(trainer._consumed), {"queue": "trainer", "worker": ""})])

    async def start(self) -> None:
        """Resume from the ledger: the last durable step's weights, version and consumed keys."""
        state = await asyncio.to_thread(self.ledger.read)
        if state is None:
            await self._number_past_announced()
            return
        last = state.last
        if last.weights_path:
            weights = await asyncio.to_thread(load_published, last.weights_path, last.sha256)
            await asyncio.to_thread(self.backend.load_state_dict, weights)
            self._last_weights = WeightsPublished(
                version=last.weight_version, path=last.weights_path, sha256=last.sha256,
                num_bytes=last.num_bytes, trainer_step=last.step, published_at=last.recorded_at)
            # Killed between its ledger line and its announcement, the last version was maybe
            # never announced; announcing it twice is harmless (dedup id, and followers skip it).
            await self.publisher.publish(WEIGHTS_PUBLISHED, self._last_weights)
        self.step, self.version = last.step, last.weight_version
        self._seen.update(state.consumed)  # the data cursor: what was trained, and only that
        self.resumed_from_step = last.step
        # Exact when the last durable step was checkpointed with its optimizer and RNG state;
        # otherwise the weights are exact and the optimizer's moments start afresh.
        exact = last.weights_path != "" and await asyncio.to_thread(
            restore_training_state, self.checkpoint_dir, self.backend, step=last.step, version=last.weight_version)
        await self._number_past_announced()
        _log.info("trainer_resumed", step=self.step, weight_version=self.version,
                  consumed=len(state.consumed), exact=exact)

    def subscriptions(self) -> list[Subscription]:
        # Every trajectory of a step waits un-acked until the step is durable, so the consumer
        # must allow a few steps' worth of messages in flight.
        in_flight = self.config.n_samples_per_prompt * self.config.groups_per_step * 4
        return [
            Subscription(ROLLOUT_COMPLETED, self.handle_completed, "jetstream",
                         durable="trainer_completed", max_concurrent=in_flight),
            Subscription(ROLLOUT_FAILED, self.handle_failed, "jetstream",
                         durable="trainer_failed", max_concurrent=in_flight),
        ]

    def stats(self) -> dict[str, Any]:
        return {"step": self.step, "version": self.version, "dropped_stale": self.dropped_stale,
                "ungrouped": self.ungrouped, "duplicates": self.duplicates,
                "lost_trajectories": self.lost_trajectories, "skipped_truncated": self.skipped_truncated,
                "dropped_groups": self.dropped_groups,
                "resumed_from_step": self.resumed_from_step, "consumed": len(self._seen),
                "push_failures": self.push_failures,
                "open_groups": self.buffer.open_groups(), "ready_groups": len(self.buffer.ready)}

    async def handle_completed(self, message: RolloutCompleted, ctx: MessageContext) -> None:
        if message.purpose != "train" or await self._seen_before(_key(message), ctx):
            return
        if not message.group_id and self.config.n_samples_per_prompt > 1:
            # GRPO needs a group; an ungrouped trajectory would wait forever for its peers.
            self.ungrouped += 1
            return
        reward = message.reward
        if message.finish_reason == "truncated" and self.config.overlong == "mask":
            # Cut by max_new_tokens, and trainer.overlong says not to train such rollouts:
            # counted in its group, so the group completes, but masked out like a failure.
            self.skipped_truncated += 1
            await self._admit(message.group_id or message.rollout_id, GroupMember(_key(message), 0.0, None), ctx)
            return
        if message.finish_reason == "truncated" and self.config.overlong == "penalty":
            reward = self.config.overlong_penalty
        try:
            traces = await self._traces(message)
        except (TrajectoryLostError, TokenTraceError) as exc:
            # Gone (its blob expired) or broken: retrying cannot help. Counted in its group, so
            # the group completes, but masked like a failure.
            self.lost_trajectories += 1
            _log.warning("trajectory_lost", rollout_id=message.rollout_id, error=str(exc))
            await self._admit(message.group_id or message.rollout_id,
                              GroupMember(_key(message), 0.0, None), ctx)
            return
        # A split rollout's samples follow each other in time: their versions in order are the
        # rollout's turns in order (each later sample starts with forced prompt tokens), so the
        # lag is measured over all of them, and the rollout is admitted or dropped whole.
        versions = [version for trace in traces for version in trace.versions]
        lag = generation_lag(versions, self.version)
        metrics.record(metrics_catalog.VERSION_LAG, lag,
                       {"admitted": "true" if lag <= self.config.max_staleness else "false"})
        samples: list[PolicySample] = []
        if lag <= self.config.max_staleness:
            # Never infra_failed: a RolloutCompleted's infra_failures are failures it survived
            # (resumed from its last saved turn, its tokens whole); one that did not survive is
            # a RolloutFailed, counted in its group with no sample (handle_failed). Routed-expert
            # rows follow one sequence's positions: a split rollout's samples train without replay.
            rows = await self._routed_rows(message) if len(traces) == 1 else None
            samples = [PolicySample.from_trace(trace, 0.0, temperature=message.temperature, routed_experts=rows)
                       for trace in traces]
        else:
            self.dropped_stale += 1
        member = GroupMember(_key(message), reward, samples[0] if samples else None, lag,
                             raw_version_lag=version_lag(versions, self.version), split_samples=samples[1:])
        await self._admit(message.group_id or message.rollout_id, member, ctx)

    async def _traces(self, message: RolloutCompleted) -> list[TokenTrace]:
        """The rollout's TokenTraces (one per training sample): inline, or fetched from the
        trajectory store. A store that cannot give them now raises, and the message is
        redelivered (its key forgotten, so the redelivery is admitted rather than taken for a
        duplicate)."""
        try:
            return await load_traces(message, self.trajectories)
        except (TrajectoryLostError, TokenTraceError):
            raise
        except Exception:
            self._seen.discard(_key(message))
            raise

    async def _routed_rows(self, message: RolloutCompleted) -> Any:
        """The rollout's recorded expert rows (MoE models), or None. A store that cannot give
        them now raises, and the trajectory is redelivered rather than trained without replay."""
        if not message.routed_experts_ref or self.routed_experts is None:
            return None
        try:
            return await self.routed_experts.load(message.routed_experts_ref)
        except Exception:
            self._seen.discard(_key(message))  # as in _trace: the redelivery must be admitted
            raise

    async def handle_failed(self, message: RolloutFailed, ctx: MessageContext) -> None:
        if message.purpose != "train" or await self._seen_before(_key(message), ctx):
            return
        if not message.group_id and self.config.n_samples_per_prompt > 1:
            return
        # Counted in its group (so the group completes) but masked out of its statistics.
        await self._admit(message.group_id or message.rollout_id,
                          GroupMember(_key(message), 0.0, None), ctx)

    async def _seen_before(self, key: str, ctx: MessageContext) -> bool:
        """False the first time ``key`` arrives. A repeat (a redelivery, a re-published outcome)
        returns True once the key's step is durable, so it is acknowledged then and not sooner:
        acking a repeat of a trajectory still waiting in a group would ack the trajectory."""
        if key not in self._seen:
            self._seen.add(key)
            return False
        self.duplicates += 1
        pending = self._consumed.get(key)
        if pending is not None:
            await ctx.keep_alive_while(pending)
        return True

    async def _admit(self, group_id: str, member: GroupMember, ctx: MessageContext) -> None:
        consumed = asyncio.get_running_loop().create_future()
        self._consumed[member.rollout_id] = consumed
        group = self.buffer.add(group_id, member)
        if group is not None and group.dropped:
            self.dropped_groups += 1
            rewards = group.rewards()
            await self.publisher.publish(GROUP_DROPPED, GroupDropped(
                group_id=group_id, reward=rewards[0] if rewards else 0.0, step=self.step))
        if len(self.buffer.ready) >= self.config.groups_per_step:
            await self._train_ready_groups()
        # Acked once the step that consumes it is durable; raises if that step failed (the
        # message is then nak'ed and trained on redelivery).
        await ctx.keep_alive_while(consumed)

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
        # In a fixed order (group id, then each member's key), not arrival order: the same
        # trajectories train the same step bit for bit however they arrived (exact resume).
        ordered = [Group(group.group_id, sorted(group.members, key=lambda member: member.rollout_id))
                   for group in sorted(groups, key=lambda group: group.group_id)]
        by_group = [(group, group.trainable_samples()) for group in ordered]
        samples = [sample for _, group_samples in by_group for sample in group_samples]
        # Rollouts trained: the members with samples of the groups that taught something.
        trained = sum(1 for group, group_samples in by_group if group_samples
                      for member in group.members if member.sample)
        rewards = [reward for group in groups for reward in group.rewards()]
        admitted = [member for group in groups for member in group.members if member.sample]
        lags = summarize_lags(member.generation_lag for member in admitted)
        keys = [member.rollout_id for group in groups for member in group.members]
        group_ids = [group.group_id for group in groups]
        dropped = sum(1 for group in groups if group.dropped)
        with self.busy.busy(), _tracer.start_as_current_span(
            conventions.SPAN_TRAIN_STEP,
            attributes={"step": self.step + 1, "samples": len(samples), "groups": len(groups),
                        conventions.RL_TRAINER_STEP: self.step + 1},
        ):
            stats: dict[str, float] = {"loss": 0.0}
            if samples:
                stats = await asyncio.to_thread(self._policy_step, samples)
                await self._commit_step(self.step + 1, keys, group_ids, new_weights=True)
            else:
                await self._commit_step(self.step + 1, keys, group_ids, new_weights=False)
        message = TrainerStepped(
            step=self.step, weight_version=self.version, loss=float(stats.get("loss", 0.0)),
            reward_mean=sum(rewards) / len(rewards) if rewards else 0.0,
            num_samples=len(samples), num_groups=len(groups), max_generation_lag=lags.max,
            dropped_stale=self.dropped_stale, duration_s=self.clock() - started,
            generation_lag_p50=lags.p50, generation_lag_p90=lags.p90, generation_lag_histogram=lags.histogram,
            max_raw_version_lag=max((member.raw_version_lag for member in admitted), default=0),
            num_rollouts=trained, groups=group_ids, dropped_groups=dropped,
            logprob_mismatch=stats.get("logprob_mismatch"),
        )
        await self.publisher.publish(TRAINER_STEPPED, message)
        metrics.record(metrics_catalog.TRAINER_STEP_DURATION, message.duration_s)
        metrics.record(metrics_catalog.TRAINER_STEP_TOKENS, sum(len(sample.tokens) for sample in samples))
        _log.info("trainer_stepped", step=self.step, weight_version=self.version,
                  reward_mean=round(message.reward_mean, 4), samples=len(samples), rollouts=trained)
        if self.config.checkpoint_every and self.step % self.config.checkpoint_every == 0:
            await self.save_checkpoint()

    def _policy_step(self, samples: list[PolicySample]) -> dict[str, float]:
        stats = self.backend.policy_step(samples, current_version=self.version)
        return_freed_memory()  # the step's activations and gradients, back to the OS
        return stats

    async def _commit_step(self, step: int, keys: list[str], group_ids: list[str] = (), *,
                           new_weights: bool, cursor: dict | None = None) -> None:
        """Make a step durable: its weights file (when it trained), then its ledger line; only
        then does the step count, and are its weights announced (with ``memory``: announced
        first, from shared memory, then written and recorded)."""
        if new_weights and self.memory is not None:
            weights = await self._publish_weights_in_memory(step)
        else:
            weights = await self._write_weights(step) if new_weights else self._last_weights
        entry = LedgerEntry(
            step=step, weight_version=weights.version if weights else self.version,
            weights_path=weights.path if weights else "", sha256=weights.sha256 if weights else "",
            num_bytes=weights.num_bytes if weights else 0, keys=keys, recorded_at=self.clock(),
            groups=list(group_ids), cursor=dict(cursor or {}))
        await asyncio.to_thread(self.ledger.append, entry)
        # The version only advances once the step is durable: a failed save must not make the
        # redelivered trajectories look one version staler than they are.
        self.step = step
        if new_weights and weights is not None:
            await self._push_weights(weights.version)
            await self._announce(weights, publish=self.memory is None)

    async def _chat_model(self) -> ChatModel:
        """The model directory's tokenizer and formats, loaded once (a tokenizer load: off the loop)."""
        if self._chat is None:
            self._chat = await asyncio.to_thread(ChatModel.from_config, self.model_config)
        return self._chat

    async def save_checkpoint(self) -> CheckpointSaved:
        """The backend's checkpoint (Megatron torch_dist, which the resharder converts to HF), then
        the training state. The event names the model directory (``model_config["path"]``), whose
        tokenizer files the resharder copies into the export."""
        # The scalar settings only: the wire field holds no nested values (chat_template_kwargs).
        model_config = {field: value for field in self.model_config.__struct_fields__
                        if isinstance(value := getattr(self.model_config, field), (int, float, str, bool))}
        path, layout = await asyncio.to_thread(self.backend.save_checkpoint, self.checkpoint_dir,
                                               iteration=self.step, weight_version=self.version)
        # Written after the weights: a state file always has its step's weights beside it.
        await asyncio.to_thread(save_training_state, self.checkpoint_dir, self.backend,
                                step=self.step, version=self.version)
        message = CheckpointSaved(step=self.step, weight_version=self.version, path=str(path),
                                  format=layout, model_config=model_config)
        await self.publisher.publish(CHECKPOINT_SAVED, message)
        removed = await asyncio.to_thread(prune_checkpoints, self.checkpoint_dir, self.config.keep_checkpoints)
        if removed:
            _log.info("checkpoints_pruned", steps=removed, kept=self.config.keep_checkpoints)
        return message


def _key(message: RolloutCompleted | RolloutFailed) -> str:
    """The trajectory's idempotency key (its rollout id, from publishers that set none)."""
    return message.idempotency_key or message.rollout_id
