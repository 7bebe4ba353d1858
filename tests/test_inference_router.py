"""The inference router: which worker serves what (plain logic over fake handles), and the real
thing on Ray: KV pages through the object store, sessions kept on their decode worker with their
KV reused, and the aggregated mode answering as the disaggregated one does."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest
import ray

from support.ray_actors import stop_and_kill
from support.waiting import wait_until
from rollmesh.inference.router import InferenceRouter
from rollmesh.actors.inference_workers import DecodeWorkerActor, PrefillWorkerActor
from rollmesh.mesh_address import MeshAddress
from rollmesh.chat.model_dir import ModelDirectory
from rollmesh.config import InferenceConfig, ModelConfig
from rollmesh.engine.protocols import GenerateOptions, GenerationResult
from rollmesh.messages.base import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=6)


class _Method:
    def __init__(self, worker: "FakeWorker", name: str) -> None:
        self.worker, self.name = worker, name

    def remote(self, *args: Any) -> Any:
        self.worker.calls.append((self.name, args))
        if self.name == "prefill":
            return f"kv-ref-of-{args[1]}"  # what Ray would hand over: a reference
        return self.worker.finish(args)


class FakeWorker:
    """A duck-typed actor handle; decode calls finish when ``release`` is set."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.calls: list[tuple[str, tuple]] = []
        self.release = asyncio.Event()

    def __getattr__(self, name: str) -> _Method:
        return _Method(self, name)

    async def finish(self, args: tuple) -> GenerationResult:
        await self.release.wait()
        return GenerationResult(request_id=args[2], token_ids=[1], logprobs=[0.0], versions=[0],
                                finish_reason="length", prompt_len=3)


def names(worker: FakeWorker) -> list[str]:
    return [name for name, _ in worker.calls]


@pytest.mark.unit
async def test_first_turn_is_prefilled_apart_and_later_turns_stay_on_their_decode_worker() -> None:
    prefill, decode_a, decode_b = FakeWorker("p"), FakeWorker("a"), FakeWorker("b")
    for worker in (decode_a, decode_b):
        worker.release.set()
    router = InferenceRouter([prefill], [decode_a, decode_b])
    session = GenerateOptions(session_id="rollout-1")
    await router.generate([1, 2, 3], GREEDY, request_id="t1", options=session)
    first = decode_a if decode_a.calls else decode_b
    assert names(prefill) == ["prefill"] and names(first) == ["generate"]
    # The decode worker got the prefill's reference, not the pages through the router.
    assert first.calls[0][1][0] == "kv-ref-of-t1"
    await router.generate([1, 2, 3, 4, 5], GREEDY, request_id="t2", options=session)
    assert names(prefill) == ["prefill"]  # no second prefill: the session's KV is on `first`
    assert names(first) == ["generate", "generate_prompt"]
    assert first.calls[1][1][4] == session  # the options reach the worker


@pytest.mark.unit
async def test_new_sessions_go_to_the_decode_worker_with_fewest_requests_in_flight() -> None:
    decode_a, decode_b = FakeWorker("a"), FakeWorker("b")
    router = InferenceRouter([], [decode_a, decode_b])  # aggregated: no prefill workers
    busy = asyncio.create_task(router.generate([1], GREEDY, request_id="long"))
    await asyncio.sleep(0)
    second = asyncio.create_task(router.generate([1], GREEDY, request_id="s",
                                                 options=GenerateOptions(session_id="s")))
    await asyncio.sleep(0)
    assert names(decode_a) == ["generate_prompt"] and names(decode_b) == ["generate_prompt"]
    decode_a.release.set()
    decode_b.release.set()
    await asyncio.gather(busy, second)
    assert router.decode_worker_for("s") == (1, True)


@pytest.mark.unit
async def test_a_lent_decode_worker_takes_new_sessions_and_its_sessions_move_on_when_it_leaves() -> None:
    own, lent = FakeWorker("own"), FakeWorker("lent")
    own.release.set()
    lent.release.set()
    router = InferenceRouter([], [own])
    await router.generate([1], GREEDY, request_id="a", options=GenerateOptions(session_id="a"))
    router.add_decode_worker("decode-elastic-0", lent)
    router.add_decode_worker("decode-elastic-0", lent)  # announced twice: added once
    busy = asyncio.create_task(router.generate([1], GREEDY, request_id="long"))  # own is busier now...
    own.release.clear()
    await asyncio.sleep(0)
    await router.generate([1], GREEDY, request_id="b", options=GenerateOptions(session_id="b"))
    assert names(lent) == ["generate_prompt"] and router.lent_decode_workers() == ["decode-elastic-0"]
    assert router.remove_decode_worker("decode-elastic-0") and not router.remove_decode_worker("decode-elastic-0")
    own.release.set()
    await busy
    # The session that was on the lent worker continues on the mesh's own, prefilled there in full.
    assert router.decode_worker_for("b") == (0, False)
    await router.generate([1, 2], GREEDY, request_id="b2", options=GenerateOptions(session_id="b"))
    assert names(lent) == ["generate_prompt"] and names(own)[-1] == "generate_prompt"


