"""scripts/gpu/smoke.sh is not broken: it parses, its dry run imports every module its parts use,
and on the CPU (``SMOKE_DEVICE=cpu``, gloo, tiny models) its cheap parts run for real and each
appends its JSON line to $OUT/gpu_smoke.jsonl: the tiny models written with transformers, the
megatron backend at TP=1 (policy step, checkpoint, HF export with logits compared, MoE routing
replay) and the local engine (decode, a weight swap). On a GPU node the script is run by hand
(docs/gpu.md); its CUDA figures are not asserted here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.core", reason="the smoke drives the megatron backend")
pytest.importorskip("transformers", reason="the smoke writes its models with transformers")

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "gpu" / "smoke.sh"


def _run(out: Path, *args: str, timeout_s: float, **env: str) -> subprocess.CompletedProcess:
    environ = {**os.environ, "OUT": str(out), "PYTHON": sys.executable, "SMOKE_DEVICE": "cpu", **env}
    return subprocess.run(["bash", str(SCRIPT), *args], env=environ, capture_output=True, text=True,
                          timeout=timeout_s, cwd=REPO)


@pytest.mark.unit
@pytest.mark.timeout(300)
def test_the_smoke_script_parses_and_its_dry_run_imports_every_part(tmp_path):
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True).returncode == 0
    done = _run(tmp_path, "--dry-run", timeout_s=240)
    assert done.returncode == 0, done.stderr[-3000:]
    plan = json.loads(done.stdout.strip().splitlines()[-1])
    assert plan["ok"] and plan["missing"] == {}
    assert plan["parts"] == ["models", "megatron_tp1", "megatron_tp2", "offload", "engine"]


@pytest.mark.integration
@pytest.mark.timeout(900)
def test_the_smoke_scripts_parts_run_on_the_cpu_and_write_one_json_line_each(tmp_path):
    done = _run(tmp_path, timeout_s=840, SMOKE_PARTS="models megatron_tp1 engine", SMOKE_TIMEOUT_MODELS="240",
                SMOKE_TIMEOUT_MEGATRON_TP1="420", SMOKE_TIMEOUT_ENGINE="180")
    assert done.returncode == 0, done.stderr[-3000:]
    records = {r["part"]: r for r in map(json.loads, (tmp_path / "gpu_smoke.jsonl").read_text().splitlines())}
    assert list(records) == ["models", "megatron_tp1_llama", "megatron_tp1_qwen3_moe_replay", "engine"]
    failed = {part: r.get("error") for part, r in records.items() if not r["ok"]}
    assert not failed, failed
    llama = records["megatron_tp1_llama"]
    assert llama["checkpoint_format"] == "megatron_torch_dist" and llama["exported_equals_trained"]
    assert llama["hf_logits_max_abs_diff"] < 1e-4 and llama["rank_devices"] == ["cpu"]
    assert llama["stats"]["logprob_mismatch"] > 0
    assert records["megatron_tp1_qwen3_moe_replay"]["stats"]["router_replay"] == 1.0
    engine = records["engine"]
    assert engine["swapped_weights_equal_staged"] and engine["version"] == 1 and engine["generated_tokens"] > 0
