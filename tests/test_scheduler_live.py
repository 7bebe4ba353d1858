"""The GPU scheduler actor, live: the session's Ray (3 declared accelerators of its own) and NATS,
real job processes (examples/sim_counter_job.py: a counter checkpointed to disk) in placement
groups. Jobs fill the idle accelerators; the trainer asks for them; one job checkpoints and
leaves, one ignores the request and is killed at its deadline; the trainer gets them; when it
gives them back both jobs resume from their checkpoints, losing at most one checkpoint interval;
``rollmesh sched submit-sim`` and ``rollmesh sched status`` work against it."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import uuid
from pathlib import Path

import msgspec
import nats
import pytest
import ray

from support.ray_actors import stop_and_kill
from rollmesh.actors.gpu_scheduler import GpuSchedulerActor
from rollmesh.mesh_address import MeshAddress
from rollmesh.config import SchedulerConfig
from rollmesh.messages import RoleDemandChanged, SimJobSubmitted
from rollmesh.messages.subjects import (
    GPU_GRANTED,
    GPU_RELEASED,
    PREEMPTION_ACKNOWLEDGED,
    PREEMPTION_REQUESTED,
    ROLE_DEMAND,
    SIM_ENDED,
    SIM_STARTED,
    SIM_SUBMITTED,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

REPO = Path(__file__).resolve().parent.parent
JOB = [sys.executable, str(REPO / "examples" / "sim_counter_job.py"), "--steps", "100000", "--step-s", "0.01",
       "--checkpoint-every", "20"]  # 100 steps/s: a checkpoint every 0.2 s
CHECKPOINT_EVERY = 20
WATCHED = (SIM_STARTED, SIM_ENDED, PREEMPTION_REQUESTED, PREEMPTION_ACKNOWLEDGED, GPU_GRANTED, GPU_RELEASED)


class Events:
    def __init__(self) -> None:
        self.seen: list[tuple[str, object]] = []
        self.changed = asyncio.Event()

    async def on_message(self, msg) -> None:
        subject = next(s for s in WATCHED if msg.subject.endswith(s.template.removeprefix("rl.{ns}")))
        self.seen.append((subject.template, subject.decode(msg.data)))
        self.changed.set()

    def of(self, subject) -> list:
        return [message for template, message in self.seen if template == subject.template]

    async def until(self, predicate, timeout_s: float = 60.0) -> None:
        async def wait() -> None:
            while not predicate():
                self.changed.clear()
                await self.changed.wait()
        await asyncio.wait_for(wait(), timeout_s)


def steps_of(log: Path) -> tuple[int, int]:
    """(where the attempt started, the last step it reached)."""
    lines = log.read_text().split()
    numbers = [int(word) for word in lines if word.isdigit()]
    return numbers[0], numbers[-1]


def counted_to(log: Path, step: int) -> bool:
    """Whether the attempt writing ``log`` has counted to ``step`` (0: it has started)."""
    try:
        return steps_of(log)[1] >= step
    except (FileNotFoundError, IndexError):  # not started, or nothing written yet
        return False


async def wait_until(condition, timeout_s: float = 30.0) -> None:
    """What another connection's subscription changes: checked every 50 ms until true."""
    async def wait() -> None:
        while not condition():
            await asyncio.sleep(0.05)
    await asyncio.wait_for(wait(), timeout_s)


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rollmesh.cli", *args], capture_output=True, text=True,
                          timeout=60, cwd=REPO)


