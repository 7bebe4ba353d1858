"""Asynchronous RL against synchronous RL on the same resources: trained trajectories per hour.

Both pipelines run in this one process with rollmesh's real logic classes and no Ray or NATS:
``RolloutWorkerLogic`` (the agent loop), ``TrainerLogic`` (admission, GRPO steps, weight versions),
``LocalEngine`` following the trainer's weights through ``WeightFollower``, and a
``SandboxBroker`` with the bubblewrap backend reached through ``InProcessRequester``. An
in-process bus (``InProcessBus`` below) delivers each published message, through its subject's
encoder and decoder, to the handler that consumes it in the mesh, each delivery its own task.
The model is the demo's (a 2-layer Qwen2 directory with its BPE tokenizer and ChatML/Hermes
template, built in the scratch directory); the task is the molar-mass task
whose calculator first sleeps a lognormal time (median 2 s, sigma 1.2, capped at 60 s). The
n-th rollout's delay is the n-th draw of one seeded sequence, carried in its ``task_input``, so
each rollout id has the same delay in both pipelines. The delay is real: ``sleep`` inside the
sandbox, then the calculator. So that the model does call the tool, a supervised warm start on
demonstrations that always use it (``exact_fraction`` 1.0) runs first; both pipelines start from
its weights (version 1: each trainer resumes them from the warm start's ledger). The policy
still learns during the run, and the two pipelines train different numbers of steps, so how
often it calls the tool drifts apart (in a first run the asynchronous policy called it in 84% of
rollouts, the synchronous one in 98%). So that this drift does not change the workload, a
rollout that answers without calling the tool spends its drawn delay anyway, before its
sandbox is released (``EnvironmentTimeClient``): every rollout costs its delay once, whatever
the policy does (more than once only if it calls the tool again). Decoding, sandbox leases,
execs, training and weight loads are all real and share the two cores.

Same resources: one engine (at most ``--slots`` sequences), one trainer (4 groups of 4 = 16
trajectories a step, 2 PPO epochs), ``--slots`` rollout slots, one torch thread each for the
engine (event-loop thread) and the trainer (its worker thread) on this 2-core machine.
- ours (asynchronous): every slot runs rollouts back to back; the trainer trains whenever 4
  groups are complete and the engine swaps in each new version between decode steps, so
  rollouts carry several versions; the trainer drops those past ``max_staleness`` (2).
- baseline (synchronous): generate one step's batch (16 rollouts at once), wait for all of
  them, train, wait until the engine serves the new weights, repeat.

Each runs for ``--seconds`` of wall time from the same warm-started state, the asynchronous
pipeline first (one window each, not alternated in slices: a slice would cut each pipeline's
steady state short, and the synchronous one's steps are ~17 s long). ``ours`` and
``baseline`` count trajectories admitted into train steps that finished inside the window (the
admitted ones of each ``TrainerStepped``: failed and too-stale rollouts excluded), per hour;
``ratio`` = ours / baseline (target >= 3). Also: the trainer's idle fraction (1 - time inside
train steps / wall), the trajectories that carried gradient (``num_samples``: a group whose
rewards are all equal has no advantage), dropped stale ones, and the rollouts' mean duration.

    python benchmarks/async_vs_sync.py [--seconds 120] [--slots 32] [--seed 0]
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import shutil
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from common import print_result
from rollmesh.chat import ChatModel, ToolCall
from rollmesh.config import (
    InferenceConfig, ModelConfig, RolloutConfig, SandboxConfig, SandboxProfileConfig, TrainerConfig,
)
from rollmesh.engine.local_engine import LocalEngine
from rollmesh.engine.weight_follower import WeightFollower
from rollmesh.messages import RolloutCompleted, RolloutRequested, SamplingParams, Subject, TrainerStepped
from rollmesh.messages.subjects import (
    ROLLOUT_COMPLETED, ROLLOUT_FAILED, ROLLOUT_REQUESTED, TRAINER_STEPPED, WEIGHTS_PUBLISHED,
)
from rollmesh.ports import MessageContext
from rollmesh.rollout.agent_loop import RolloutWorkerLogic
from rollmesh.rollout.molar_mass import MolarMassTask
from rollmesh.model_source import ensure_demo_model
from rollmesh.rollout.tasks import SandboxCommand, TaskRegistry
from rollmesh.sandbox import (
    SandboxBroker, SandboxBrokerClient, python_for_sandbox, select_backend, tool_script_path,
)
from rollmesh.sandbox.in_process import InProcessRequester
from rollmesh.telemetry.logging import setup_logging
from rollmesh.training.torch_backend import TorchTrainerBackend
from rollmesh.training.trainer_logic import TrainerLogic

NAMESPACE = "bench"
TOOL_MEDIAN_S, TOOL_SIGMA, TOOL_CAP_S = 2.0, 1.2, 60.0
TRAINER = TrainerConfig(n_samples_per_prompt=4, groups_per_step=4)
SAMPLING = SamplingParams(temperature=1.0, max_new_tokens=40)  # the demo's
MAX_TURNS = 4  # the demo's
WARM_START = dict(steps=120, batch_size=64, lr=3e-3, exact_fraction=1.0)


class DelayedMolarMassTask(MolarMassTask):
    """The molar-mass task whose calculator first sleeps the rollout's drawn delay
    (``task_input["tool_delay_s"]``)."""

    name = "delayed_molar_mass"

    def tool_action(self, call: ToolCall, task_input: dict) -> SandboxCommand:
        delay = float(task_input["tool_delay_s"])
        script = f'sleep {delay:.3f}; exec {python_for_sandbox()} -I -S {tool_script_path("molar_mass")} "$1"'
        return SandboxCommand(["/bin/sh", "-c", script, "sh", self.formula_of(call, task_input)])


class EnvironmentTimeClient(SandboxBrokerClient):
    """The sandbox client, except that a rollout which never called the tool still spends its
    drawn delay, before its sandbox is released: every rollout's environment time is then the
    same in both pipelines, however each policy drifts in how often it calls the calculator."""

    def __init__(self, requester: Any, delays: dict[str, float]) -> None:
        super().__init__(requester)
        self.delays = delays  # rollout id -> seconds
        self._holders: dict[str, str] = {}  # lease id -> rollout id
        self._called: set[str] = set()  # lease ids that ran a tool

    async def lease(self, holder: str, **options: Any) -> Any:
        reply = await super().lease(holder, **options)
        self._holders[reply.lease_id] = holder
        return reply

    async def exec(self, lease_id: str, argv: list[str] | None = None, **options: Any) -> Any:
        self._called.add(lease_id)
        return await super().exec(lease_id, argv, **options)

    async def release(self, lease_id: str, **options: Any) -> None:
        holder = self._holders.pop(lease_id, None)
        cancelled = asyncio.current_task().cancelling()  # the window closed: no more waiting
        if lease_id not in self._called and holder in self.delays and not cancelled:
            await asyncio.sleep(self.delays[holder])
        self._called.discard(lease_id)
        await super().release(lease_id, **options)


class InProcessBus:
    """The ``Publisher`` port inside one process: each published message goes through its
    subject's codec to every handler routed to it, as its own task in ``group`` (as a NATS
    delivery would: the publisher does not wait for the consumer); requests go to the broker."""

    def __init__(self, broker: SandboxBroker, group: asyncio.TaskGroup) -> None:
        self.requester = InProcessRequester(broker)
        self.group = group
        self.routes: dict[Subject, list[Callable[[Any, MessageContext], Awaitable[Any]]]] = defaultdict(list)

    def route(self, subject: Subject, handler: Callable[[Any, MessageContext], Awaitable[Any]]) -> None:
        self.routes[subject].append(handler)

    async def publish(self, subject: Subject, message: Any) -> None:
        delivered = subject.decode(subject.encode(message))
        for handler in self.routes.get(subject, []):
            self.group.create_task(handler(delivered, MessageContext(subject=subject.format(NAMESPACE))))

    async def request(self, subject: Subject, message: Any, timeout_s: float) -> Any:
        return await self.requester.request(subject, message, timeout_s)


class EngineWeights:
    """What ``WeightFollower`` needs of a ``LocalEngine`` (as the decode actor adapts its loop)."""

    def __init__(self, engine: LocalEngine) -> None:
        self.engine = engine

    @property
    def current_version(self) -> int:
        return self.engine.current_version

    def stage_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> bool:
        return self.engine.stage_weights(state_dict, version)

    async def wait_weights_activated(self, version: int) -> int:
        return await self.engine.wait_weights_activated(version)

    def num_active(self) -> int:
        return self.engine.decode_engine.num_active()


class Tally:
    """What one pipeline did inside its window (what finishes after it, while the pipeline is
    being cancelled, is not counted)."""

    def __init__(self) -> None:
        self.started = self.deadline = math.inf
        self.steps: list[TrainerStepped] = []
        self.counted: list[TrainerStepped] = []  # the steps that finished inside the window
        self.stepped = asyncio.Condition()
        self.durations: list[float] = []
        self.tool_calls = 0
        self.without_tool = 0
        self.rollouts = 0

    def open_window(self, seconds: float) -> None:
        self.started = time.monotonic()
        self.deadline = self.started + seconds

    def in_window(self) -> bool:
        return self.started <= time.monotonic() <= self.deadline

    async def on_stepped(self, message: TrainerStepped, ctx: MessageContext) -> None:
        if self.in_window():
            self.counted.append(message)
        async with self.stepped:
            self.steps.append(message)
            self.stepped.notify_all()

    async def on_completed(self, message: RolloutCompleted, ctx: MessageContext) -> None:
        if not self.in_window():
            return
        self.rollouts += 1
        self.tool_calls += message.tool_calls
        self.without_tool += message.tool_calls == 0
        self.durations.append(message.duration_s)

    async def on_failed(self, message: Any, ctx: MessageContext) -> None:
        self.rollouts += self.in_window()

    async def wait_steps(self, count: int) -> None:
        async with self.stepped:
            await self.stepped.wait_for(lambda: len(self.steps) >= count)

    def summary(self) -> dict[str, Any]:
        steps, wall_s = self.counted, self.deadline - self.started
        trained = sum(sum(step.generation_lag_histogram.values()) for step in steps)
        train_s = sum(step.duration_s for step in steps)
        return {
            "per_hour": round(trained * 3600 / wall_s, 1), "trained": trained, "steps": len(steps),
            "with_gradient": sum(step.num_samples for step in steps),
            "trainer_idle": round(1 - train_s / wall_s, 4), "wall_s": round(wall_s, 1),
            "train_step_s": round(train_s / max(1, len(steps)), 3),
            # TrainerStepped counts the trainer's stale drops so far.
            "dropped_stale": steps[-1].dropped_stale if steps else 0, "rollouts_finished": self.rollouts,
            "rollout_mean_s": round(statistics.fmean(self.durations), 2) if self.durations else 0.0,
            "tool_calls_per_rollout": round(self.tool_calls / max(1, len(self.durations)), 3),
            "rollouts_without_tool": self.without_tool,
            "reward_mean": round(statistics.fmean(step.reward_mean for step in steps), 3) if steps else 0.0,
        }


def requests(seed: int, task: MolarMassTask, delays: dict[str, float]) -> Iterator[RolloutRequested]:
    """Groups of ``n_samples_per_prompt`` rollouts on one formula each; each rollout has its own delay, the
    n-th rollout the n-th draw of one seeded sequence (so the same in both pipelines)."""
    inputs, draws = random.Random(seed), random.Random(seed + 1)
    for index in range(10**9):
        task_input = task.sample_task_inputs(inputs, 1, held_out=False)[0]
        for member in range(TRAINER.n_samples_per_prompt):
            rollout_id = f"g{index:06d}-{member}"
            delays[rollout_id] = min(TOOL_CAP_S, draws.lognormvariate(math.log(TOOL_MEDIAN_S), TOOL_SIGMA))
            yield RolloutRequested(
                rollout_id=rollout_id, task=task.name,
                task_input={**task_input, "tool_delay_s": round(delays[rollout_id], 3)},
                group_id=f"g{index:06d}", purpose="train", sampling=SAMPLING, max_turns=MAX_TURNS,
                requested_at=time.time())


async def warm_start(model: ModelConfig, scratch: Path, seed: int) -> Path:
    """The warm-started trainer's run directory (its ledger names weights version 1)."""
    run_dir = scratch / "warm"
    logic = TrainerLogic(TRAINER, model, TorchTrainerBackend(model, TRAINER), _Discard(), run_dir=run_dir)
    result = await logic.warm_start(MolarMassTask(), seed=seed, **WARM_START)
    print(f"warm start: {WARM_START['steps']} steps, loss {result['loss']:.3f}", flush=True)
    return run_dir


