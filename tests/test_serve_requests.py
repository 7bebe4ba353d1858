"""HTTP bodies -> engine inputs and GenerationResults -> HTTP bodies, rollmesh's extension fields
(session, minimum weight version, routed experts), and error mapping, without Ray or Serve
running. The served model is the demo's (its tokenizer encodes prompts and decodes answers)."""

from __future__ import annotations

import base64
import json
import math
from pathlib import Path

import numpy as np
import pytest
from ray.exceptions import ActorDiedError, RayTaskError

from rollmesh.chat import ChatModel
from rollmesh.config import ModelConfig
from rollmesh.engine.errors import (
    CapacityError,
    InvalidRequestError,
    KvCapacityError,
    PromptTooLongError,
    StaleWeightsError,
    VersionUnavailableError,
    WeightsFileError,
)
from rollmesh.engine.protocols import GenerateOptions, GenerationResult
from rollmesh.engine.sglang_client import RoutedExpertsShape, decode_routed_experts
from rollmesh.messages.base import SamplingParams
from rollmesh.serve_apps.errors import (
    EngineUnavailableError,
    InvalidApiRequestError,
    ModelNotFoundError,
)
from rollmesh.serve_apps.chat_requests import chat_inputs, chat_response
from rollmesh.serve_apps.stream_events import chat_events, whole
from rollmesh.serve_apps.generate_extensions import encode_routed_experts, generate_options
from rollmesh.serve_apps.generation_requests import (
    ServedModel,
    completion_inputs,
    completion_response,
    generate_inputs,
    generate_request_id,
    generate_response,
)
from rollmesh.serve_apps.http_shapes import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    GenerateSamplingParams,
)
from rollmesh.serve_apps.inference_app import invalid_body_error
from rollmesh.serve_apps.openai_logprobs import token_text
from rollmesh.serve_apps.router_calls import COMPLETION_PARAMS, GENERATE_PARAMS, api_error_from_ray
from rollmesh.serve_apps.weight_admin import requested_weight_version

pytestmark = pytest.mark.unit

# A context of 16 tokens, so that length limits are reached with short prompts.
MAX_SEQ_LEN = 16


@pytest.fixture(scope="module")
def chat(demo_model_dir: Path) -> ChatModel:
    return ChatModel.from_config(ModelConfig(path=str(demo_model_dir)))


def served_model(chat: ChatModel, name: str = "tiny", routes_experts: bool | None = None) -> ServedModel:
    return ServedModel(name=name, max_seq_len=MAX_SEQ_LEN, vocab_size=chat.vocab_size, chat=chat,
                       routes_experts=routes_experts)


@pytest.fixture(scope="module")
def served(chat: ChatModel) -> ServedModel:
    return served_model(chat)


@pytest.fixture(scope="module")
def moe(chat: ChatModel) -> ServedModel:
    return served_model(chat, "moe", routes_experts=True)


def result(token_ids: list[int], finish_reason: str = "length") -> GenerationResult:
    return GenerationResult(
        token_ids=token_ids, logprobs=[-0.5] * len(token_ids), versions=[3] * len(token_ids),
        finish_reason=finish_reason, prompt_len=4, request_id="r",
    )


def test_completion_prompt_is_the_models_tokens_and_sampling_keeps_openai_defaults(
    chat: ChatModel, served: ServedModel,
) -> None:
    ids, sampling = completion_inputs(CompletionRequest(prompt="molar mass of H2O?"), served)
    assert ids == chat.encode("molar mass of H2O?")  # no special token added
    assert len(ids) < len("molar mass of H2O?")  # BPE merges, not bytes
    assert chat.decode(ids) == "molar mass of H2O?"
    assert sampling == SamplingParams(max_new_tokens=16, temperature=1.0, top_p=1.0, stop=[])


def test_completion_single_stop_string_becomes_a_list(served: ServedModel) -> None:
    _, sampling = completion_inputs(CompletionRequest(prompt="a", stop="\n"), served)
    assert sampling.stop == ["\n"]


