"""Lending a role's own accelerator, live (``scheduler.lend_role_accelerators``): the session's Ray
and NATS, a real decode worker actor (the demo model) holding the decode role's one accelerator, a
real job process. Decode goes idle: the worker releases its memory and the job runs on its device
outside Ray's accounting; decode's demand returns: the job is preempted, the memory resumed, and a
request the router kept retrying meanwhile is served."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import uuid

import msgspec
import nats
import pytest
import ray

from support.ray_actors import stop_and_kill
from rollmesh.actors.gpu_scheduler import GpuSchedulerActor
from rollmesh.inference.router import InferenceRouter
from rollmesh.actors.inference_workers import DecodeWorkerActor
from rollmesh.mesh_address import MeshAddress
from rollmesh.config import InferenceConfig, ModelConfig, SchedulerConfig
from rollmesh.engine.errors import MemoryReleasedError
from rollmesh.messages import RoleDemandChanged, SimJobSubmitted
from rollmesh.messages.base import SamplingParams
from rollmesh.messages.subjects import PREEMPTION_REQUESTED, ROLE_DEMAND, SIM_ENDED, SIM_STARTED, SIM_SUBMITTED
from test_scheduler_live import Events, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

# Generous on a loaded machine; nothing waits for them unless something is wrong.
TIMEOUT_S = float(os.environ.get("ROLLMESH_TEST_TIMEOUT_S", "90"))
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=4)
PROMPT = [5, 6, 7, 8]
# A job that records what it was given, then waits for the preemption request and exits 0
# (its acknowledgement). SIGTERM is blocked first, so one sent early is not lost.
JOB = [sys.executable, "-c", (
    "import json, os, pathlib, signal\n"
    "signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})\n"
    "keys = ('CUDA_VISIBLE_DEVICES', 'ROLLMESH_JOB_BORROWED')\n"
    "pathlib.Path('env.partial').write_text(json.dumps({k: os.environ.get(k) for k in keys}))\n"
    "os.replace('env.partial', 'env.json')\n"
    "signal.sigwait({signal.SIGTERM})\n")]


async def test_an_idle_decode_workers_accelerator_runs_a_job_and_comes_back_for_requests(
        ray_session, nats_server, tmp_path, demo_model_dir):
    namespace = "t" + uuid.uuid4().hex[:10]
    run_dir = tmp_path / "run"
    mesh = MeshAddress(namespace=namespace, nats_url=nats_server.url, run_dir=str(run_dir))
    inference = InferenceConfig(max_batch=2)
    worker_name = f"decode-{namespace}"
    # The decode role's one accelerator, held by its worker for life (Ray resources); the
    # scheduler finds the worker by name in the Ray job's namespace, as in a launched mesh.
    worker = ray.remote(DecodeWorkerActor).options(
        name=worker_name, num_cpus=0, resources={"rollmesh_sched_gpu": 1}).remote(
        worker_name, mesh, ModelConfig(path=str(demo_model_dir)), inference)
    config = SchedulerConfig(total_gpus=1, resource="rollmesh_sched_gpu", grants={"decode": 1}, tick_s=0.1,
                             lend_role_accelerators=True)
    scheduler = ray.remote(GpuSchedulerActor).options(name=f"sched-{namespace}", namespace=namespace,
                                                       num_cpus=0).remote(
        f"sched-{namespace}", mesh, config, None, inference, None, {"decode": [worker_name]})
    nc = await nats.connect(nats_server.url)
    events = Events()
    for subject in (SIM_STARTED, SIM_ENDED, PREEMPTION_REQUESTED):
        await nc.subscribe(subject.format(namespace), cb=events.on_message)
    try:
        await asyncio.wait_for(asyncio.gather(worker.start.remote(), scheduler.start.remote()), TIMEOUT_S)
        router = InferenceRouter([], [worker], memory_retry_s=0.2, memory_retry_timeout_s=TIMEOUT_S)
        before = await asyncio.wait_for(router.generate(PROMPT, GREEDY, request_id="before"), TIMEOUT_S)
        js = nc.jetstream()
        job = SimJobSubmitted(job_id="sim", command=JOB, accelerators=1, expected_duration_s=3600.0, grace_s=30.0,
                              checkpoint_s=1.0)
        await js.publish(SIM_SUBMITTED.format(namespace), SIM_SUBMITTED.encode(job))

        async def jobs() -> dict[str, str]:
            return msgspec.convert(await scheduler.status.remote(), dict)["jobs"]

        async def wait_queued() -> None:
            while "sim" not in await jobs():
                await asyncio.sleep(0.05)  # another process's state: asked again until it shows

        await asyncio.wait_for(wait_queued(), TIMEOUT_S)
        assert await jobs() == {"sim": "queued"}  # decode holds the only accelerator

        # Decode goes idle: its worker lends its memory, the job runs on its device.
        await js.publish(ROLE_DEMAND.format(namespace), ROLE_DEMAND.encode(RoleDemandChanged(role="decode",
                                                                                             accelerators=0)))
        await events.until(lambda: events.of(SIM_STARTED), TIMEOUT_S)
        env_file = run_dir / "scheduler" / "jobs" / "sim" / "env.json"
        await wait_until(env_file.exists, TIMEOUT_S)
        # Borrowed from the decode worker, outside Ray's accounting (the worker keeps the
        # resource: the only one declared); it saw no CUDA device on this machine, nor does the job.
        assert json.loads(env_file.read_text()) == {"ROLLMESH_JOB_BORROWED": worker_name, "CUDA_VISIBLE_DEVICES": ""}
        with pytest.raises(MemoryReleasedError):
            await worker.generate_prompt.remote(PROMPT, GREEDY, "while-lent")
        # Sent while lent: refused, and retried by the router every 0.2 s.
        waiting = asyncio.create_task(router.generate(PROMPT, GREEDY, request_id="after"))

        # Decode's demand returns: the job is preempted, then the memory resumed; the request
        # the router kept retrying is served, as before the loan.
        await js.publish(ROLE_DEMAND.format(namespace), ROLE_DEMAND.encode(RoleDemandChanged(role="decode",
                                                                                             accelerators=1)))
        after = await asyncio.wait_for(waiting, TIMEOUT_S)
        assert after.token_ids == before.token_ids
        assert [m.holder for m in events.of(PREEMPTION_REQUESTED)] == ["sim"]
        await events.until(lambda: events.of(SIM_ENDED), TIMEOUT_S)
        assert [m.outcome for m in events.of(SIM_ENDED)] == ["preempted"]
        status = msgspec.convert(await scheduler.status.remote(), dict)
        assert status["jobs"] == {"sim": "queued"} and status["roles"] == {"decode": 1}
    finally:
        await nc.close()
        stop_and_kill(scheduler, worker)
    leftover = subprocess.run(["pgrep", "-f", "ROLLMESH_JOB_BORROWED"], capture_output=True, text=True).stdout.split()
    assert not leftover, "no job process outlives the scheduler"
