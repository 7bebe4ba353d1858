"""The SGLang backend against a fake SGLang HTTP server, its launcher, and (GPU only) a real SGLang.

SGLang pins a CUDA torch and cannot live in this venv, so on CPU the server is faked at its true
edge, the HTTP API: ``FakeSGLang`` (tests/support/sglang_fake.py, each behaviour with its upstream
source) answers the native endpoints as SGLang does and records every request. A real SGLang is tested on GPU machines by
tests/test_engine_sglang_gpu.py (``scripts/gpu/check_sglang.sh``).
"""

from __future__ import annotations

import asyncio
import pickle
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import pytest_asyncio
from opentelemetry import trace
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

from rollmesh.engine.errors import (
    InvalidRequestError,
    StaleWeightsError,
    VersionUnavailableError,
    WeightsError,
)
from rollmesh.engine.protocols import GenerateOptions, GrammarSpec, InferenceEngine
from rollmesh.engine.sglang_backend import SGLangEngine
from rollmesh.engine.sglang_client import (
    RoutedExpertsShape,
    SGLangHTTPError,
    SGLangResponseError,
    SGLangUnavailableError,
    build_generate_payload,
    decode_routed_experts,
    parse_finish_reason,
    parse_generate_response,
    parse_weight_version,
)
from rollmesh.engine.sglang_server import (
    SGLangServer,
    SGLangServerSpec,
    SGLangServerStartError,
    pick_free_port,
)
from rollmesh.messages.base import SamplingParams
from support.sglang_fake import EOS, SHAPE, FakeSGLang, encode_rows, expert

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

@pytest_asyncio.fixture
async def fake() -> Any:
    server = FakeSGLang()
    await server.start()
    yield server
    server.release()
    await server.stop()


@pytest_asyncio.fixture
async def engine(fake: FakeSGLang) -> Any:
    async with SGLangEngine([fake.url], routed_experts_shape=SHAPE, generate_timeout_s=30) as eng:
        yield eng


PROMPT = [1, 5, 6, 7, 8, 9]


# -- request and response mapping ---------------------------------------------------------


async def test_generate_sends_token_ids_sampling_and_asks_for_logprobs(engine, fake):
    sampling = SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=16, stop=["</tool>"])
    await engine.generate(PROMPT, sampling, request_id="r-1")

    [body] = fake.bodies("/generate")
    assert body == {
        "rid": "r-1", "input_ids": PROMPT, "return_logprob": True, "stream": False,
        "sampling_params": {"temperature": 0.7, "top_p": 0.9, "max_new_tokens": 16, "stop": ["</tool>"]},
    }
    assert isinstance(engine, InferenceEngine)


async def test_every_request_to_sglang_carries_the_callers_traceparent(engine, fake):
    caller = SpanContext(trace_id=0x4BF92F3577B34DA6A3CE929D0E0E4736, span_id=0x00F067AA0BA902B7,
                         is_remote=False, trace_flags=TraceFlags(TraceFlags.SAMPLED))
    with trace.use_span(NonRecordingSpan(caller)):
        await engine.generate(PROMPT, SamplingParams(max_new_tokens=2), request_id="r-trace")
        await engine.flush_cache()

    expected = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    sent = dict(fake.traceparents)
    assert sent["/generate"] == expected
    assert sent["/flush_cache"] == expected


async def test_generate_maps_tokens_logprobs_finish_and_one_version_per_token(engine, fake):
    fake.label = "3"
    result = await engine.generate(PROMPT, SamplingParams(max_new_tokens=16), request_id="r-2")

    assert result.token_ids == [100, 101, 102, 103, EOS]  # SGLang keeps the EOS id in output_ids
    assert result.logprobs == pytest.approx([-0.5, -0.6, -0.7, -0.8, -0.9])
    # SGLang's label at emission, recorded for every token (not a per-token truth).
    assert result.versions == [3, 3, 3, 3, 3]
    assert result.finish_reason == "eos"
    assert (result.prompt_len, result.request_id, result.cached_tokens) == (len(PROMPT), "r-2", 3)
    assert result.routed_experts is None

    short = await engine.generate(PROMPT, SamplingParams(max_new_tokens=2), request_id="r-3")
    assert (short.token_ids, short.finish_reason) == ([100, 101], "length")
    fake.finish_reason = {"type": "stop", "matched": "</tool>"}
    stopped = await engine.generate(PROMPT, SamplingParams(max_new_tokens=16), request_id="r-4")
    assert stopped.finish_reason == "stop"