def test_range_errors_name_the_http_parameter(served: ServedModel) -> None:
    with pytest.raises(InvalidApiRequestError) as raised:
        completion_inputs(CompletionRequest(prompt="a", temperature=10.5), served)
    assert raised.value.param == "temperature"
    assert "temperature" in raised.value.message and "10.0" in raised.value.message

    request = GenerateRequest(input_ids=[1], sampling_params=GenerateSamplingParams(top_p=2.0))
    with pytest.raises(InvalidApiRequestError) as raised:
        generate_inputs(request, served)
    assert raised.value.param == "sampling_params.top_p"


def test_unknown_model_is_404_and_no_model_means_the_served_one(served: ServedModel) -> None:
    with pytest.raises(ModelNotFoundError) as raised:
        completion_inputs(CompletionRequest(model="other", prompt="a"), served)
    assert raised.value.status == 404
    completion_inputs(CompletionRequest(prompt="a"), served)


def test_prompt_that_leaves_no_room_to_generate_is_rejected(chat: ChatModel, served: ServedModel) -> None:
    assert len(chat.encode("7" * 15)) == 15  # digits are one token each (Qwen2's pre-tokenizer)
    completion_inputs(CompletionRequest(prompt="7" * 15), served)  # 15 fits in 16
    with pytest.raises(InvalidApiRequestError) as raised:
        completion_inputs(CompletionRequest(prompt="7" * 16), served)
    assert raised.value.code == "prompt_too_long"
    with pytest.raises(InvalidApiRequestError) as raised:
        completion_inputs(CompletionRequest(prompt=""), served)
    assert (raised.value.code, raised.value.param) == ("invalid_value", "prompt")


def test_generate_default_budget_is_clipped_to_the_context(served: ServedModel) -> None:
    _, sampling = generate_inputs(GenerateRequest(input_ids=[1]), served)
    assert sampling.max_new_tokens == served.max_seq_len


def test_completion_text_drops_the_stop_string_but_generate_text_keeps_it(
    chat: ChatModel, served: ServedModel,
) -> None:
    ids = chat.encode("ab\n")
    assert len(ids) == 3
    finished = result(ids, finish_reason="stop")
    sampling = SamplingParams(stop=["\n"])
    completion = completion_response(
        finished, request_id="cmpl-1", created=1, served=served, sampling=sampling,
        with_logprobs=True,
    )
    (choice,) = completion.choices
    assert choice.text == "ab"
    assert choice.finish_reason == "stop"
    assert choice.logprobs.tokens == ["a", "b", "\n"]
    assert choice.weight_versions == [3, 3, 3]
    assert completion.usage.total_tokens == 4 + 3

    generated = generate_response(
        finished, request_id="1", served=served, sampling=sampling, return_logprob=True
    )
    assert generated.text == "ab\n"
    assert generated.meta_info.finish_reason.matched == "\n"
    assert generated.meta_info.output_token_logprobs == [(-0.5, i, None) for i in ids]
    assert generated.meta_info.weight_version == 3


def test_eos_finishes_as_stop_with_the_end_of_turn_id_matched(chat: ChatModel, served: ServedModel) -> None:
    ids = chat.encode("A<|im_end|>")
    end_of_turn = ids[-1]
    assert end_of_turn in chat.end_of_turn_ids
    finished = result(ids, finish_reason="eos")
    generated = generate_response(
        finished, request_id="1", served=served, sampling=SamplingParams(), return_logprob=False
    )
    assert generated.meta_info.finish_reason.type == "stop"
    assert generated.meta_info.finish_reason.matched == end_of_turn
    assert generated.meta_info.output_token_logprobs is None
    assert generated.text == "A<|im_end|>"  # /generate's text is output_ids decoded, every id
    completion = completion_response(finished, request_id="c", created=1, served=served,
                                     sampling=SamplingParams(), with_logprobs=False)
    assert completion.choices[0].text == "A"  # the end of turn is no text
    assert completion.choices[0].finish_reason == "stop"