@pytest.mark.unit
def test_the_router_forgets_the_oldest_sessions_past_its_bound() -> None:
    router = InferenceRouter([], [FakeWorker("a"), FakeWorker("b")], max_sessions=2)
    for session in ("x", "y", "z"):
        router.decode_worker_for(session)
    assert router.decode_worker_for("x")[1] is False  # forgotten: placed anew
    assert router.decode_worker_for("z")[1] is True
    with pytest.raises(ValueError):
        InferenceRouter([FakeWorker("p")], [])


class SilentWorker:
    """A duck-typed actor handle whose calls never answer: each ``.remote`` returns a future
    (standing in for the ObjectRef) that nothing resolves, recorded with the method's name."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, asyncio.Future]] = []

    def __getattr__(self, name: str) -> Any:
        worker = self

        class _Remote:
            @staticmethod
            def remote(*args: Any) -> asyncio.Future:
                reply = asyncio.get_running_loop().create_future()
                worker.calls.append((name, reply))
                return reply

        return _Remote()


@pytest.mark.unit
@pytest.mark.parametrize("disaggregated", [False, True])
async def test_a_cancelled_generate_cancels_its_prefill_and_decode_tasks_on_the_workers(disaggregated) -> None:
    prefill, decode = SilentWorker(), SilentWorker()
    cancelled: list[Any] = []
    router = InferenceRouter([prefill] if disaggregated else [], [decode], cancel_task=cancelled.append)
    call = asyncio.create_task(router.generate([1, 2, 3], GREEDY, request_id="r/1"))
    await wait_until(lambda: decode.calls, "the call to reach the decode worker")
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    # Awaiting a Ray call does not stop it when cancelled: the router cancels the actor tasks, so
    # the decode worker aborts the request and frees its slot (and a retry's same id is welcome).
    assert cancelled == [reply for _, reply in decode.calls + prefill.calls]
    assert [name for name, _ in decode.calls] == ["generate" if disaggregated else "generate_prompt"]
    assert router._decode_in_flight == [0]


# -- on Ray -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def workers(ray_session, nats_server, tmp_path_factory, demo_model_dir):
    """A prefill and two decode workers of the demo model directory, on the session's Ray."""
    model = ModelConfig(path=str(demo_model_dir))
    namespace = "r" + uuid.uuid4().hex[:10]
    mesh = MeshAddress(namespace=namespace, nats_url=nats_server.url,
                       run_dir=str(tmp_path_factory.mktemp("router-run")))
    inference = InferenceConfig(max_batch=4, kv_block_size=8)

    def spawn(cls, name, *args):
        return ray.remote(cls).options(name=name, namespace=namespace, num_cpus=0).remote(
            name, mesh, model, inference, *args)

    prefill = spawn(PrefillWorkerActor, "prefill-0")
    decodes = [spawn(DecodeWorkerActor, f"decode-{i}", i) for i in range(2)]
    actors = [prefill, *decodes]
    try:
        ray.get([actor.start.remote() for actor in actors], timeout=60)
        yield prefill, decodes
    finally:
        stop_and_kill(*actors)


@pytest.mark.integration
async def test_on_ray_sessions_reuse_kv_on_their_decode_worker_and_aggregated_answers_alike(
    workers, demo_model_dir
) -> None:
    prefill, decodes = workers
    tokenizer = ModelDirectory.load(demo_model_dir)
    prompt = tokenizer.encode("<|im_start|>user\nmolar mass of NaCl?<|im_end|>\n<|im_start|>assistant\n")
    tool_result = tokenizer.encode("\n<|im_start|>user\n<tool_response>\n58.44\n</tool_response><|im_end|>\n")
    disaggregated = InferenceRouter([prefill], decodes)
    session = GenerateOptions(session_id="agent")
    first = await disaggregated.generate(prompt, GREEDY, request_id="d1", options=session)
    turn_two = [*prompt, *first.token_ids, *tool_result]
    second = await disaggregated.generate(turn_two, GREEDY, request_id="d2", options=session)
    assert first.cached_tokens == 0
    assert second.cached_tokens == len(prompt) + len(first.token_ids) - 1  # all but the unforwarded last
    index, returning = disaggregated.decode_worker_for("agent")
    stats = await decodes[index].stats.remote()
    assert returning and stats["decode"].session_hits == 1

    aggregated = InferenceRouter([], decodes)
    alike = await aggregated.generate(prompt, GREEDY, request_id="a1")
    assert alike.token_ids == first.token_ids and alike.cached_tokens == 0
    again = await aggregated.generate(turn_two, GREEDY, request_id="a2")
    assert again.token_ids == second.token_ids
