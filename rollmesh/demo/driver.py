"""Drives a running mesh through the demo: warm start, asynchronous RL, periodic held-out evals.

Knows the bus (it is a NATS client like any user's), the trainer actor handle and the task
plugin; the RL itself happens in the actors. The RL is an rl stage fed by the same feeder as a
`rollmesh train` job's (rollmesh/train/feeder.py): groups are kept ``max_groups_ahead`` ahead of
the trainer, so rollouts and training overlap and tokens carry several weight versions.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import structlog

from rollmesh.bus.connection import connect_bus
from rollmesh.bus.publisher import BusPublisher
from rollmesh.bus.security import BusCredentials
from rollmesh.bus.tls import client_tls_context
from rollmesh.config import RollmeshConfig
from rollmesh.demo.curve import RewardCurve
from rollmesh.messages import (
    CheckpointConverted,
    RolloutCompleted,
    RolloutFailed,
    RolloutRequested,
    SamplingParams,
)
from rollmesh.messages.subjects import (
    CHECKPOINT_CONVERTED,
    ROLLOUT_COMPLETED,
    ROLLOUT_FAILED,
    ROLLOUT_REQUESTED,
)
from rollmesh.rollout.tasks import DemonstrableTask, load_task
from rollmesh.run_config import StageConfig
from rollmesh.train.feeder import JobEvents, RlStageFeeder, StepRecord
from rollmesh.train.feeder_cursor import FeederCursor
from rollmesh.train.feeder_window import StagePlan
from rollmesh.train.prompt_source import prompt_source

_log = structlog.get_logger("rollmesh.demo")
DEMO_TASK = "rollmesh.rollout.molar_mass:MolarMassTask"
# Room for the tool call, the tool's output and the answer.
DEMO_SAMPLING = SamplingParams(temperature=1.0, max_new_tokens=40)
DEMO_MAX_TURNS = 4


def demo_rl_stage(config: RollmeshConfig) -> StageConfig:
    """The demo's RL as a stage: the molar-mass task sampling its own formulas."""
    return msgspec.convert({"kind": "rl", "name": "rl", "task": DEMO_TASK, "steps": config.demo.rl_steps,
                            "seed": config.demo.seed, "sampling": msgspec.to_builtins(DEMO_SAMPLING),
                            "max_turns": DEMO_MAX_TURNS}, StageConfig)


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
        self.eval_inputs = self.task.sample_task_inputs(random.Random(self.demo.seed + 1),
                                                        self.demo.eval_size, held_out=True)
        self.curve = RewardCurve()
        self.train_rollouts = 0
        self.failures: dict[str, int] = {}
        self._eval_rewards: dict[str, list[float]] = {}
        self._eval_done: dict[str, asyncio.Event] = {}
        self._eval_counts: dict[str, int] = {}
        self._converted = asyncio.Queue[CheckpointConverted]()
        self._last_version = 0
        self._nc: Any = None

    async def run(self) -> dict[str, Any]:
        nc = self._nc = await connect_bus(self.nats_url, name="rollmesh-demo", connect_timeout_s=10,
                                          credentials=self.credentials,
                                          tls=client_tls_context(self.config.security.nats_tls))
        publisher = BusPublisher(nc, nc.jetstream(), self.config.namespace)
        subscriptions = [
            await nc.subscribe(ROLLOUT_COMPLETED.format(self.config.namespace), cb=self._on_completed),
            await nc.subscribe(ROLLOUT_FAILED.format(self.config.namespace), cb=self._on_failed),
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
        rl_started = time.monotonic()

        def on_step(record: StepRecord) -> None:
            self._last_version = record.weight_version
            self.curve.step_rewards.append(record.reward)
            self.report(f"step {record.step:4d}/{demo.rl_steps}  reward {record.reward:.3f}  "
                        f"weights v{record.weight_version}  {record.tokens_per_s:6.0f} tok/s  "
                        f"trainer idle {record.trainer_idle_pct:3.0f}%  {time.monotonic() - rl_started:6.1f}s")
            if record.step % demo.eval_every == 0 and record.step < demo.rl_steps:
                evaluations.append(asyncio.create_task(self._evaluate(publisher, record.step)))

        stage = demo_rl_stage(self.config)
        plan = StagePlan(name="rl", stage_index=0, steps=demo.rl_steps,
                         groups_per_step=trainer_config.groups_per_step, max_groups_ahead=stage.max_groups_ahead)
        start_step = await self.trainer.step.remote()
        events = JobEvents()
        subscriptions = await events.subscribe(self._nc, self.config.namespace)
        feeder = RlStageFeeder(stage=stage, plan=plan, source=prompt_source(stage, "rl"),
                               cursor=FeederCursor(stage="rl", start_step=start_step), publisher=publisher,
                               events=events, run_dir=self.run_dir, run_name=self.run_dir.name,
                               n_samples_per_prompt=trainer_config.n_samples_per_prompt, report=on_step)
        try:
            await feeder.run(start_step)
        finally:
            for subscription in subscriptions:
                await subscription.unsubscribe()
        self.train_rollouts = feeder.train_rollouts
        for kind, count in feeder.failures.items():
            self.failures[kind] = self.failures.get(kind, 0) + count
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
            sampling=DEMO_SAMPLING, max_turns=DEMO_MAX_TURNS, requested_at=time.time(),
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

    async def _on_failed(self, msg) -> None:
        failed: RolloutFailed = ROLLOUT_FAILED.decode(msg.data)
        if failed.purpose == "eval":
            self.failures[failed.kind] = self.failures.get(failed.kind, 0) + 1
            self._eval_result(failed.group_id, None)

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
