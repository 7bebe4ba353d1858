"""Weight sync into SGLang without files (``trainer.weight_sync = "nccl"``), its protocol run over a
gloo group on CPU: group setup, bucketed broadcast, version label, pause and continue, and the
colocated ``update_weights_from_tensor`` payload, against fake SGLang weight servers in their own
processes (``sglang_weight_server``: each endpoint's upstream source is cited there) that receive
the tensors and report their sha256; and the trainer driving it (``TrainerLogic``'s publish path
with ``SGLangWeightPush``). NCCL and CUDA IPC handles themselves need GPUs and a real SGLang: not
exercised here (on CPU, ForkingPickler shares the tensors' memory by file descriptor)."""

from __future__ import annotations

import asyncio
import multiprocessing
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import pytest_asyncio
import torch

from rollmesh.engine.errors import WeightsError
from rollmesh.engine.sglang_client import SGLangClient
from rollmesh.engine.sglang_server import pick_free_port
from rollmesh.engine.sglang_weight_sync import SGLangWeightPush, SGLangWeightSync
from support.sglang_weight_server import serve, tensor_sha256

pytestmark = pytest.mark.timeout(180)

START_TIMEOUT_S = 120.0  # a spawned interpreter importing torch on a loaded machine


@pytest.fixture
def state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {"model.embed_tokens.weight": torch.randn(64, 16), "model.layers.0.mlp.weight": torch.randn(16, 16),
            "model.layers.0.norm.weight": torch.randn(16).to(torch.bfloat16), "lm_head.weight": torch.randn(64, 16)}


async def wait_serving(client: SGLangClient) -> None:
    import asyncio

    delay, deadline = 0.05, asyncio.get_running_loop().time() + START_TIMEOUT_S
    while True:
        try:
            await client.model_info()
            return
        except Exception:
            if asyncio.get_running_loop().time() > deadline:
                raise
            await asyncio.sleep(delay)  # backoff while the child starts; not a synchronisation
            delay = min(delay * 2, 1.0)


@pytest_asyncio.fixture(scope="module")
async def server_processes() -> AsyncIterator[list[SGLangClient]]:
    context = multiprocessing.get_context("spawn")
    ports = [pick_free_port(), pick_free_port()]
    processes = [context.Process(target=serve, args=(port,), daemon=True) for port in ports]
    for process in processes:
        process.start()
    async with httpx.AsyncClient() as http:
        clients = [SGLangClient(f"http://127.0.0.1:{port}", http, admin_timeout_s=120) for port in ports]
        try:
            for client in clients:
                await wait_serving(client)
            yield clients
        finally:
            for process in processes:
                process.kill()
                process.join(30)


@pytest_asyncio.fixture
async def servers(server_processes: list[SGLangClient]) -> list[SGLangClient]:
    for client in server_processes:
        await client._http.post(f"{client.base_url}/debug/reset")
    return server_processes


async def debug(client: SGLangClient, what: str):
    response = await client._http.get(f"{client.base_url}/debug/{what}")
    return response.json()


@pytest.mark.unit
async def test_a_version_is_broadcast_in_buckets_between_pause_and_continue_and_labelled(servers, state):
    sync = SGLangWeightSync(servers, backend="gloo", bucket_bytes=4096, timeout_s=120)
    await sync.connect()
    try:
        stats = await sync.publish(state, 1)
        newer = {name: tensor + 1 for name, tensor in state.items()}
        await sync.publish(newer, 2)  # the same group serves every later version
    finally:
        await sync.close()

    assert stats.version == 1 and stats.buckets >= 2 and 0 < stats.pause_s <= stats.total_s
    expected = {name: tensor_sha256(tensor) for name, tensor in newer.items()}
    for rank, server in enumerate(servers, start=1):
        events = await debug(server, "events")
        assert events[0] == ["init", rank, 3, "rollmesh_weights", "gloo"]
        assert events[-1] == ["destroy", "rollmesh_weights"]
        for version in (1, 2):  # pause, every bucket while paused with the label, continue
            start = events.index(["pause", "in_place"], 1 if version == 1 else events.index(["continue"]) + 1)
            end = events.index(["continue"], start)
            buckets = events[start + 1:end]
            assert [kind for kind, *_ in buckets] == ["update_distributed"] * stats.buckets
            assert sorted(name for _, names, *_ in buckets for name in names) == sorted(state)
            assert all(paused and not flush for *_, paused, flush in buckets)
            # Labelled with the last bucket only: a label means the whole version arrived.
            assert [label for _, _, label, *_ in buckets] == [None] * (stats.buckets - 1) + [str(version)]
        assert await debug(server, "weights") == expected  # byte for byte, bf16 included
        assert await server.weight_version() == 2


