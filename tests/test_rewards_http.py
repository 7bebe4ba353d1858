"""The ``http`` reward against a real local reward server: calls made together go in one POST
and each caller gets its own reward, a 503 is retried, and a server that stays down, does not
answer, or answers nonsense is a typed failure (never a zero) that does not show the API key."""

from __future__ import annotations

import socket
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from support.reward_servers import Request, reward_server
from rollmesh.rewards.combined import CombinedReward, load_reward
from rollmesh.rewards.errors import RewardLoadError, RewardUnavailableError
from rollmesh.rewards.http_reward import http_reward
from rollmesh.rewards.reward_input import RewardInput
from rollmesh.run_config import RewardSpec

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

# Long enough that a batch is only ever sent because it is full: no test depends on timing.
NEVER = 600.0


def sample(text: str) -> RewardInput:
    return RewardInput(row={"prompt": f"say {text}", "id": text}, answer=text,
                       messages=[{"role": "user", "content": f"say {text}"}], final_text=text)


def length_rewards(request: Request, number: int) -> tuple[int, object]:
    """Scores each sample by its final text's length, so a caller can tell its reward apart."""
    return 200, {"rewards": [float(len(s["final_text"])) for s in request.body["samples"]]}


def score_together(url: str, texts: list[str], **args) -> list[float]:
    with ThreadPoolExecutor(len(texts)) as pool:
        return list(pool.map(lambda text: http_reward(sample(text), url=url, **args), texts))


def test_concurrent_calls_go_in_one_post_and_each_caller_gets_its_own_reward():
    texts = ["a", "bb", "ccc", "dddd", "eeeee"]
    with reward_server(length_rewards) as server:
        rewards = score_together(server.url, texts, batch_window_s=NEVER, max_batch=len(texts))
    assert rewards == [1.0, 2.0, 3.0, 4.0, 5.0]
    assert len(server.requests) == 1
    (posted,) = server.requests
    assert sorted(s["final_text"] for s in posted.body["samples"]) == texts
    first = next(s for s in posted.body["samples"] if s["final_text"] == "a")
    assert first == {"row": {"prompt": "say a", "id": "a"}, "messages": [{"role": "user", "content": "say a"}],
                     "final_text": "a", "finish_reason": "stop", "answer": "a"}


def test_a_batch_holds_at_most_max_batch_samples():
    with reward_server(length_rewards) as server:
        rewards = score_together(server.url, ["a", "bb", "ccc", "dddd"], batch_window_s=NEVER, max_batch=2)
    assert rewards == [1.0, 2.0, 3.0, 4.0]
    assert [len(request.body["samples"]) for request in server.requests] == [2, 2]


def test_a_dict_reward_comes_back_whole():
    with reward_server(lambda request, n: (200, {"rewards": [{"format": 0.5, "correct": 1.0}]})) as server:
        assert http_reward(sample("x"), url=server.url, batch_window_s=0) == {"format": 0.5, "correct": 1.0}


def test_a_503_is_retried_and_then_the_reward_comes():
    def flaky(request: Request, number: int) -> tuple[int, object]:
        return (503, {"error": "warming up"}) if number == 0 else length_rewards(request, number)

    with reward_server(flaky) as server:
        assert http_reward(sample("abc"), url=server.url, batch_window_s=0, backoff_s=0.01) == 3.0
    assert len(server.requests) == 2


def test_a_server_that_stays_down_fails_every_caller_typed_after_the_retries():
    def call(text: str) -> RewardUnavailableError:
        with pytest.raises(RewardUnavailableError, match=r"HTTP 503 after 3 attempt\(s\)") as failed:
            http_reward(sample(text), url=server.url, retries=2, backoff_s=0.01, batch_window_s=NEVER,
                        max_batch=3)
        return failed.value

    with reward_server(lambda request, n: (503, {"error": "down"})) as server:
        with ThreadPoolExecutor(3) as pool:
            failures = list(pool.map(call, ["a", "b", "c"]))
    assert [failure.reward for failure in failures] == ["http"] * 3
    assert len(server.requests) == 3  # one batch, tried three times


def test_a_server_not_listening_is_unreachable():
    with socket.socket() as free:  # a port nothing listens on once this closes
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    with pytest.raises(RewardUnavailableError, match="server unreachable"):
        http_reward(sample("x"), url=f"http://127.0.0.1:{port}/score", retries=1, backoff_s=0.01, batch_window_s=0)