class _Discard:
    async def publish(self, subject: Subject, message: Any) -> None:
        pass

    async def request(self, subject: Subject, message: Any, timeout_s: float) -> Any:
        raise TypeError("no requests during the warm start")


async def run_pipeline(mode: str, model: ModelConfig, *, seconds: float, slots: int, seed: int, warm_dir: Path,
                       scratch: Path) -> dict[str, Any]:
    run_dir = scratch / mode
    (run_dir / "trainer").mkdir(parents=True)
    shutil.copy(warm_dir / "trainer" / "ledger.jsonl", run_dir / "trainer" / "ledger.jsonl")
    sandbox_config = SandboxConfig(backend="bwrap", profiles={
        "default": SandboxProfileConfig(warm_min=4, warm_max=slots)})
    broker = SandboxBroker(sandbox_config, select_backend("bwrap"), snapshot_dir=run_dir / "snapshots")
    engine = LocalEngine(model, InferenceConfig(max_batch=slots), seed=seed)
    task = DelayedMolarMassTask()
    delays: dict[str, float] = {}
    tally = Tally()
    try:
        async with asyncio.TaskGroup() as group:
            bus = InProcessBus(broker, group)
            group.create_task(broker.run_timers())
            await engine.start()
            trainer = TrainerLogic(TRAINER, model, TorchTrainerBackend(model, TRAINER), bus, run_dir=run_dir)
            follower = WeightFollower(EngineWeights(engine), bus, worker="engine", role="decode")
            bus.route(WEIGHTS_PUBLISHED, follower.handle_weights_published)
            bus.route(ROLLOUT_COMPLETED, trainer.handle_completed)
            bus.route(ROLLOUT_FAILED, trainer.handle_failed)
            bus.route(ROLLOUT_COMPLETED, tally.on_completed)
            bus.route(ROLLOUT_FAILED, tally.on_failed)
            bus.route(TRAINER_STEPPED, tally.on_stepped)
            await trainer.start()  # resumes the warm start's weights and announces them
            await engine.wait_weights_activated(trainer.version)
            await asyncio.sleep(2.0)  # let the warm pool fill, as it would in a running mesh
            rollout_config = RolloutConfig(max_concurrent=slots, tool_timeout_s=TOOL_CAP_S + 30,
                                           progress_events=False)
            sandbox = EnvironmentTimeClient(bus, delays)
            runner = RolloutWorkerLogic(rollout_config, model, chat=ChatModel.from_config(model), tasks=TaskRegistry([task]),
                                   engine=engine, publisher=bus, sandbox=sandbox)
            work = requests(seed, task, delays)
            drive = drive_async if mode == "async" else drive_sync
            tally.open_window(seconds)
            try:
                async with asyncio.timeout(seconds):
                    await drive(runner, work, tally, engine, slots)
            except TimeoutError:
                pass
            raise _WindowClosed()
    except* _WindowClosed:
        pass
    finally:
        await engine.stop()
        await broker.close()
    return tally.summary()