@pytest.mark.parametrize(("raw", "expected"), [
    ({"type": "stop", "matched": 2}, "eos"),
    ({"type": "stop", "matched": [2, 7]}, "eos"),
    ({"type": "stop", "matched": "</tool>"}, "stop"),
    ({"type": "length", "length": 8}, "length"),
    ({"type": "abort", "message": "Abort in waiting queue"}, "abort"),
])
def test_finish_reason_mapping_follows_sglang_types(raw, expected):
    assert parse_finish_reason(raw) == expected


def test_abort_with_a_4xx_code_is_sglang_refusing_the_request():
    with pytest.raises(InvalidRequestError, match="too long"):
        parse_finish_reason({"type": "abort", "message": "too long", "status_code": 400}, request_id="r")


def test_weight_labels_read_as_int_versions():
    assert parse_weight_version("12") == 12
    assert parse_weight_version(4) == 4
    assert parse_weight_version("default") == 0  # SGLang's label before anyone set one
    with pytest.raises(ValueError, match="not an integer"):
        parse_weight_version("step-3")


async def test_non_integer_weight_label_is_a_response_error(engine, fake):
    fake.label = "v1.2"
    with pytest.raises(SGLangResponseError, match="not an integer") as info:
        await engine.generate(PROMPT, SamplingParams(max_new_tokens=4), request_id="r-5")
    assert (info.value.endpoint, info.value.request_id) == ("/generate", "r-5")


# -- routed experts -----------------------------------------------------------------------


async def test_routed_experts_come_back_compact_for_the_asked_slice(engine, fake):
    options = GenerateOptions(return_routed_experts=True, routed_experts_start_len=3)
    result = await engine.generate(PROMPT, SamplingParams(max_new_tokens=16), request_id="r-6",
                                   options=options)

    [body] = fake.bodies("/generate")
    assert (body["return_routed_experts"], body["routed_experts_start_len"]) == (True, 3)
    seq_end = len(PROMPT) + len(result.token_ids) - 1
    assert result.routed_experts.shape == (seq_end - 3, SHAPE.num_layers, SHAPE.top_k)
    assert result.routed_experts.dtype == np.uint8
    assert result.routed_experts_start == 3
    # Column j is sparse layer SHAPE.sparse_layers[j]: SGLang's dense-layer column is gone.
    assert result.routed_experts[0, 1, 1] == expert(3, 2, 1)
    assert result.routed_experts[-1, 0, 0] == expert(seq_end - 1, 0, 0)
    assert engine.statistics().start_len_ignored == 0


async def test_routed_experts_are_sliced_here_when_the_server_ignores_start_len(engine, fake):
    fake.honour_start_len = False
    options = GenerateOptions(return_routed_experts=True, routed_experts_start_len=4)
    result = await engine.generate(PROMPT, SamplingParams(max_new_tokens=16), request_id="r-7",
                                   options=options)

    seq_end = len(PROMPT) + len(result.token_ids) - 1
    assert result.routed_experts.shape[0] == seq_end - 4
    assert result.routed_experts[0, 0, 0] == expert(4, 0, 0)
    assert engine.statistics().start_len_ignored == 1


def test_routed_experts_use_uint16_beyond_256_experts():
    shape = RoutedExpertsShape(num_layers=2, top_k=2, num_experts=384)
    rows = np.array([[[300, 383], [0, 257]]] * 3)
    decoded, ignored = decode_routed_experts(encode_rows(rows), shape, seqlen=4, start_len=0)
    assert decoded.dtype == np.uint16 and not ignored
    assert decoded.tolist() == rows.tolist()


@pytest.mark.parametrize(("rows", "match"), [
    (np.zeros((5, 3, 2)), "30 expert ids fit no reading"),  # neither the slice nor the full range
    (np.full((3, 3, 2), 8), "outside"),
])
def test_routed_experts_that_fit_no_reading_are_refused(rows, match):
    with pytest.raises(ValueError, match=match):
        decode_routed_experts(encode_rows(rows), SHAPE, seqlen=8, start_len=4)