def test_a_server_that_does_not_answer_times_out():
    def silent(request: Request, number: int) -> tuple[int, object]:
        server.closing.wait()
        return 200, {"rewards": [1.0]}

    with reward_server(silent) as server:
        with pytest.raises(RewardUnavailableError, match="no answer within the timeout"):
            http_reward(sample("x"), url=server.url, timeout_s=0.2, retries=1, backoff_s=0.01, batch_window_s=0)
        assert len(server.requests) == 2


@pytest.mark.parametrize("answer", [{"rewards": [1.0, 2.0]}, {"scores": [1.0]}, [1.0], b"not json",
                                    {"rewards": ["high"]}, {"rewards": [float("nan")]}])
def test_a_malformed_answer_is_a_typed_failure(answer):
    with reward_server(lambda request, n: (200, answer)) as server:
        with pytest.raises(RewardUnavailableError, match="malformed answer"):
            http_reward(sample("x"), url=server.url, batch_window_s=0)
    assert len(server.requests) == 1  # not retried: the server answered


def test_the_api_key_is_sent_and_never_shown_in_a_failure(monkeypatch):
    monkeypatch.setenv("ROLLMESH_TEST_REWARD_KEY", "sk-very-secret")

    def refuses(request: Request, number: int) -> tuple[int, object]:  # echoes what it got, as some do
        return 401, {"error": f"bad key {request.headers['authorization']}"}

    with reward_server(refuses) as server:
        with pytest.raises(RewardUnavailableError, match="HTTP 401") as failed:
            http_reward(sample("x"), url=server.url, api_key_env="ROLLMESH_TEST_REWARD_KEY",
                        headers={"X-Team": "rl"}, batch_window_s=0)
    assert server.requests[0].headers["authorization"] == "Bearer sk-very-secret"
    assert server.requests[0].headers["x-team"] == "rl"
    assert "sk-very-secret" not in str(failed.value)
    assert len(server.requests) == 1  # a 4xx is not retried


def test_an_unset_api_key_variable_is_named_in_the_failure(monkeypatch):
    monkeypatch.delenv("ROLLMESH_TEST_NO_SUCH_KEY", raising=False)
    with pytest.raises(RewardUnavailableError, match="ROLLMESH_TEST_NO_SUCH_KEY"):
        http_reward(sample("x"), url="http://127.0.0.1:9/", api_key_env="ROLLMESH_TEST_NO_SUCH_KEY",
                    batch_window_s=0)


def test_no_flusher_thread_is_left_once_the_calls_are_answered():
    with reward_server(length_rewards) as server:
        assert score_together(server.url, ["a", "bb"], batch_window_s=0) in ([1.0, 2.0],)
        flushers = [t for t in threading.enumerate() if t.name == f"http-reward-flusher {server.url}"]
        for thread in flushers:
            thread.join(timeout=30)
        assert not any(thread.is_alive() for thread in flushers)
        # ...and the next call starts one again.
        assert http_reward(sample("four"), url=server.url, batch_window_s=0) == 4.0


def test_a_stage_reward_named_http_scores_through_the_server():
    with reward_server(length_rewards) as server:
        combined = CombinedReward([RewardSpec(name="http", weight=0.5, args={"url": server.url,
                                                                           "batch_window_s": 0})])
        score = combined.score(sample("abcd"))
    assert (score.total, score.components) == (2.0, {"http": 4.0})


@pytest.mark.parametrize(("args", "problem"), [
    ({}, "'url' must be an http"),
    ({"url": "ftp://host/score"}, "'url' must be an http"),
    ({"url": "http://host/score", "retries": -1}, "'retries' must be at least 0"),
    ({"url": "http://host/score", "timeout_s": 0}, "'timeout_s' must be above 0"),
    ({"url": "http://host/score", "max_batch": 0}, "'max_batch' must be at least 1"),
    ({"url": "http://host/score", "headers": {"X-Key": 3}}, "'headers' must map"),
    ({"url": "http://host/score", "batch": 3}, "unknown argument 'batch'"),
])
def test_bad_http_args_fail_at_load(args, problem):
    with pytest.raises(RewardLoadError, match=problem):
        load_reward(RewardSpec(name="http", args=args))