def request_context() -> MessageContext:
    return MessageContext(subject=ROLLOUT_REQUESTED.format(NAMESPACE))


class _WindowClosed(Exception):
    """Raised inside the task group when the window ends: it cancels every delivery still running."""


async def drive_async(runner: RolloutWorkerLogic, work: Iterator[RolloutRequested], tally: Tally,
                      engine: LocalEngine, slots: int) -> None:
    async def slot() -> None:
        for request in work:  # the next request as soon as this slot is free
            await runner.handle_requested(request, request_context())

    async with asyncio.TaskGroup() as group:
        for _ in range(slots):
            group.create_task(slot())


async def drive_sync(runner: RolloutWorkerLogic, work: Iterator[RolloutRequested], tally: Tally,
                     engine: LocalEngine, slots: int) -> None:
    batch_size = TRAINER.n_samples_per_prompt * TRAINER.groups_per_step
    limit = asyncio.Semaphore(slots)

    async def one(request: RolloutRequested) -> None:
        async with limit:
            await runner.handle_requested(request, request_context())

    while True:
        batch = [next(work) for _ in range(batch_size)]
        async with asyncio.TaskGroup() as group:
            for request in batch:
                group.create_task(one(request))
        await tally.wait_steps(len(tally.steps) + 1)
        # On-policy: the next batch is generated by the weights this step produced.
        await engine.wait_weights_activated(tally.steps[-1].weight_version)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=120.0, help="wall time of each pipeline")
    parser.add_argument("--slots", type=int, default=32, help="concurrent rollouts")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    setup_logging("bench-async-vs-sync", "warning")
    results = {}
    with tempfile.TemporaryDirectory(prefix="rollmesh-bench-async-") as scratch:
        model = ModelConfig(path=str(ensure_demo_model(Path(scratch) / "demo-model", seed=args.seed)))
        torch.set_num_threads(2)  # the warm start has the machine to itself
        warm_dir = asyncio.run(warm_start(model, Path(scratch), args.seed))
        # The engine steps on the event-loop thread and the trainer in its worker thread: one
        # torch thread each fills the two cores without oversubscribing them.
        torch.set_num_threads(1)
        for mode in ("async", "sync"):
            results[mode] = asyncio.run(run_pipeline(
                mode, model, seconds=args.seconds, slots=args.slots, seed=args.seed, warm_dir=warm_dir,
                scratch=Path(scratch)))
            print(mode, results[mode], flush=True)
    ours, base = results["async"], results["sync"]
    print_result(
        "async_vs_sync", ours["per_hour"], base["per_hour"], "trained trajectories per hour",
        ours["per_hour"] / base["per_hour"] if base["per_hour"] else float("inf"),
        trainer_idle_ours=ours["trainer_idle"], trainer_idle_baseline=base["trainer_idle"],
        ours_detail=ours, baseline_detail=base, seconds=args.seconds, slots=args.slots, seed=args.seed,
        n_samples_per_prompt=TRAINER.n_samples_per_prompt, groups_per_step=TRAINER.groups_per_step,
        max_staleness=TRAINER.max_staleness, tool_delay=f"lognormal median {TOOL_MEDIAN_S}s sigma "
        f"{TOOL_SIGMA} cap {TOOL_CAP_S}s", sandbox="bwrap (in-process broker)",
    )


if __name__ == "__main__":
    main()