def test_non_finite_logprob_becomes_null(served: ServedModel) -> None:
    finished = GenerationResult([65], [-math.inf], [0], "length", 1)
    generated = generate_response(
        finished, request_id="1", served=served, sampling=SamplingParams(), return_logprob=True
    )
    assert generated.meta_info.output_token_logprobs == [(None, 65, None)]


def test_token_text_is_each_tokens_text_with_specials_spelled(chat: ChatModel) -> None:
    ids = chat.encode("molar mass<|im_end|>")
    assert [token_text(t, chat) for t in ids][-1] == "<|im_end|>"
    assert "".join(token_text(t, chat) for t in ids) == "molar mass<|im_end|>"


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


def from_actor(cause: Exception) -> RayTaskError:
    return RayTaskError("decode", "traceback", cause).as_instanceof_cause()


def test_a_version_the_engine_lacks_is_a_retryable_503_with_retry_after() -> None:
    error = api_error_from_ray(from_actor(VersionUnavailableError(7, 3, request_id="r")))
    assert (error.status, error.code, error.param) == (503, "version_unavailable",
                                                       "min_weight_version")
    assert error.headers() == {"Retry-After": "1"}
    assert "retryable" in error.message and "7" in error.message
    assert api_error_from_ray(from_actor(CapacityError(8))).headers() == {}


def test_engine_field_names_become_the_routes_parameter_names() -> None:
    kv = from_actor(KvCapacityError(9, 4))
    assert (api_error_from_ray(kv, GENERATE_PARAMS).status,
            api_error_from_ray(kv, GENERATE_PARAMS).code) == (400, "kv_capacity_exceeded")
    assert api_error_from_ray(kv, GENERATE_PARAMS).param == "sampling_params.max_new_tokens"
    assert api_error_from_ray(kv, COMPLETION_PARAMS).param == "max_tokens"
    too_long = from_actor(PromptTooLongError(70, 63))
    assert api_error_from_ray(too_long, GENERATE_PARAMS).param == "input_ids"
    assert api_error_from_ray(too_long).param == "prompt"
    dense = api_error_from_ray(from_actor(InvalidRequestError(
        "the model is dense", field="return_routed_experts")))
    assert (dense.status, dense.code, dense.param) == (400, "unsupported_value",
                                                       "return_routed_experts")


def test_weights_that_cannot_be_loaded_are_400s() -> None:
    missing = api_error_from_ray(from_actor(WeightsFileError("/no/such.safetensors", "gone")))
    assert (missing.status, missing.code, missing.param) == (400, "invalid_weights", "model_path")
    stale = api_error_from_ray(from_actor(StaleWeightsError(2, 5)))
    assert (stale.status, stale.code) == (400, "stale_weight_version")


# -- rollmesh's extension fields ----------------------------------------------------------------

def test_extension_fields_become_the_engines_generate_options(served: ServedModel, moe: ServedModel) -> None:
    request = GenerateRequest(input_ids=[1, 2, 3], session_id="agent-7", min_weight_version=4,
                              return_routed_experts=True, routed_experts_start_len=3)
    assert generate_options(request, prompt_len=3, served=moe) == GenerateOptions(
        session_id="agent-7", min_version=4, return_routed_experts=True,
        routed_experts_start_len=3)
    assert generate_options(GenerateRequest(input_ids=[1]), prompt_len=1,
                            served=served) == GenerateOptions()


