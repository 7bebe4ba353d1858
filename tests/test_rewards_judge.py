"""The ``judge`` reward against a local OpenAI-compatible chat-completions server: the prompt
template filled with the question, the reference and the response, the judge's score found and
scaled, retries, and a judge that does not answer or gives no score is a typed failure."""

from __future__ import annotations

import pytest

from support.reward_servers import Request, reward_server
from rollmesh.rewards.combined import load_reward
from rollmesh.rewards.errors import RewardInputError, RewardLoadError, RewardUnavailableError
from rollmesh.rewards.judge_reward import chat_completions_url, judge_reward
from rollmesh.rewards.reward_input import RewardInput
from rollmesh.run_config import RewardSpec

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

TEMPLATE = "Q: {question}\nReference: {answer}\nResponse: {response}\nReply with Score: 0-10. {\"json\": 1}"


def completion(content: str | None) -> dict:
    """A chat completion object exactly as OpenAI's API reference shows it
    (https://platform.openai.com/docs/api-reference/chat/object)."""
    return {"id": "chatcmpl-1", "object": "chat.completion", "created": 1733100000, "model": "judge-1",
            "system_fingerprint": "fp_1",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": content, "refusal": None},
                         "logprobs": None, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 50, "completion_tokens": 5, "total_tokens": 55}}


def judged(content: str | None):
    return lambda request, number: (200, completion(content))


def sample(response: str = "It is 4.", answer: str | None = "4") -> RewardInput:
    return RewardInput(row={"prompt": "raw row prompt"}, answer=answer, final_text=response, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": response}])


def judge(url: str, **args) -> float:
    return judge_reward(sample(), url=url, **{"model": "judge-1", "prompt": TEMPLATE, "max_score": 10,
                                              "backoff_s": 0.01, **args})


def test_the_prompt_is_filled_and_the_score_scaled():
    with reward_server(judged("The answer is right. Score: 8")) as server:
        assert judge(f"{server.url}/v1", temperature=0.5, max_tokens=64) == pytest.approx(0.8)
    (request,) = server.requests
    assert request.path == "/v1/chat/completions"
    assert request.body == {"model": "judge-1", "temperature": 0.5, "max_tokens": 64, "messages": [
        {"role": "user", "content": "Q: What is 2+2?\nReference: 4\nResponse: It is 4.\n"
                                    "Reply with Score: 0-10. {\"json\": 1}"}]}


def test_the_last_score_in_the_judges_answer_counts():
    with reward_server(judged("A Score: 2 would be harsh; a Score: 10 too kind.\nScore: 7")) as server:
        assert judge(server.url) == pytest.approx(0.7)


def test_a_placeholder_in_the_response_is_left_as_the_model_wrote_it():
    with reward_server(judged("score=1")) as server:
        judge_reward(sample(response="see {answer}"), url=server.url, model="m", prompt="{response}|{answer}")
    assert server.requests[0].body["messages"][0]["content"] == "see {answer}|4"


def test_a_prompt_file_and_yes_no_labels(tmp_path):
    prompt = tmp_path / "judge.txt"
    prompt.write_text("Is {response} the same as {answer}? Answer yes or no.")
    with reward_server(judged("Verdict: YES, it matches.")) as server:
        assert judge_reward(sample(), url=server.url, model="m", prompt_file=str(prompt),
                            score_regex=r"(?i)verdict:\s*(yes|no)", labels={"yes": 1.0, "no": 0.0}) == 1.0
    assert server.requests[0].body["messages"][0]["content"] == "Is It is 4. the same as 4? Answer yes or no."


def test_a_prompt_file_the_worker_cannot_read_is_a_typed_failure(tmp_path):
    with pytest.raises(RewardUnavailableError, match="cannot be read here"):
        judge_reward(sample(), url="http://127.0.0.1:9", model="m", prompt_file=str(tmp_path / "gone.txt"))


def test_a_503_is_retried_and_then_the_score_comes():
    with reward_server(lambda request, n: (503, {}) if n == 0 else (200, completion("Score: 10"))) as server:
        assert judge(server.url) == 1.0
    assert len(server.requests) == 2


def test_a_judge_that_does_not_answer_is_a_typed_failure():
    def silent(request: Request, number: int) -> tuple[int, object]:
        server.closing.wait()
        return 200, completion("Score: 1")

    with reward_server(silent) as server:
        with pytest.raises(RewardUnavailableError, match="no answer within the timeout") as failed:
            judge(server.url, timeout_s=0.2, retries=1)
        assert len(server.requests) == 2
    assert failed.value.reward == "judge"


@pytest.mark.parametrize(("content", "problem"), [
    ("I think it is fine.", "no score in the judge's answer"),
    ("Score: 11", r"outside 0..10"),
    (None, "malformed answer"),
])
def test_an_answer_without_a_usable_score_is_a_typed_failure(content, problem):
    with reward_server(judged(content)) as server:
        with pytest.raises(RewardUnavailableError, match=problem):
            judge(server.url)
    assert len(server.requests) == 1


def test_an_answer_not_in_openai_shape_is_a_typed_failure():
    with reward_server(lambda request, n: (200, {"text": "Score: 3"})) as server:
        with pytest.raises(RewardUnavailableError, match="no choices"):
            judge(server.url)


def test_a_template_showing_the_reference_needs_a_row_with_one():
    with pytest.raises(RewardInputError, match="no answer"):
        judge_reward(sample(answer=None), url="http://127.0.0.1:9", model="m", prompt=TEMPLATE)


def test_the_endpoint_is_found_from_a_base_url():
    assert chat_completions_url("http://h:8000") == "http://h:8000/v1/chat/completions"
    assert chat_completions_url("http://h:8000/v1/") == "http://h:8000/v1/chat/completions"
    assert chat_completions_url("http://h/v1/chat/completions") == "http://h/v1/chat/completions"


@pytest.mark.parametrize(("args", "problem"), [
    ({"model": "m", "prompt": "{response}"}, "'url' must be an http"),
    ({"url": "http://h", "prompt": "{response}"}, "'model' is required"),
    ({"url": "http://h", "model": "m"}, "exactly one of 'prompt'"),
    ({"url": "http://h", "model": "m", "prompt_file": "/no/such/judge.txt"}, "no file"),
    ({"url": "http://h", "model": "m", "prompt": "x", "score_regex": "score: \\d"}, "needs a group"),
    ({"url": "http://h", "model": "m", "prompt": "x", "score_regex": "("}, "not a regular expression"),
    ({"url": "http://h", "model": "m", "prompt": "x", "max_score": 0}, "'max_score' must be above 0"),
    ({"url": "http://h", "model": "m", "prompt": "x", "labels": {"yes": "1"}}, "'labels' must map"),
])
def test_bad_judge_args_fail_at_load(args, problem):
    with pytest.raises(RewardLoadError, match=problem):
        load_reward(RewardSpec(name="judge", args=args))
