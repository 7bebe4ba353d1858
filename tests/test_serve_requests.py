"""HTTP bodies -> engine inputs and GenerationResults -> HTTP bodies, and error mapping, without
Ray or Serve running."""

from __future__ import annotations

import math

import pytest
from ray.exceptions import ActorDiedError, RayTaskError

from rollmesh.engine.errors import CapacityError, InvalidRequestError, PromptTooLongError
from rollmesh.engine.protocols import GenerationResult
from rollmesh.engine.tokenizer import BOS_ID, EOS_ID
from rollmesh.messages.base import SamplingParams
from rollmesh.serve_apps.errors import (
    EngineUnavailableError,
    InvalidApiRequestError,
    ModelNotFoundError,
)
from rollmesh.serve_apps.generation_requests import (
    ServedModel,
    completion_inputs,
    completion_response,
    generate_inputs,
    generate_response,
    token_text,
)
from rollmesh.serve_apps.http_shapes import (
    CompletionRequest,
    GenerateRequest,
    GenerateSamplingParams,
)
from rollmesh.serve_apps.inference_app import api_error_from_ray, invalid_body_error

pytestmark = pytest.mark.unit

SERVED = ServedModel(name="tiny", max_seq_len=16, vocab_size=260)


def result(token_ids: list[int], finish_reason: str = "length") -> GenerationResult:
    return GenerationResult(
        token_ids=token_ids, logprobs=[-0.5] * len(token_ids), versions=[3] * len(token_ids),
        finish_reason=finish_reason, prompt_len=4, request_id="r",
    )


def test_completion_prompt_is_bytes_after_bos_and_sampling_keeps_openai_defaults() -> None:
    ids, sampling = completion_inputs(CompletionRequest(prompt="hé"), SERVED)
    assert ids == [BOS_ID, *"hé".encode()]
    assert sampling == SamplingParams(max_new_tokens=16, temperature=1.0, top_p=1.0, stop=[])


def test_completion_single_stop_string_becomes_a_list() -> None:
    _, sampling = completion_inputs(CompletionRequest(prompt="a", stop="\n"), SERVED)
    assert sampling.stop == ["\n"]


def test_range_errors_name_the_http_parameter() -> None:
    with pytest.raises(InvalidApiRequestError) as raised:
        completion_inputs(CompletionRequest(prompt="a", temperature=10.5), SERVED)
    assert raised.value.param == "temperature"
    assert "temperature" in raised.value.message and "10.0" in raised.value.message

    request = GenerateRequest(input_ids=[1], sampling_params=GenerateSamplingParams(top_p=2.0))
    with pytest.raises(InvalidApiRequestError) as raised:
        generate_inputs(request, SERVED)
    assert raised.value.param == "sampling_params.top_p"


def test_unknown_model_is_404_and_no_model_means_the_served_one() -> None:
    with pytest.raises(ModelNotFoundError) as raised:
        completion_inputs(CompletionRequest(model="other", prompt="a"), SERVED)
    assert raised.value.status == 404
    completion_inputs(CompletionRequest(prompt="a"), SERVED)


def test_prompt_that_leaves_no_room_to_generate_is_rejected() -> None:
    completion_inputs(CompletionRequest(prompt="x" * 14), SERVED)  # BOS + 14 = 15 fits
    with pytest.raises(InvalidApiRequestError) as raised:
        completion_inputs(CompletionRequest(prompt="x" * 15), SERVED)
    assert raised.value.code == "prompt_too_long"


def test_generate_default_budget_is_clipped_to_the_context() -> None:
    _, sampling = generate_inputs(GenerateRequest(input_ids=[BOS_ID]), SERVED)
    assert sampling.max_new_tokens == SERVED.max_seq_len


def test_completion_text_drops_the_stop_string_but_generate_text_keeps_it() -> None:
    finished = result(list(b"ab\ncd"[:3]), finish_reason="stop")
    sampling = SamplingParams(stop=["\n"])
    completion = completion_response(
        finished, request_id="cmpl-1", created=1, served=SERVED, sampling=sampling,
        with_logprobs=True,
    )
    (choice,) = completion.choices
    assert choice.text == "ab"
    assert choice.finish_reason == "stop"
    assert choice.logprobs.tokens == ["a", "b", "\n"]
    assert choice.weight_versions == [3, 3, 3]
    assert completion.usage.total_tokens == 4 + 3

    generated = generate_response(
        finished, request_id="1", served=SERVED, sampling=sampling, return_logprob=True
    )
    assert generated.text == "ab\n"
    assert generated.meta_info.finish_reason.matched == "\n"
    assert generated.meta_info.output_token_logprobs == [(-0.5, 97, None), (-0.5, 98, None),
                                                         (-0.5, 10, None)]
    assert generated.meta_info.weight_version == 3


def test_eos_finishes_as_stop_with_the_eos_id_matched() -> None:
    finished = result([65, EOS_ID], finish_reason="eos")
    generated = generate_response(
        finished, request_id="1", served=SERVED, sampling=SamplingParams(), return_logprob=False
    )
    assert generated.meta_info.finish_reason.type == "stop"
    assert generated.meta_info.finish_reason.matched == EOS_ID
    assert generated.meta_info.output_token_logprobs is None
    assert generated.text == "A"


def test_non_finite_logprob_becomes_null() -> None:
    finished = GenerationResult([65], [-math.inf], [0], "length", 1)
    generated = generate_response(
        finished, request_id="1", served=SERVED, sampling=SamplingParams(), return_logprob=True
    )
    assert generated.meta_info.output_token_logprobs == [(None, 65, None)]


def test_token_text_shows_non_ascii_bytes_and_specials() -> None:
    assert [token_text(t) for t in (65, 0xC3, BOS_ID, EOS_ID)] == [
        "A", "bytes:\\xc3", "<bos>", "<eos>"]


def test_engine_errors_from_actors_map_to_http_statuses() -> None:
    def from_actor(cause: Exception) -> RayTaskError:
        return RayTaskError("prefill", "traceback", cause).as_instanceof_cause()

    too_long = api_error_from_ray(from_actor(PromptTooLongError(70, 63)))
    assert (too_long.status, too_long.code) == (400, "prompt_too_long")
    invalid = api_error_from_ray(from_actor(InvalidRequestError("bad", field="input_ids")))
    assert (invalid.status, invalid.param) == (400, "input_ids")
    assert isinstance(api_error_from_ray(from_actor(CapacityError(8))), EngineUnavailableError)
    assert api_error_from_ray(from_actor(RuntimeError("boom"))).status == 500
    assert api_error_from_ray(ActorDiedError()).status == 503


def test_malformed_json_and_wrong_types_are_one_400_each() -> None:
    malformed = invalid_body_error(
        [{"type": "json_invalid", "loc": ("body", 3), "msg": "JSON decode error",
          "ctx": {"error": "Expecting value"}}]
    )
    assert malformed.code == "invalid_json" and "Expecting value" in malformed.message
    wrong = invalid_body_error(
        [{"type": "float_type", "loc": ("body", "temperature"), "msg": "Input should be a number"}]
    )
    assert (wrong.status, wrong.param) == (400, "temperature")
    assert wrong.message == "temperature: Input should be a number"