async def test_routed_experts_without_a_shape_or_beyond_the_prompt_are_invalid(fake):
    options = GenerateOptions(return_routed_experts=True)
    async with SGLangEngine([fake.url]) as shapeless:
        with pytest.raises(InvalidRequestError) as info:
            await shapeless.generate(PROMPT, SamplingParams(), request_id="r-8", options=options)
    assert info.value.field == "return_routed_experts"
    async with SGLangEngine([fake.url], routed_experts_shape=SHAPE) as eng:
        with pytest.raises(InvalidRequestError) as info:
            await eng.generate(PROMPT, SamplingParams(), request_id="r-9", options=GenerateOptions(
                return_routed_experts=True, routed_experts_start_len=len(PROMPT) + 1))
    assert info.value.field == "routed_experts_start_len"
    assert fake.bodies("/generate") == []


# -- weight versions and admin --------------------------------------------------------------


async def test_min_version_ahead_of_the_server_is_retryable_until_the_server_gets_there(engine, fake):
    fake.label = "3"
    with pytest.raises(VersionUnavailableError) as info:
        await engine.generate(PROMPT, SamplingParams(), request_id="r-10",
                              options=GenerateOptions(min_version=5))
    assert (info.value.min_version, info.value.current_version, info.value.retryable) == (5, 3, True)
    assert fake.bodies("/generate") == []

    fake.label = "5"  # another controller updated the server; the engine asks again
    result = await engine.generate(PROMPT, SamplingParams(), request_id="r-11",
                                   options=GenerateOptions(min_version=5))
    assert set(result.versions) == {5}


async def test_model_info_falls_back_to_the_legacy_endpoint():
    legacy = FakeSGLang(label="9", legacy=True)
    await legacy.start()
    try:
        async with SGLangEngine([legacy.url]) as eng:
            assert await eng.current_version() == 9
            assert await eng.current_version() == 9
    finally:
        await legacy.stop()


async def test_pause_update_resume_and_flush_reach_every_server(fake, tmp_path):
    second = FakeSGLang()
    await second.start()
    try:
        async with SGLangEngine([fake.url, second.url]) as eng:
            await eng.pause()
            await eng.update_weights_from_disk(str(tmp_path), 7)
            await eng.resume()
            await eng.flush_cache()
            assert await eng.current_version() == 7
            assert eng.statistics().versions == {fake.url: 7, second.url: 7}
    finally:
        await second.stop()
    for server in (fake, second):
        assert [path for path, _ in server.requests] == [
            "/pause_generation", "/update_weights_from_disk", "/continue_generation", "/flush_cache"]
        # In place, and no flush while paused: the defaults that keep SGLang's scheduler alive.
        assert server.bodies("/pause_generation") == [{"mode": "in_place"}]
        assert server.bodies("/update_weights_from_disk") == [{
            "model_path": str(tmp_path), "weight_version": "7",
            "flush_cache": False, "abort_all_requests": False}]


async def test_a_failed_weight_load_is_a_weights_error_and_older_versions_are_refused(engine, tmp_path):
    missing = str(tmp_path / "missing")
    with pytest.raises(WeightsError, match="no such path") as info:
        await engine.update_weights_from_disk(missing, 2)
    assert (info.value.path, info.value.version) == (missing, 2)

    await engine.update_weights_from_disk(str(tmp_path), 7)
    with pytest.raises(StaleWeightsError):
        await engine.update_weights_from_disk(str(tmp_path), 6)


async def test_pause_with_abort_returns_the_partial_output_marked_abort(engine, fake):
    fake.hold = True
    pending = asyncio.create_task(engine.generate(PROMPT, SamplingParams(max_new_tokens=16),
                                                  request_id="r-12"))
    while not fake.bodies("/generate"):
        await asyncio.sleep(0.01)  # polling the fake's record; the request is the signal
    await engine.pause("abort")
    result = await pending
    assert (result.finish_reason, result.token_ids) == ("abort", [100, 101])


@pytest.mark.parametrize(("prompt", "stop", "field"), [([], [], "input_ids"), (PROMPT, [""], "sampling.stop")])
async def test_requests_the_local_engine_refuses_are_refused_here_too(engine, fake, prompt, stop, field):
    with pytest.raises(InvalidRequestError) as info:
        await engine.generate(prompt, SamplingParams(stop=stop), request_id="r-17")
    assert info.value.field == field and fake.requests == []


