"""Soak: 2,000 short rollouts through the whole mesh; does any actor's memory keep growing?

The whole mesh as ``rollmesh up`` starts it (``rollmesh.launcher.Mesh``: embedded
nats-server, local Ray, every role as a Ray actor; Serve off), the demo model (``model.path``
empty: built into the run directory), the molar-mass task in bubblewrap sandboxes. A supervised
warm start (150 steps of 64 demonstrations, every one calling the calculator; about 30 s) first
makes the model call the tool and often answer right, so rollouts lease a sandbox and exec in
it, and rewards differ within a group so the trainer really trains and publishes weight
versions that the inference workers follow. (After the tests' 60 steps of 32, sampled rollouts got every reward 0: the
trainer then commits steps without training, which would soak nothing of it.) Rollouts are short (at most 2
turns of at most 24 new tokens), purpose "train", in GRPO groups of 4 with 4 groups a step, so
2,000 rollouts make about 125 trainer steps. Requests go over JetStream like any client's
(``rollmesh submit``), kept ``--window`` ahead of the results so the queue never runs dry.

Each actor's RSS (``VmRSS`` of ``/proc/<pid>/status``, the pid from the actor's ``pid()``) is
read after the first ``--warmup`` rollouts finished and again after the last. ``ours`` is the
RSS at the end and ``baseline`` the RSS after the warm-up, both for the actor that grew most
(relatively); ``ratio`` = baseline / ours (target >= 0.9: under ~11% growth over 1,800
rollouts). Also: throughput (rollouts/s over all of them and after the warm-up), failures by
kind, trainer steps, and every actor's RSS read every ``--warmup`` rollouts (``rss_series_mib``):
two readings cannot tell a leak from an allocator's swings, a series can.

    python benchmarks/soak.py [--rollouts 2000] [--warmup 200] [--window 64]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import shutil
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path

import ray

from common import print_result
from rollmesh.bus.connection import connect_bus
from rollmesh.bus.publisher import BusPublisher
from rollmesh.config import load_config
from rollmesh.launcher import Mesh
from rollmesh.messages import RolloutRequested, SamplingParams
from rollmesh.messages.subjects import ROLLOUT_COMPLETED, ROLLOUT_FAILED, ROLLOUT_REQUESTED, TRAINER_STEPPED
from rollmesh.rollout.molar_mass import MolarMassTask

TASK = "rollmesh.rollout.molar_mass:MolarMassTask"
GROUP_SIZE, GROUPS_PER_STEP = 4, 4
SAMPLING = SamplingParams(temperature=1.0, max_new_tokens=24)
MAX_TURNS = 2


class Results:
    """Counts the outcomes a plain NATS subscription sees, and wakes whoever waits for a count."""

    def __init__(self) -> None:
        self.finished = 0
        self.failures: Counter[str] = Counter()
        self.rewards: list[float] = []
        self.tool_calls = 0
        self.sample = ""
        self.steps = 0
        self.changed = asyncio.Event()

    async def on_completed(self, msg) -> None:
        completed = ROLLOUT_COMPLETED.decode(msg.data)
        self.rewards.append(completed.reward)
        self.tool_calls += completed.tool_calls
        self.sample = completed.text
        self._finish()

    async def on_failed(self, msg) -> None:
        self.failures[ROLLOUT_FAILED.decode(msg.data).kind] += 1
        self._finish()

    async def on_stepped(self, msg) -> None:
        self.steps += 1

    def _finish(self) -> None:
        self.finished += 1
        self.changed.set()

    async def wait_finished(self, count: int) -> None:
        while self.finished < count:
            self.changed.clear()
            await self.changed.wait()


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")


async def actor_rss_mib(mesh: Mesh) -> dict[str, float]:
    pids = {name: await handle.pid.remote() for name, handle in mesh.actors.items()}
    return {name: round(rss_kib(pid) / 1024, 1) for name, pid in sorted(pids.items())}


async def wait_serving(mesh: Mesh, version: int, timeout_s: float = 60.0) -> None:
    """Until every inference worker serves ``version`` (they follow it over NATS)."""
    deadline = time.monotonic() + timeout_s
    for worker in [*mesh.prefill_workers, *mesh.decode_workers]:
        while await worker.current_version.remote() < version:
            if time.monotonic() > deadline:
                raise TimeoutError(f"inference workers did not load weights v{version}")
            await asyncio.sleep(0.1)


async def soak(mesh: Mesh, nats_url: str, namespace: str, *, rollouts: int, warmup: int,
               window: int, seed: int) -> dict:
    nc = await connect_bus(nats_url, name="rollmesh-soak", connect_timeout_s=10)
    publisher = BusPublisher(nc, nc.jetstream(), namespace)
    results = Results()
    for subject, callback in ((ROLLOUT_COMPLETED, results.on_completed), (ROLLOUT_FAILED, results.on_failed),
                              (TRAINER_STEPPED, results.on_stepped)):
        await nc.subscribe(subject.format(namespace), cb=callback)
    task, rng = MolarMassTask(), random.Random(seed)
    published = 0

    async def publish_until(count: int) -> None:
        nonlocal published
        while published < min(count, rollouts):
            group = published // GROUP_SIZE
            task_input = task.sample_task_inputs(rng, 1, held_out=False)[0]
            for member in range(GROUP_SIZE):
                await publisher.publish(ROLLOUT_REQUESTED, RolloutRequested(
                    rollout_id=f"soak-{group:05d}-{member}", task=task.name, task_input=task_input,
                    group_id=f"soak-{group:05d}", purpose="train", sampling=SAMPLING,
                    max_turns=MAX_TURNS, requested_at=time.time()))
            published += GROUP_SIZE

    async def run_until(count: int) -> None:
        while results.finished < count:
            await publish_until(results.finished + window)
            await results.wait_finished(min(count, results.finished + GROUP_SIZE))

    series: list[tuple[int, dict[str, float]]] = []  # (rollouts finished, RSS MiB by actor)
    try:
        started = time.monotonic()
        await run_until(warmup)
        warm_s = time.monotonic() - started
        rss_warm = await actor_rss_mib(mesh)
        series.append((results.finished, rss_warm))
        print(f"after {results.finished} rollouts ({warm_s:.0f}s): RSS MiB {rss_warm}", flush=True)
        while results.finished < rollouts:  # a reading every `warmup` rollouts: a trend, not two points
            await run_until(min(rollouts, results.finished + warmup))
            series.append((results.finished, await actor_rss_mib(mesh)))
        total_s = time.monotonic() - started
        rss_end = series[-1][1]
        print(f"after {results.finished} rollouts ({total_s:.0f}s): RSS MiB {rss_end}", flush=True)
    finally:
        await nc.close()
    return {
        "rss_warm": rss_warm, "rss_end": rss_end, "series": series, "finished": results.finished,
        "rollouts_per_s": results.finished / total_s,
        "rollouts_per_s_after_warmup": (results.finished - series[0][0]) / (total_s - warm_s),
        "seconds": round(total_s, 1), "failures": dict(results.failures), "trainer_steps": results.steps,
        "reward_mean": round(sum(results.rewards) / max(1, len(results.rewards)), 3),
        "tool_calls_per_rollout": round(results.tool_calls / max(1, len(results.rewards)), 3),
        "last_text": results.sample,
    }


async def run(args: argparse.Namespace) -> dict:
    namespace = "soak" + uuid.uuid4().hex[:8]
    config = load_config(overrides={
        "namespace": namespace,
        "serve.enabled": False,
        "trainer.n_samples_per_prompt": GROUP_SIZE,
        "trainer.groups_per_step": GROUPS_PER_STEP,
        "rollout.max_concurrent": 32,
    })
    run_dir = Path(tempfile.mkdtemp(prefix="rollmesh-bench-soak-"))
    mesh = Mesh(config, run_dir=run_dir)
    try:
        info = await mesh.start()
        warm = await mesh.trainer.warm_start.remote(TASK, steps=150, batch_size=64, lr=3e-3,
                                                    exact_fraction=1.0, seed=args.seed)
        print(f"mesh up; warm start loss {warm['loss']:.3f}, weights v{warm['weight_version']}", flush=True)
        await wait_serving(mesh, warm["weight_version"])
        return await soak(mesh, info.nats_url, namespace, rollouts=args.rollouts, warmup=args.warmup,
                          window=args.window, seed=args.seed)
    finally:
        await mesh.stop()
        if ray.is_initialized():
            ray.shutdown()
        shutil.rmtree(run_dir, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--window", type=int, default=64, help="requests published ahead of the results")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    result = asyncio.run(run(args))
    print(f"last rollout's text: {result['last_text']!r}")
    growth = {name: result["rss_warm"][name] / result["rss_end"][name] for name in result["rss_end"]}
    worst = min(growth, key=growth.get)
    print_result(
        "soak", result["rss_end"][worst], result["rss_warm"][worst],
        f"MiB RSS of the actor that grew most ({worst}) at the end (ours) and after the warm-up (baseline)",
        growth[worst], actor=worst, rollouts_per_s=round(result["rollouts_per_s"], 2),
        rollouts_per_s_after_warmup=round(result["rollouts_per_s_after_warmup"], 2),
        rss_after_warmup_mib=result["rss_warm"], rss_end_mib=result["rss_end"],
        rss_series_mib={"after_rollouts": [count for count, _ in result["series"]],
                        **{name: [rss[name] for _, rss in result["series"]] for name in result["rss_end"]}},
        rollouts=result["finished"], warmup=args.warmup, seconds=result["seconds"],
        failures=result["failures"], trainer_steps=result["trainer_steps"],
        reward_mean=result["reward_mean"], tool_calls_per_rollout=result["tool_calls_per_rollout"],
    )


if __name__ == "__main__":
    main()