def test_openai_requests_take_the_extension_fields_from_extra_body(moe: ServedModel) -> None:
    extra = {"session_id": "s", "min_weight_version": 2, "return_routed_experts": True,
             "routed_experts_start_len": 1, "routed_experts_dtype": "int32"}
    chat_request = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], **extra})
    completion = CompletionRequest.model_validate({"prompt": "hi", **extra})
    for request in (chat_request, completion):
        options = generate_options(request, prompt_len=5, served=moe)
        assert options == GenerateOptions(session_id="s", min_version=2,
                                          return_routed_experts=True, routed_experts_start_len=1)
        assert request.routed_experts_dtype == "int32"


@pytest.mark.parametrize(("fields", "routes_experts", "param", "code"), [
    ({"routed_experts_start_len": 4}, True, "routed_experts_start_len", "invalid_value"),
    ({"routed_experts_start_len": -1}, True, "routed_experts_start_len", "invalid_value"),
    ({"return_routed_experts": True}, False, "return_routed_experts", "unsupported_value"),
    ({"session_id": ""}, True, "session_id", "invalid_value"),
    ({"session_id": "s" * 257}, True, "session_id", "invalid_value"),
    ({"min_weight_version": -1}, True, "min_weight_version", "invalid_value"),
])
def test_bad_extension_fields_name_their_parameter(
    chat: ChatModel, fields: dict, routes_experts: bool, param: str, code: str
) -> None:
    request = GenerateRequest(input_ids=[1, 2, 3], **fields)
    served = served_model(chat, routes_experts=routes_experts)
    with pytest.raises(InvalidApiRequestError) as raised:
        generate_options(request, prompt_len=3, served=served)
    assert (raised.value.status, raised.value.param, raised.value.code) == (400, param, code)


def test_a_server_not_told_the_model_kind_leaves_the_dense_check_to_the_engine(served: ServedModel) -> None:
    request = GenerateRequest(input_ids=[1], return_routed_experts=True)
    assert generate_options(request, prompt_len=1, served=served).return_routed_experts


def test_unknown_routed_experts_dtype_is_refused_by_the_body_schema() -> None:
    with pytest.raises(ValueError):
        GenerateRequest.model_validate({"input_ids": [1], "routed_experts_dtype": "float16"})


def test_sglang_rid_is_the_request_id_and_one_is_made_up_without_it() -> None:
    assert generate_request_id(GenerateRequest(input_ids=[1], rid="turn-3")) == "turn-3"
    assert len(generate_request_id(GenerateRequest(input_ids=[1]))) == 32
    with pytest.raises(InvalidApiRequestError) as raised:
        generate_request_id(GenerateRequest(input_ids=[1], rid=""))
    assert raised.value.param == "rid"


def routed_result(rows: np.ndarray, start: int = 1, cached: int = 2) -> GenerationResult:
    # prompt 4, generated 3: rows for positions [start, 4 + 3 - 1)
    return GenerationResult(
        token_ids=[65, 66, 67], logprobs=[-0.5] * 3, versions=[1] * 3, finish_reason="length",
        prompt_len=4, request_id="r", cached_tokens=cached, routed_experts=rows,
        routed_experts_start=start,
    )


ROWS = np.arange(5 * 2 * 2, dtype=np.uint8).reshape(5, 2, 2) % 8  # 5 rows, 2 layers, top 2


def test_routed_experts_are_compact_base64_in_c_order() -> None:
    routed = encode_routed_experts(routed_result(ROWS), "compact")
    assert (routed.routed_experts_dtype, routed.routed_experts_shape,
            routed.routed_experts_start_len) == ("uint8", [5, 2, 2], 1)
    decoded = np.frombuffer(base64.b64decode(routed.routed_experts), dtype=np.uint8)
    np.testing.assert_array_equal(decoded.reshape(5, 2, 2), ROWS)

    wide = (ROWS.astype(np.uint16) + 300).astype(">u2")  # more than 256 experts, any byte order
    routed = encode_routed_experts(routed_result(wide), "compact")
    assert routed.routed_experts_dtype == "uint16"
    decoded = np.frombuffer(base64.b64decode(routed.routed_experts), dtype="<u2")
    np.testing.assert_array_equal(decoded.reshape(5, 2, 2), wide)
    assert encode_routed_experts(routed_result(None), "compact") is None