async def test_an_unknown_pause_mode_is_refused_before_any_server_is_called(engine, fake):
    with pytest.raises(InvalidRequestError) as info:
        await engine.pause("drain")  # type: ignore[arg-type]
    assert info.value.field == "mode" and fake.requests == []


# -- routing and errors ---------------------------------------------------------------------


async def test_a_session_sticks_to_one_server_and_other_requests_go_round(fake):
    second = FakeSGLang()
    await second.start()
    try:
        async with SGLangEngine([fake.url, second.url]) as eng:
            for i in range(4):
                await eng.generate(PROMPT, SamplingParams(), request_id=f"rr-{i}")
            assert (len(fake.bodies("/generate")), len(second.bodies("/generate"))) == (2, 2)
            for i in range(3):
                await eng.generate(PROMPT, SamplingParams(), request_id=f"s-{i}",
                                   options=GenerateOptions(session_id="conversation-1"))
            counts = sorted((len(fake.bodies("/generate")), len(second.bodies("/generate"))))
            assert counts == [2, 5]
    finally:
        await second.stop()


async def test_a_refused_connection_is_a_retryable_unavailable_error():
    url = f"http://127.0.0.1:{pick_free_port()}"
    async with SGLangEngine([url]) as eng:
        with pytest.raises(SGLangUnavailableError) as info:
            await eng.generate(PROMPT, SamplingParams(), request_id="r-13")
    assert (info.value.url, info.value.request_id, info.value.retryable) == (url, "r-13", True)


async def test_a_4xx_from_generate_is_an_invalid_request_with_sglangs_message(engine, fake):
    with pytest.raises(InvalidRequestError, match="longer than the model's context length") as info:
        await engine.generate(list(range(100)), SamplingParams(), request_id="r-14")
    assert info.value.request_id == "r-14"


async def test_503_is_unavailable_and_500_is_an_http_error(engine, fake):
    fake.fail_status = 503
    with pytest.raises(SGLangUnavailableError, match="503"):
        await engine.generate(PROMPT, SamplingParams(), request_id="r-15")
    fake.fail_status = 500
    with pytest.raises(SGLangHTTPError) as info:
        await engine.generate(PROMPT, SamplingParams(), request_id="r-16")
    assert (info.value.status, info.value.message) == (500, "scripted 500")


def test_sglang_errors_survive_pickling_with_their_fields():
    errors = [
        SGLangUnavailableError("http://h:1", "refused", request_id="r"),
        SGLangHTTPError("http://h:1", "/flush_cache", 400, "busy"),
        SGLangResponseError("http://h:1", "/generate", "no meta_info", request_id="r"),
        SGLangServerStartError("http://h:1", "exited", log_path="/tmp/x.log", log_tail="boom"),
    ]
    for error in errors:
        copy = pickle.loads(pickle.dumps(error))
        assert type(copy) is type(error) and copy.__dict__ == error.__dict__
        assert str(copy) == str(error)


# -- the launcher ---------------------------------------------------------------------------


def test_launch_argv_carries_model_port_version_flags_and_extra_args():
    spec = SGLangServerSpec(model_path="/m", port=30001, python="/venv/bin/python", flags=["--tp-size", "2"],
                            enable_return_routed_experts=True, extra_args=["--mem-fraction-static", "0.5"])
    assert spec.argv() == [
        "/venv/bin/python", "-m", "sglang.launch_server", "--model-path", "/m",
        "--host", "127.0.0.1", "--port", "30001", "--weight-version", "0",
        "--enable-return-routed-experts", "--tp-size", "2", "--mem-fraction-static", "0.5",
    ]


async def test_a_server_that_exits_reports_the_end_of_its_log(tmp_path):
    # This venv has no sglang, so the launch fails the way a broken install would.
    spec = SGLangServerSpec(model_path="/m", port=pick_free_port(), python=sys.executable,
                            ready_timeout_s=30)
    server = SGLangServer(spec, tmp_path / "sglang.log")
    with pytest.raises(SGLangServerStartError, match="No module named") as info:
        await server.start()
    assert "exited with code" in info.value.reason and not server.running