@pytest.mark.unit
async def test_colocated_servers_take_a_version_by_shared_tensors_between_pause_and_continue(servers, state):
    sync = SGLangWeightSync(servers[:1], backend="gloo", bucket_bytes=1 << 20)
    stats = await sync.publish_ipc(state, 3)
    events = await debug(servers[0], "events")
    assert [e[0] for e in events] == ["pause", "update_tensor", "continue"]
    assert events[1][2:] == ["3", True, False]
    assert await debug(servers[0], "weights") == {name: tensor_sha256(t) for name, t in state.items()}
    assert stats.buckets == 1 and await servers[0].weight_version() == 3


@pytest.mark.unit
async def test_a_bucket_for_a_group_the_server_never_joined_is_a_weights_error(servers):
    with pytest.raises(WeightsError, match="not found"):
        await servers[0].update_weights_from_distributed(names=["w"], dtypes=["float32"], shapes=[[2]],
                                                         group_name="nobody", version=1)


@pytest.mark.unit
async def test_the_trainer_pushes_each_durable_version_into_the_servers_before_announcing_it(
        servers, tmp_path, demo_model_dir):
    from support.fakes import RecordingPublisher
    from rollmesh.messages.subjects import WEIGHTS_PUBLISHED
    from test_training_trainer_logic import build_trainer, completed, deliver
    from rollmesh.config import ModelConfig

    push = SGLangWeightPush([s.base_url for s in servers], method="nccl", bucket_bytes=1 << 20, timeout_s=120)
    bus = RecordingPublisher()
    logic = build_trainer(tmp_path, bus, ModelConfig(path=str(demo_model_dir)), weight_sync="nccl")
    logic.push = push
    bus.hold(WEIGHTS_PUBLISHED)
    try:
        step = asyncio.create_task(deliver(logic, completed("a", "g1", 1.0), completed("b", "g1", 0.0)))
        (announced,) = await asyncio.wait_for(bus.wait_published(WEIGHTS_PUBLISHED), 120)
        # At the announcement the servers already run the version, and its files are durable.
        assert [await server.weight_version() for server in servers] == [1, 1]
        assert Path(announced.path).exists() and announced.memory_holder == ""
        bus.release(WEIGHTS_PUBLISHED)
        assert await step == [None, None]
    finally:
        await push.aclose()
    expected = {name: tensor_sha256(t) for name, t in logic.backend.state_dict().items()}
    for server in servers:
        assert await debug(server, "weights") == expected
        kinds = [event[0] for event in await debug(server, "events")]
        assert kinds[:2] == ["init", "pause"] and kinds[-2:] == ["continue", "destroy"]
    assert logic.push_failures == 0


@pytest.mark.unit
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: SGLang opens CUDA IPC handles only")
async def test_colocated_servers_open_the_trainers_cuda_tensors_by_ipc_handle(servers, state):
    """``trainer.weight_sync = "ipc"``: CPU tensors go to the GPU, and the server process maps them."""
    push = SGLangWeightPush([servers[0].base_url], method="ipc", bucket_bytes=1 << 20)
    try:
        stats = await push.push(state, 4)
    finally:
        await push.aclose()
    assert stats.buckets == 1 and await servers[0].weight_version() == 4
    assert await debug(servers[0], "weights") == {name: tensor_sha256(t) for name, t in state.items()}


@pytest.mark.integration
@pytest.mark.timeout(300)
async def test_the_trainer_finds_the_servers_of_the_sglang_workers_it_was_handed(ray_session):
    import uuid

    import ray

    from rollmesh.actors.sglang_weight_receivers import find_weight_receivers

    @ray.remote(num_cpus=0)
    class Worker:  # an SGLang worker's answer (SGLangWorkerActor.weight_sync_target)
        def __init__(self, urls: list[str]) -> None:
            self.urls = urls

        def weight_sync_target(self) -> dict:
            return {"urls": self.urls, "gpus_per_server": 2, "pause_mode": "in_place"}

    names = [f"decode-{uuid.uuid4().hex[:8]}" for _ in range(2)]
    workers = [Worker.options(name=name).remote(urls) for name, urls in
               zip(names, (["http://a:1"], ["http://b:1", "http://b:2"]))]  # the second a PD pair
    try:
        receivers = await find_weight_receivers(names)
    finally:
        for worker in workers:
            ray.kill(worker)
    assert receivers.urls == ["http://a:1", "http://b:1", "http://b:2"]
    assert (receivers.gpus_per_server, receivers.pause_mode) == (2, "in_place") and receivers.master_address
