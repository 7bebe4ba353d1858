"""Drives a running mesh through the demo: warm start, asynchronous RL, periodic held-out evals.

Knows the bus (it is a NATS client like any user's), the trainer actor handle and the task
plugin; the RL itself happens in the actors. Training requests are kept ``DEMO_GROUPS_AHEAD`` groups
ahead of the trainer, so rollouts and training overlap and tokens carry several weight versions.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog

from rollmesh.bus.connection import connect_bus
from rollmesh.bus.security import BusCredentials
from rollmesh.bus.tls import client_tls_context
from rollmesh.bus.publisher import BusPublisher
from rollmesh.config import RollmeshConfig
from rollmesh.demo.curve import RewardCurve
from rollmesh.messages import (
    CheckpointConverted,
    RolloutCompleted,
    RolloutFailed,
    RolloutRequested,
    SamplingParams,
    TrainerStepped,
)
from rollmesh.messages.subjects import (
    CHECKPOINT_CONVERTED,
    ROLLOUT_COMPLETED,
    ROLLOUT_FAILED,
    ROLLOUT_REQUESTED,
    TRAINER_STEPPED,
)
from rollmesh.rollout.tasks import DemonstrableTask, load_task

_log = structlog.get_logger("rollmesh.demo")
DEMO_TASK = "rollmesh.rollout.molar_mass:MolarMassTask"
# Room for the tool call, the tool's output and the answer.
MAX_NEW_TOKENS = 40
# Training groups kept in flight beyond what the trainer consumed (two steps' worth).
DEMO_GROUPS_AHEAD = 32


class DemoDriver:
    def __init__(self, config: RollmeshConfig, *, nats_url: str, trainer: Any, run_dir: Path,
                 report: Callable[[str], None] = print, credentials: BusCredentials | None = None) -> None:
        """``credentials``: with security.enabled, the mesh's own (the demo runs in the process
        that launched the mesh, and also follows checkpoint conversions, which clients may not)."""
        self.config = config
        self.demo = config.demo
        self.nats_url = nats_url
        self.credentials = credentials
        self.trainer = trainer
        self.run_dir = Path(run_dir)
        self.report = report
        self.task: DemonstrableTask = load_task(DEMO_TASK)  # type: ignore[assignment]
        self.rng = random.Random(self.demo.seed)
        self.eval_inputs = self.task.sample_task_inputs(random.Random(self.demo.seed + 1),
                                                        self.demo.eval_size, held_out=True)
        self.curve = RewardCurve()
        self.groups_published = 0
        self.train_rollouts = 0
        self.failures: dict[str, int] = {}
        self._eval_rewards: dict[str, list[float]] = {}
        self._eval_done: dict[str, asyncio.Event] = {}
        self._eval_counts: dict[str, int] = {}
        self._stepped = asyncio.Queue[TrainerStepped]()
        self._converted = asyncio.Queue[CheckpointConverted]()
        self._last_version = 0

    async def run(self) -> dict[str, Any]:
        nc = await connect_bus(self.nats_url, name="rollmesh-demo", connect_timeout_s=10,
                               credentials=self.credentials,
                               tls=client_tls_context(self.config.security.nats_tls))
        publisher = BusPublisher(nc, nc.jetstream(), self.config.namespace)
        subscriptions = [
            await nc.subscribe(ROLLOUT_COMPLETED.format(self.config.namespace), cb=self._on_completed),
            await nc.subscribe(ROLLOUT_FAILED.format(self.config.namespace), cb=self._on_failed),
            await nc.subscribe(TRAINER_STEPPED.format(self.config.namespace), cb=self._on_stepped),
            await nc.subscribe(CHECKPOINT_CONVERTED.format(self.config.namespace), cb=self._on_converted),
        ]
        try:
            return await self._run(publisher)
        finally:
            for subscription in subscriptions:
                await subscription.unsubscribe()
            await nc.close()

    async def _run(self, publisher: BusPublisher) -> dict[str, Any]:
        started = time.monotonic()
        demo, trainer_config = self.demo, self.config.trainer
        warm = await self.trainer.warm_start.remote(
            DEMO_TASK, steps=demo.sft_steps, batch_size=demo.sft_batch, lr=demo.sft_lr,
            exact_fraction=demo.warm_start_exact_fraction, seed=demo.seed)
        warm_start_s = time.monotonic() - started
        self.report(f"warm start: {demo.sft_steps} supervised steps in {warm_start_s:.1f}s "
                    f"(loss {warm['loss']:.3f}), weights v{warm['weight_version']}")
        # The baseline evaluation finishes before any training request exists, so it measures the
        # warm-started weights alone; later ones run alongside training.
        self.curve.evaluations.append(await self._evaluate(publisher, 0))
        evaluations: list[asyncio.Task[tuple[int, float]]] = []
        window = trainer_config.groups_per_step + DEMO_GROUPS_AHEAD
        total_groups = demo.rl_steps * trainer_config.groups_per_step
        rl_started = time.monotonic()
        while self.groups_published < min(window, total_groups):
            await self._publish_group(publisher)
        for step in range(1, demo.rl_steps + 1):
            stepped = await self._stepped.get()
            self._last_version = stepped.weight_version
            self.curve.step_rewards.append(stepped.reward_mean)
            self.report(f"step {stepped.step:4d}/{demo.rl_steps}  reward {stepped.reward_mean:.3f}  "
                        f"weights v{stepped.weight_version}  samples {stepped.num_samples:3d}  "
                        f"max lag {stepped.max_version_lag}  {time.monotonic() - rl_started:6.1f}s")
            consumed = stepped.step * trainer_config.groups_per_step
            while self.groups_published < min(consumed + window, total_groups):
                await self._publish_group(publisher)
            if step % demo.eval_every == 0 and step < demo.rl_steps:
                evaluations.append(asyncio.create_task(self._evaluate(publisher, step)))
        evaluations.append(asyncio.create_task(self._evaluate(publisher, demo.rl_steps)))
        self.curve.evaluations.extend(await asyncio.gather(*evaluations))
        rl_s = time.monotonic() - rl_started
        checkpoint = await self.trainer.save_checkpoint.remote()
        converted = await asyncio.wait_for(self._converted.get(), timeout=120)
        summary = self.curve.summary(
            rollouts=self.train_rollouts, weight_versions=self._last_version,
            warm_start_s=round(warm_start_s, 2), rl_s=round(rl_s, 2),
            wall_s=round(time.monotonic() - started, 2), failures=self.failures,
            checkpoint=checkpoint, hf_export=converted.hf_path,
        )
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        self.curve.plot(self.run_dir / "reward_curve.png")
        return summary

    async def _publish_group(self, publisher: BusPublisher) -> None:
        index = self.groups_published
        self.groups_published += 1
        task_input = self.task.sample_task_inputs(self.rng, 1, held_out=False)[0]
        group_id = f"train-{index:06d}"
        for member in range(self.config.trainer.n_samples_per_prompt):
            await publisher.publish(ROLLOUT_REQUESTED, self._request(
                f"{group_id}-{member}", task_input, group_id=group_id, purpose="train"))

    async def _evaluate(self, publisher: BusPublisher, step: int) -> tuple[int, float]:
        """Held-out prompts never trained on; sampled like training so the numbers compare."""
        key = f"eval-{step:06d}"
        self._eval_rewards[key] = []
        done = self._eval_done[key] = asyncio.Event()
        for index, task_input in enumerate(self.eval_inputs):
            await publisher.publish(ROLLOUT_REQUESTED, self._request(
                f"{key}-{index}", task_input, group_id=key, purpose="eval"))
        await done.wait()
        rewards = self._eval_rewards[key]
        mean = sum(rewards) / len(rewards) if rewards else 0.0
        self.report(f"eval after step {step}: held-out reward {mean:.3f} over {len(rewards)} prompts")
        return step, mean

    def _request(self, rollout_id: str, task_input: dict[str, Any], *, group_id: str,
                 purpose: str) -> RolloutRequested:
        return RolloutRequested(
            rollout_id=f"{self.config.namespace}-{rollout_id}", task=self.task.name,
            task_input=task_input, group_id=group_id, purpose=purpose,  # type: ignore[arg-type]
            sampling=SamplingParams(temperature=1.0, max_new_tokens=MAX_NEW_TOKENS),
            max_turns=4, requested_at=time.time(),
        )

    def _eval_result(self, group_id: str, reward: float | None) -> None:
        rewards = self._eval_rewards.get(group_id)
        if rewards is None:
            return
        # A failed eval rollout is an infrastructure outcome: it is counted, not scored.
        if reward is not None:
            rewards.append(reward)
        self._eval_counts[group_id] = self._eval_counts.get(group_id, 0) + 1
        if self._eval_counts[group_id] >= len(self.eval_inputs):
            self._eval_done[group_id].set()

    async def _on_completed(self, msg) -> None:
        completed: RolloutCompleted = ROLLOUT_COMPLETED.decode(msg.data)
        if completed.purpose == "eval":
            self._eval_result(completed.group_id, completed.reward)
        else:
            self.train_rollouts += 1

    async def _on_failed(self, msg) -> None:
        failed: RolloutFailed = ROLLOUT_FAILED.decode(msg.data)
        self.failures[failed.kind] = self.failures.get(failed.kind, 0) + 1
        if failed.purpose == "eval":
            self._eval_result(failed.group_id, None)

    async def _on_stepped(self, msg) -> None:
        await self._stepped.put(TRAINER_STEPPED.decode(msg.data))

    async def _on_converted(self, msg) -> None:
        await self._converted.put(CHECKPOINT_CONVERTED.decode(msg.data))


async def run_demo(config: RollmeshConfig, *, run_dir: Path | None = None,
                   report: Callable[[str], None] = print) -> dict[str, Any]:
    """Start a mesh, run the demo on it, write summary.json and reward_curve.png, stop the mesh."""
    from rollmesh.launcher import Mesh

    mesh = Mesh(config, run_dir=run_dir)
    info = await mesh.start()
    report(f"mesh up: run directory {info.run_dir}, NATS {info.nats_url}")
    try:
        driver = DemoDriver(config, nats_url=info.nats_url, trainer=mesh.trainer,
                            run_dir=Path(info.run_dir), report=report,
                            credentials=mesh.runtime.bus_credentials.get("mesh"))
        return await driver.run()
    finally:
        await mesh.stop()