FAKE_LAUNCH_SERVER = textwrap.dedent('''
    """Stands in for sglang.launch_server: records argv, forks a child, serves /health_generate."""
    import http.server, os, subprocess, sys, time
    args = sys.argv[1:]
    port = int(args[args.index("--port") + 1])
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    with open(os.environ["FAKE_SGLANG_RECORD"], "w") as record:
        record.write(f"{child.pid}\\n" + " ".join(args))
    time.sleep(0.3)  # not healthy at once, like a real model load

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health_generate" else 404)
            self.end_headers()

    http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
''')


async def test_the_launcher_waits_for_health_and_stop_ends_the_whole_process_group(tmp_path):
    package = tmp_path / "pkgs" / "sglang"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "launch_server.py").write_text(FAKE_LAUNCH_SERVER)
    record = tmp_path / "record.txt"
    spec = SGLangServerSpec(model_path="/m", port=pick_free_port(), python=sys.executable,
                            ready_timeout_s=30,
                            env={"PYTHONPATH": str(tmp_path / "pkgs"), "FAKE_SGLANG_RECORD": str(record)})
    async with SGLangServer(spec, tmp_path / "sglang.log") as server:
        assert server.running
        child_pid, argv = record.read_text().split("\n")
        assert argv.split() == spec.argv()[3:]
    assert not server.running
    # The forked child went down with the group. Its SIGKILL is pending from the moment stop()
    # returns, but a loaded machine may not run it to its end at once: poll, within a bound.
    assert await _ends_within(int(child_pid), timeout_s=30.0)


async def _ends_within(pid: int, *, timeout_s: float) -> bool:
    give_up = asyncio.get_running_loop().time() + timeout_s
    while _alive(pid):
        if asyncio.get_running_loop().time() > give_up:
            return False
        await asyncio.sleep(0.05)
    return True


def _alive(pid: int) -> bool:
    """Running, as opposed to gone or a zombie nobody reaped (its parent died first)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def test_top_logprobs_ask_sglang_for_top_logprobs_num_and_read_output_top_logprobs():
    options = GenerateOptions(top_logprobs=2)
    payload = build_generate_payload([1, 2], SamplingParams(), request_id="t", options=options)
    assert payload["top_logprobs_num"] == 2 and payload["return_logprob"] is True
    assert "top_logprobs_num" not in build_generate_payload(
        [1, 2], SamplingParams(), request_id="t", options=GenerateOptions())
    body = {"output_ids": [7, 8], "meta_info": {
        "output_token_logprobs": [[-0.1, 7, None], [-0.2, 8, None]],
        "output_top_logprobs": [[[-0.1, 7, None], [-2.0, 3, None]], [[-0.2, 8, None], [None, 4, None]]],
        "finish_reason": {"type": "length", "length": 2}, "weight_version": "1"}}
    answer = parse_generate_response(body, prompt_len=2, request_id="t", options=options, shape=None)
    assert answer.result.top_logprobs == [[(7, -0.1), (3, -2.0)], [(8, -0.2), (4, float("-inf"))]]
    del body["meta_info"]["output_top_logprobs"]
    with pytest.raises(ValueError, match="top logprobs"):
        parse_generate_response(body, prompt_len=2, request_id="t", options=options, shape=None)


@pytest.mark.parametrize("kind", ["json_schema", "ebnf", "structural_tag"])
def test_a_grammar_goes_to_sglang_under_its_own_sampling_param_and_flags_every_token(kind):
    options = GenerateOptions(grammar=GrammarSpec(kind, '{"type": "object"}'))
    payload = build_generate_payload([1, 2], SamplingParams(), request_id="t", options=options)
    assert payload["sampling_params"][kind] == '{"type": "object"}'
    assert not {"json_schema", "ebnf", "structural_tag"} & set(build_generate_payload(
        [1, 2], SamplingParams(), request_id="t", options=GenerateOptions())["sampling_params"])
    body = {"output_ids": [7, 8], "meta_info": {
        "output_token_logprobs": [[-0.1, 7, None], [0.0, 8, None]],
        "finish_reason": {"type": "stop", "matched": 8}, "weight_version": "1"}}
    answer = parse_generate_response(body, prompt_len=2, request_id="t", options=options, shape=None)
    assert answer.result.constrained == [True, True]
    free = parse_generate_response(body, prompt_len=2, request_id="t", options=GenerateOptions(), shape=None)
    assert free.result.constrained == []