async def test_jobs_are_preempted_when_the_trainer_asks_and_resume_from_their_checkpoints(
        ray_session, nats_server, tmp_path):
    namespace = "t" + uuid.uuid4().hex[:10]
    run_dir = tmp_path / "run"
    mesh = MeshAddress(namespace=namespace, nats_url=nats_server.url, run_dir=str(run_dir))
    config = SchedulerConfig(total_gpus=3, resource="rollmesh_sched_gpu", tick_s=0.1, report_every_s=0.5)
    actor = ray.remote(GpuSchedulerActor).options(name=f"sched-{namespace}", namespace=namespace,
                                                   num_cpus=0).remote(f"sched-{namespace}", mesh, config)
    nc = await nats.connect(nats_server.url)
    events = Events()
    for subject in WATCHED:
        await nc.subscribe(subject.format(namespace), cb=events.on_message)
    try:
        await actor.start.remote()
        js = nc.jetstream()
        # One job over the CLI (checkpoints when asked), one over NATS (ignores the request).
        submitted = run_cli("sched", "submit-sim", "--nats-url", nats_server.url, "--namespace", namespace,
                            "--job-id", "polite", "--accelerators", "2", "--duration", "600", "--grace", "5",
                            "--checkpoint-s", "1", "--checkpoint-interval", "0.2", "--", *JOB)
        assert submitted.returncode == 0, submitted.stderr
        stubborn = SimJobSubmitted(job_id="stubborn", command=[*JOB, "--ignore-preemption"], accelerators=1,
                                   expected_duration_s=600.0, grace_s=1.0, checkpoint_interval_s=0.2)
        await js.publish(SIM_SUBMITTED.format(namespace), SIM_SUBMITTED.encode(stubborn))
        await events.until(lambda: len(events.of(SIM_STARTED)) == 2)
        jobs_dir = run_dir / "scheduler" / "jobs"
        # Both make progress and checkpoint a few times before they are asked to stop.
        await wait_until(lambda: all(counted_to(jobs_dir / job / "attempt_1.log", 3 * CHECKPOINT_EVERY)
                                     for job in ("polite", "stubborn")))

        status = run_cli("sched", "status", "--nats-url", nats_server.url, "--namespace", namespace, "--json")
        assert status.returncode == 0, status.stderr
        assert json.loads(status.stdout)["jobs"] == {"polite": "running", "stubborn": "running"}

        # The trainer wants all three accelerators.
        await js.publish(ROLE_DEMAND.format(namespace),
                         ROLE_DEMAND.encode(RoleDemandChanged(role="trainer", accelerators=3)))
        await events.until(lambda: sum(m.count for m in events.of(GPU_GRANTED)) == 3
                           and len(events.of(SIM_ENDED)) == 2)
        requests = {m.holder: m for m in events.of(PREEMPTION_REQUESTED)}
        assert set(requests) == {"polite", "stubborn"}
        ended = {m.job_id: m for m in events.of(SIM_ENDED)}
        assert ended["polite"].outcome == "preempted" and ended["stubborn"].outcome == "killed"
        assert [m.holder for m in events.of(PREEMPTION_ACKNOWLEDGED)] == ["polite"]
        # The stubborn job was killed at its deadline, not before: the grant came after it.
        assert ended["stubborn"].ended_at >= requests["stubborn"].deadline
        polite_stop = steps_of(jobs_dir / "polite" / "attempt_1.log")[1]
        stubborn_stop = steps_of(jobs_dir / "stubborn" / "attempt_1.log")[1]

        # The trainer gives them back: both jobs run again from their checkpoints.
        await js.publish(ROLE_DEMAND.format(namespace),
                         ROLE_DEMAND.encode(RoleDemandChanged(role="trainer", accelerators=0)))
        await events.until(lambda: len(events.of(SIM_STARTED)) == 4)
        assert sum(m.count for m in events.of(GPU_RELEASED)) == 3
        await wait_until(lambda: all(counted_to(jobs_dir / job / "attempt_2.log", 0)
                                     for job in ("polite", "stubborn")))
        polite_resumed = steps_of(jobs_dir / "polite" / "attempt_2.log")[0]
        stubborn_resumed = steps_of(jobs_dir / "stubborn" / "attempt_2.log")[0]
        assert polite_resumed == polite_stop  # it checkpointed when asked: nothing lost
        assert stubborn_stop - CHECKPOINT_EVERY <= stubborn_resumed <= stubborn_stop  # at most one interval
        final = msgspec.convert(await actor.status.remote(), dict)
        assert final["preemptions"] == 2 and final["kills"] == 1 and final["lost_accelerator_s"] > 0
    finally:
        await nc.close()
        stop_and_kill(actor)
    leftover = subprocess.run(["pgrep", "-f", "sim_counter_job.py"], capture_output=True, text=True).stdout.split()
    assert not leftover, "no job process outlives the scheduler"


