"""The inference router and lent memory (plain logic over fake handles): a worker whose
accelerator the GPU scheduler lent refuses with the retryable MemoryReleasedError; the request is
retried on another worker, or, when every worker refused, again after a wait, and fails only past
``memory_retry_timeout_s``."""

from __future__ import annotations

import pytest

from rollmesh.inference.router import InferenceRouter
from rollmesh.engine.errors import MemoryReleasedError
from rollmesh.engine.protocols import GenerateOptions
from test_inference_router import GREEDY, FakeWorker, names

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


class LentWorker(FakeWorker):
    """Refuses its first ``refusals`` requests as a worker whose memory is released does."""

    def __init__(self, name: str, refusals: int) -> None:
        super().__init__(name)
        self.refusals = refusals
        self.release.set()

    async def finish(self, args: tuple):
        if self.refusals > 0:
            self.refusals -= 1
            raise MemoryReleasedError(request_id=args[2])
        return await super().finish(args)


async def test_a_request_refused_by_a_lent_worker_is_served_by_another_and_its_session_moves() -> None:
    lent, other = LentWorker("lent", refusals=0), LentWorker("other", refusals=0)
    router = InferenceRouter([], [lent, other])
    session = GenerateOptions(session_id="s")
    await router.generate([1], GREEDY, request_id="t1", options=session)
    assert router.decode_worker_for("s") == (0, True)  # the session lives on `lent`
    lent.refusals = 1  # its memory is released now
    result = await router.generate([1, 2], GREEDY, request_id="t2", options=session)
    assert result.token_ids == [1]
    assert names(lent) == ["generate_prompt", "generate_prompt"] and names(other) == ["generate_prompt"]
    assert router.decode_worker_for("s") == (1, True)  # it moved, prefilled there in full


async def test_when_every_worker_refused_the_router_waits_and_tries_again() -> None:
    only = LentWorker("only", refusals=2)
    router = InferenceRouter([], [only], memory_retry_s=0.01, memory_retry_timeout_s=60.0)
    result = await router.generate([1], GREEDY, request_id="r")
    assert result.token_ids == [1] and names(only) == ["generate_prompt"] * 3


async def test_a_refusal_outlasting_the_retry_timeout_reaches_the_caller() -> None:
    only = LentWorker("only", refusals=10**6)
    router = InferenceRouter([], [only], memory_retry_s=0.01, memory_retry_timeout_s=0.0)
    with pytest.raises(MemoryReleasedError):
        await router.generate([1], GREEDY, request_id="r")
    assert names(only) == ["generate_prompt"]