def test_int32_routed_experts_are_what_an_sglang_client_decodes() -> None:
    routed = encode_routed_experts(routed_result(ROWS, start=1), "int32")
    assert routed.routed_experts_dtype == "int32"
    rows, ignored_start = decode_routed_experts(
        routed.routed_experts, RoutedExpertsShape(num_layers=2, top_k=2, num_experts=8),
        seqlen=4 + 3, start_len=1)
    np.testing.assert_array_equal(rows, ROWS)
    assert not ignored_start


def test_generate_meta_info_has_cached_tokens_and_routed_experts_only_when_present(
    served: ServedModel, moe: ServedModel,
) -> None:
    plain = generate_response(result([65]), request_id="1", served=served,
                              sampling=SamplingParams(), return_logprob=False)
    meta = json.loads(plain.model_dump_json(exclude_none=True))["meta_info"]
    assert meta["cached_tokens"] == 0
    assert not any(key.startswith("routed_experts") for key in meta)

    routed = generate_response(routed_result(ROWS), request_id="2", served=moe,
                               sampling=SamplingParams(), return_logprob=False,
                               routed_experts_dtype="int32")
    meta = routed.meta_info
    assert meta.cached_tokens == 2
    assert (meta.routed_experts_dtype, meta.routed_experts_shape,
            meta.routed_experts_start_len) == ("int32", [5, 2, 2], 1)
    assert len(base64.b64decode(meta.routed_experts)) == 5 * 2 * 2 * 4


async def test_openai_choices_carry_routed_experts_in_the_rollmesh_object(
    served: ServedModel, moe: ServedModel,
) -> None:
    finished = routed_result(ROWS, cached=3)
    completion = completion_response(finished, request_id="cmpl-1", created=1, served=moe,
                                     sampling=SamplingParams(), with_logprobs=False)
    prompt = chat_inputs(ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}]}), moe)
    chat = chat_response(finished, prompt, request_id="chatcmpl-1", created=1, served=moe)
    for response in (completion, chat):
        (choice,) = response.choices
        assert choice.rollmesh.routed_experts_shape == [5, 2, 2]
        assert response.usage.prompt_tokens_details.cached_tokens == 3
    assert completion_response(result([65]), request_id="c", created=1, served=served,
                               sampling=SamplingParams(), with_logprobs=False
                               ).choices[0].rollmesh is None

    events = [event async for event in chat_events(whole(finished), prompt,
                                                   request_id="chatcmpl-2", created=1, served=moe)]
    chunks = [json.loads(event[len("data: "):]) for event in events[:-1]]
    assert "rollmesh" not in chunks[0]["choices"][0]
    assert chunks[-1]["choices"][0]["rollmesh"]["routed_experts_dtype"] == "uint8"


def test_update_weight_version_is_the_requests_or_one_past_the_newest() -> None:
    assert requested_weight_version(None, 4) == 5
    assert requested_weight_version(9, 4) == 9
    assert requested_weight_version("12", 4) == 12  # SGLang sends a string
    for bad in ("v2", "-1", -1):
        with pytest.raises(InvalidApiRequestError) as raised:
            requested_weight_version(bad, 4)
        assert raised.value.param == "weight_version"


def test_a_rayservice_app_without_a_model_directory_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    from rollmesh.config import ConfigError
    from rollmesh.serve_apps.rayservice_entry import app_builder

    config = tmp_path / "rollmesh.toml"
    config.write_text('namespace = "default"\n')
    monkeypatch.delenv("ROLLMESH_MODEL__PATH", raising=False)
    monkeypatch.setenv("ROLLMESH_API_KEY", "test-key")
    with pytest.raises(ConfigError, match="model.path must name the model directory") as raised:
        app_builder({"config": str(config)})
    assert raised.value.path == "model.path"