async def test_idle_accelerators_become_decode_workers_until_a_job_needs_them(ray_session, nats_server, tmp_path,
                                                                             demo_model_dir):
    """Decode loans: with nothing else to run, the scheduler lends 2 idle accelerators to
    decode as 2 real decode workers (the demo model) that a rollout worker's router picks up and
    generates on; a job that needs them gets them once their release was announced and they
    were stopped. The Serve app's router, following the loans on its own connection, routes to
    them as well and drops them at their release."""
    from rollmesh.inference.decode_loans import DecodeLoanRoster
    from rollmesh.inference.router import InferenceRouter
    from rollmesh.actors.rollout_worker import ray_actor_by_name
    from rollmesh.bus.publisher import BusPublisher
    from rollmesh.config import InferenceConfig, ModelConfig
    from rollmesh.messages.base import SamplingParams
    from rollmesh.rollout.decode_loan_follower import RolloutDecodeLoanFollower
    from rollmesh.serve_apps.decode_loan_follower import DecodeLoanFollower

    namespace = "t" + uuid.uuid4().hex[:10]
    mesh = MeshAddress(namespace=namespace, nats_url=nats_server.url, run_dir=str(tmp_path / "run"))
    # Decode is active (its start grant; no actor of this test holds it), and 2 accelerators idle.
    config = SchedulerConfig(total_gpus=3, resource="rollmesh_sched_gpu", grants={"decode": 1}, tick_s=0.1,
                             decode_loans=2, decode_loan_drain_s=0.2)
    model = ModelConfig(path=str(demo_model_dir))
    actor = ray.remote(GpuSchedulerActor).options(name=f"sched-{namespace}", namespace=namespace, num_cpus=0).remote(
        f"sched-{namespace}", mesh, config, model, InferenceConfig(max_batch=4))
    nc = await nats.connect(nats_server.url)
    events = Events()
    for subject in WATCHED:
        await nc.subscribe(subject.format(namespace), cb=events.on_message)
    serve_follower = None
    try:
        await actor.start.remote()
        await events.until(lambda: len(events.of(GPU_GRANTED)) == 2)
        lent = sorted(m.grant_id for m in events.of(GPU_GRANTED))
        assert {m.holder for m in events.of(GPU_GRANTED)} == {"decode.elastic"}

        # A rollout worker's router, started after the loans: it finds them through the status.
        router = InferenceRouter([], [object()])
        follower = RolloutDecodeLoanFollower(router, BusPublisher(nc, nc.jetstream(), namespace), ray_actor_by_name)
        await follower.start()
        assert router.lent_decode_workers() == lent
        # The lent workers live in the Ray job's namespace (the mesh's, in a launched mesh), not
        # the one this test gave the scheduler actor.
        workers_namespace = ray.get_runtime_context().namespace
        assert ray.get_actor(lent[0], namespace=workers_namespace)
        # The Serve app's router follows the loans too, on its own connection, as its replica does.
        # Its own decode worker is marked gone (None, as a worker that left), so all it serves
        # goes to the lent ones.
        serve_router = InferenceRouter([], [None])
        serve_follower = DecodeLoanFollower(
            mesh,
            DecodeLoanRoster(serve_router, lambda name: ray.get_actor(name, namespace=workers_namespace)))
        serve_follower.start()
        await wait_until(lambda: serve_router.lent_decode_workers() == lent)
        served = await serve_router.generate([1, 2, 3], SamplingParams(temperature=0.0, max_new_tokens=4),
                                             request_id="s1")
        assert len(served.token_ids) == 4
        finished = await router.decode_workers[1].generate_prompt.remote(
            [1, 2, 3], SamplingParams(temperature=0.0, max_new_tokens=4), "r1")
        assert len(finished.token_ids) == 4

        job = SimJobSubmitted(job_id="md", command=JOB, accelerators=2, expected_duration_s=600.0, grace_s=5.0,
                              checkpoint_s=1.0)
        await nc.jetstream().publish(SIM_SUBMITTED.format(namespace), SIM_SUBMITTED.encode(job))
        await events.until(lambda: len(events.of(SIM_STARTED)) == 1)
        released = events.of(GPU_RELEASED)
        assert sorted(m.grant_id for m in released) == lent
        for message in released:  # as the rollout worker's subscription delivers them
            await follower.handle_released(message, None)
        assert router.lent_decode_workers() == []
        for name in lent:  # stopped before the job was placed on their accelerators
            with pytest.raises(ValueError):
                ray.get_actor(name, namespace=workers_namespace)
        # The Serve router dropped them from its own subscription to the releases.
        await wait_until(lambda: serve_router.lent_decode_workers() == [])
    finally:
        if serve_follower is not None:
            await serve_follower.close()
        await nc.close()
        stop_and_kill(actor)
