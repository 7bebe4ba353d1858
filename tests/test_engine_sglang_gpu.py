"""The SGLang backend against a real SGLang server: GPU machines only (scripts/gpu/check_sglang.sh).

One server for the module, launched as the mesh launches it (``sglang_launch.launch_plan``: no
``--skip-tokenizer-init``), on the model ``ROLLMESH_SGLANG_MODEL`` names (the script writes a tiny
random Qwen3-MoE with a dense layer among its MoE layers). Besides generation and a weight swap,
the three regressions of issue 22 run against the real thing:
1. a request with stop strings, as the agent loop always sends, is answered (not a 400);
2. weights swapped while requests run (pause in place, load without a flush, continue) leave the
   server alive and every request finished;
3. routed experts of a model with a dense layer decode (rows cut to the sparse layers), with or
   without the stop edge's extra row.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
from pathlib import Path

import pytest
import pytest_asyncio

from rollmesh.engine.errors import VersionUnavailableError
from rollmesh.engine.models import read_hf_config
from rollmesh.engine.protocols import GenerateOptions
from rollmesh.engine.sglang_backend import SGLangEngine
from rollmesh.engine.sglang_launch import launch_plan
from rollmesh.engine.sglang_routes import RoutedExpertsShape
from rollmesh.engine.sglang_server import SGLangServer, pick_free_port
from rollmesh.inference_config import SGLangConfig
from rollmesh.messages.base import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(1200)]

_GPU_SKIP = ("needs a CUDA GPU and an SGLang install (ROLLMESH_SGLANG_PYTHON, ROLLMESH_SGLANG_MODEL); "
             "run scripts/gpu/check_sglang.sh on a GPU machine")
PROMPT = [1, 5, 6, 7, 8, 9]


def _sglang_python_with_cuda() -> str | None:
    """The SGLang interpreter when it sees a GPU. Asked of that interpreter, not of this venv,
    whose torch is the CPU build."""
    python, model = os.environ.get("ROLLMESH_SGLANG_PYTHON"), os.environ.get("ROLLMESH_SGLANG_MODEL")
    if not python or not model:
        return None
    probe = subprocess.run([python, "-c", "import sglang, torch; assert torch.cuda.is_available()"],
                           capture_output=True, timeout=120)
    return python if probe.returncode == 0 else None


@pytest_asyncio.fixture(scope="module")
async def served(tmp_path_factory: pytest.TempPathFactory):
    python = _sglang_python_with_cuda()
    if python is None:
        pytest.skip(_GPU_SKIP)
    model = os.environ["ROLLMESH_SGLANG_MODEL"]
    shape = RoutedExpertsShape.of_model(read_hf_config(Path(model) / "config.json"))
    extra = os.environ.get("ROLLMESH_SGLANG_EXTRA_ARGS", "--disable-cuda-graph --mem-fraction-static 0.3")
    config = SGLangConfig(python=python, extra_args=extra.split())
    [spec] = launch_plan(config, index=0, model_path=model, routed_experts=shape is not None,
                         pick_port=pick_free_port).servers
    assert "--skip-tokenizer-init" not in spec.argv()
    log = tmp_path_factory.mktemp("sglang") / "sglang.log"
    async with SGLangServer(spec, log) as server, \
            SGLangEngine([server.url], routed_experts_shape=shape, generate_timeout_s=300) as engine:
        yield server, engine, model, shape


async def test_real_sglang_generates_and_swaps_weights(served):
    server, engine, model, _ = served
    sampling = SamplingParams(temperature=0.0, max_new_tokens=8)
    first = await engine.generate(PROMPT, sampling, request_id="gpu-1")
    assert 1 <= len(first.token_ids) <= 8 and len(first.logprobs) == len(first.token_ids)
    assert all(lp <= 0.0 for lp in first.logprobs)
    base = await engine.current_version()
    assert set(first.versions) == {base}

    await engine.swap_weights_from_disk(model, base + 1)
    assert await engine.current_version() == base + 1
    again = await engine.generate(PROMPT, sampling, request_id="gpu-2", options=GenerateOptions(min_version=base + 1))
    assert set(again.versions) == {base + 1}
    assert again.token_ids == first.token_ids  # the same weights reloaded, greedy
    with pytest.raises(VersionUnavailableError):
        await engine.generate(PROMPT, sampling, request_id="gpu-3", options=GenerateOptions(min_version=base + 9))


async def test_regression_stop_strings_are_answered(served):
    _, engine, _, _ = served
    result = await engine.generate(PROMPT, SamplingParams(temperature=0.0, max_new_tokens=16,
                                                          stop=["</tool_call>", "\n\n"]),
                                   request_id="gpu-stop")
    assert result.finish_reason in ("stop", "eos", "length")


async def test_regression_weights_swapped_under_load_keep_the_server_alive(served):
    server, engine, model, _ = served
    base = await engine.current_version()
    running = [asyncio.create_task(engine.generate(PROMPT, SamplingParams(temperature=1.0, max_new_tokens=512),
                                                   request_id=f"gpu-load-{i}")) for i in range(32)]
    await asyncio.sleep(0.5)  # let them reach the scheduler; the swap is what is tested, not timing
    await engine.swap_weights_from_disk(model, base + 1)  # pause in_place, no flush, continue
    results = await asyncio.gather(*running)
    assert server.running and await engine.current_version() == base + 1
    assert all(r.finish_reason in ("eos", "length") for r in results)


async def test_regression_routed_experts_of_a_model_with_dense_layers_decode(served):
    _, engine, _, shape = served
    if shape is None:
        pytest.skip("ROLLMESH_SGLANG_MODEL is a dense model")
    assert shape.num_hidden_layers > shape.num_layers, "the script's model has a dense layer"
    sampling = SamplingParams(temperature=0.0, max_new_tokens=8)
    first = await engine.generate(PROMPT, sampling, request_id="gpu-r3")
    turn = PROMPT + first.token_ids
    for start in (0, len(turn)):
        options = GenerateOptions(return_routed_experts=True, routed_experts_start_len=start)
        result = await engine.generate(turn, sampling, request_id=f"gpu-r3-{start}", options=options)
        rows = result.routed_experts
        assert rows.shape == (len(turn) + len(result.token_ids) - 1 - start, shape.num_layers, shape.top_k)
        # SGLang's all-zeros regression (#23885) shows up as repeated experts in a row.
        assert all(len(set(row)) == shape.top_k for row in rows.reshape(-1, shape.top_k))
    print("start_len ignored by this build:", engine.statistics().start_len_ignored)
