"""The GPU smoke test's parts (run by ``scripts/gpu/smoke.sh``, one process per part): each part
appends one JSON line to ``OUT/gpu_smoke.jsonl`` as soon as it finishes.

Drives rollmesh's plain classes without Ray or NATS (the device has neither): the megatron
backend's rank processes (``MegatronRanks``), the checkpoint exporter, the local engine. Parts:

  models        a tiny Llama, a tiny Qwen3-MoE and a ~0.2B Llama, random, written with transformers
  megatron_tp1  megatron backend at TP=1: Llama policy step, checkpoint, HF export, logits compared;
                Qwen3-MoE policy step with routing replay
  megatron_tp2  the same at TP=2 (skipped with fewer than 2 GPUs)
  offload       megatron backend bf16, peak max_memory_allocated with and without optimizer offload
  engine        local engine on the device: decode throughput, a weight swap device to device

``--dry-run`` imports everything the parts use and prints the plan, running nothing: what the CPU
test suite runs to prove the script is not broken. ``SMOKE_DEVICE=cpu`` runs the parts on the CPU
(gloo, tiny sizes): what the suite runs of it for real. Knows rollmesh's public classes only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch

PARTS = ("models", "megatron_tp1", "megatron_tp2", "offload", "engine")
TINY_LLAMA = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                  intermediate_size=512, vocab_size=1024, max_position_embeddings=2048, eos_token_id=2,
                  tie_word_embeddings=False, rms_norm_eps=1e-6, rope_theta=10000.0)
TINY_QWEN3_MOE = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=32, intermediate_size=256, moe_intermediate_size=64, num_experts=8,
                      num_experts_per_tok=2, norm_topk_prob=True, vocab_size=1024, max_position_embeddings=2048,
                      eos_token_id=2, tie_word_embeddings=False, rms_norm_eps=1e-6)
# Big enough that the optimizer's fp32 state (12 bytes a parameter) shows in peak memory.
OFFLOAD_LLAMA = dict(TINY_LLAMA, hidden_size=1024, num_hidden_layers=8, num_attention_heads=16,
                     num_key_value_heads=8, intermediate_size=4096, vocab_size=32000)
CPU_OFFLOAD_LLAMA = dict(TINY_LLAMA, hidden_size=64, num_hidden_layers=2, intermediate_size=128, vocab_size=300)


def _device() -> str:
    return os.environ.get("SMOKE_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")


def _emit(out: Path, record: dict) -> None:
    """One JSON line, appended and flushed at once (a later part's timeout must not lose it)."""
    with open(out / "gpu_smoke.jsonl", "a", encoding="utf-8") as f:
        f.write(json.dumps(record, default=str) + "\n")
        f.flush()
        os.fsync(f.fileno())
    print(json.dumps(record, default=str), flush=True)


def _run(out: Path, part: str, body) -> None:
    started = time.perf_counter()
    try:
        result = body()
        record = {"part": part, "ok": True, **result}
    except Exception as exc:  # noqa: BLE001 - the smoke records every failure and goes on
        record = {"part": part, "ok": False, "error": f"{type(exc).__name__}: {exc}",
                  "traceback": traceback.format_exc()[-3000:]}
    record.update(seconds=round(time.perf_counter() - started, 2), device=_device(),
                  gpus=torch.cuda.device_count() if torch.cuda.is_available() else 0)
    _emit(out, record)


# -- models ------------------------------------------------------------------------------------

def _save(cls_name: str, config_name: str, fields: dict, directory: Path) -> Path:
    import transformers

    model = getattr(transformers, cls_name)(getattr(transformers, config_name)(**fields))
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif name.endswith("gate.weight"):  # routers of unit-scale logits: routing means something
                p.normal_(0, fields["hidden_size"] ** -0.5)
            else:
                p.normal_(0, 0.02)
    model.save_pretrained(directory)
    return directory


def part_models(out: Path) -> dict:
    models = out / "models"
    offload = OFFLOAD_LLAMA if _device() == "cuda" else CPU_OFFLOAD_LLAMA
    written = {"llama": _save("LlamaForCausalLM", "LlamaConfig", TINY_LLAMA, models / "llama"),
               "qwen3_moe": _save("Qwen3MoeForCausalLM", "Qwen3MoeConfig", TINY_QWEN3_MOE, models / "qwen3_moe"),
               "offload_llama": _save("LlamaForCausalLM", "LlamaConfig", offload, models / "offload_llama")}
    return {"models": {name: str(path) for name, path in written.items()}}


# -- megatron ----------------------------------------------------------------------------------

def _trainer(tp: int, **fields):
    from rollmesh.config import TrainerConfig
    from rollmesh.trainer_config import MegatronConfig

    return TrainerConfig(lr=1e-4, ppo_epochs=2, seed=0, grad_clip=1.0, **fields,
                         megatron=MegatronConfig(tensor_parallel=tp, start_timeout_s=150, call_timeout_s=150))


def _samples(vocab: int, count: int = 8, length: int = 96, moe: dict | None = None) -> list:
    import numpy as np

    from rollmesh.training.grpo import PolicySample

    rng = np.random.default_rng(0)
    out = []
    for i in range(count):
        size = length - 7 * i
        tokens = rng.integers(3, vocab, size).tolist()
        rows = None
        if moe is not None:  # recorded experts: k distinct ones per position and sparse layer
            picks = np.argsort(rng.random((size - 1, moe["num_hidden_layers"], moe["num_experts"])), axis=-1)
            rows = picks[..., : moe["num_experts_per_tok"]].astype(np.uint8)
        out.append(PolicySample(tokens, [0] * 16 + [1] * (size - 16), (-7.0 + rng.normal(0, 0.3, size)).tolist(),
                                1.0 if i % 2 else -1.0, versions=[-1] * 16 + [0] * (size - 16), routed_experts=rows))
    return out


def _logits_of(directory: Path, weights: dict | None, probe: torch.Tensor, device: str) -> torch.Tensor:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).to(device).eval()
    if weights is not None:
        model.load_state_dict({k: v.float() for k, v in weights.items()}, strict=False)
    with torch.no_grad():
        return model(probe.to(device)).logits.float().cpu()


def _megatron_llama(out: Path, tp: int) -> dict:
    from rollmesh.checkpoint.hf_writer import read_hf_checkpoint
    from rollmesh.checkpoint.megatron_export import ExportOptions, export_to_hf
    from rollmesh.config import ModelConfig
    from rollmesh.training.megatron_ranks import MegatronRanks

    model_dir = out / "models" / "llama"
    ranks = MegatronRanks(ModelConfig(path=str(model_dir)), _trainer(tp), log_dir=out)
    try:
        stats = ranks.policy_step(_samples(TINY_LLAMA["vocab_size"]), current_version=0)
        trained = ranks.state_dict()
        path, fmt = ranks.save_checkpoint(out / f"megatron_tp{tp}_ckpt", iteration=1, weight_version=1)
        memory = ranks.device_memory()
    finally:
        ranks.close()
    hf_dir = out / f"megatron_tp{tp}_hf"
    export_to_hf(path.parent, hf_dir, ExportOptions(workers=1))
    exported = read_hf_checkpoint(hf_dir)
    same = all(torch.equal(exported[k].float(), trained[k].float()) for k in exported)
    probe = torch.randint(3, TINY_LLAMA["vocab_size"], (2, 64), generator=torch.Generator().manual_seed(1))
    diff = (_logits_of(hf_dir, None, probe, _device()) - _logits_of(model_dir, trained, probe, _device())).abs().max()
    return {"stats": stats, "checkpoint_format": fmt, "exported_equals_trained": same,
            "hf_logits_max_abs_diff": float(diff), "rank_devices": [m["device"] for m in memory],
            "peak_bytes": [m["peak_bytes"] for m in memory]}


def _megatron_moe(out: Path, tp: int) -> dict:
    from rollmesh.config import ModelConfig
    from rollmesh.training.megatron_ranks import MegatronRanks

    ranks = MegatronRanks(ModelConfig(path=str(out / "models" / "qwen3_moe")), _trainer(tp), log_dir=out)
    try:
        stats = ranks.policy_step(_samples(TINY_QWEN3_MOE["vocab_size"], moe=TINY_QWEN3_MOE), current_version=0)
    finally:
        ranks.close()
    if stats["router_replay"] != 1.0:
        raise RuntimeError(f"routing replay did not run: {stats}")
    return {"stats": stats}


def part_megatron(out: Path, tp: int) -> None:
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if _device() == "cuda" and gpus < tp:
        _emit(out, {"part": f"megatron_tp{tp}", "ok": None, "skipped": f"{gpus} GPU(s), TP={tp} needs {tp}"})
        return
    _run(out, f"megatron_tp{tp}_llama", lambda: _megatron_llama(out, tp))
    _run(out, f"megatron_tp{tp}_qwen3_moe_replay", lambda: _megatron_moe(out, tp))


# -- optimizer offload -------------------------------------------------------------------------

def part_offload(out: Path) -> dict:
    from rollmesh.config import ModelConfig
    from rollmesh.training.megatron_ranks import MegatronRanks

    model = ModelConfig(path=str(out / "models" / "offload_llama"))
    vocab = OFFLOAD_LLAMA["vocab_size"] if _device() == "cuda" else CPU_OFFLOAD_LLAMA["vocab_size"]
    samples = _samples(vocab, count=4, length=256)
    figures = {}
    for name, offload in (("without", False), ("with", True)):
        ranks = MegatronRanks(model, _trainer(1, precision="bf16", optimizer_offload=offload), log_dir=out)
        try:
            ranks.device_memory()  # start the peak window after the model and optimizer are built
            stats = [ranks.policy_step(samples, current_version=step) for step in range(2)]
            (memory,) = ranks.device_memory()
        finally:
            ranks.close()
        figures[name] = {"peak_bytes": memory["peak_bytes"], "loss": [s["loss"] for s in stats]}
    peaks = figures["without"]["peak_bytes"], figures["with"]["peak_bytes"]
    ratio = peaks[0] / peaks[1] if all(peaks) else None
    return {"peak_max_memory_allocated": figures, "ratio_without_over_with": ratio}


# -- local engine ------------------------------------------------------------------------------

async def _engine_figures(model_dir: Path, device: str) -> dict:
    from rollmesh.config import InferenceConfig, ModelConfig
    from rollmesh.engine.local_engine import LocalEngine
    from rollmesh.engine.models import load_hf_model
    from rollmesh.messages.base import SamplingParams

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = load_hf_model(str(model_dir), dtype=dtype).to(device).eval()
    requests, new_tokens = 16, 128 if device == "cuda" else 16
    engine = LocalEngine(ModelConfig(path=str(model_dir)), InferenceConfig(), model=model)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=new_tokens)
    async with engine:
        await engine.generate([5, 6, 7], sampling, request_id="warmup")
        started = time.perf_counter()
        results = await asyncio.gather(*(engine.generate(list(range(3, 40 + i)), sampling, request_id=f"r{i}")
                                         for i in range(requests)))
        elapsed = time.perf_counter() - started
        tokens = sum(len(r.token_ids) for r in results)
        # A new version whose tensors are already on the device: staged and swapped without a host hop.
        weights = {k: (v + 0.01).to(device) for k, v in model.state_dict().items()}
        running = [asyncio.ensure_future(engine.generate([9, 10, 11], sampling, request_id=f"s{i}")) for i in range(4)]
        swap_started = time.perf_counter()
        engine.stage_weights(weights, 1)
        await engine.wait_weights_activated(1)
        swap_s = time.perf_counter() - swap_started
        await asyncio.gather(*running)
        live = dict(engine.decode_engine.model.named_parameters())
        name = next(iter(weights))
        swapped = bool(torch.equal(live[name].detach(), weights[name].to(live[name].dtype)))
        devices = sorted({str(p.device) for p in live.values()})
    return {"decode_tokens_per_s": tokens / elapsed, "requests": requests, "generated_tokens": tokens,
            "weight_swap_s": swap_s, "swapped_weights_equal_staged": swapped, "weight_devices": devices,
            "version": engine.current_version}


def part_engine(out: Path) -> dict:
    return asyncio.run(_engine_figures(out / "models" / "llama", _device()))


# -- entry -------------------------------------------------------------------------------------

def dry_run() -> dict:
    """Import every module the parts use and describe the plan; run nothing."""
    import importlib

    modules = ["transformers", "safetensors", "msgspec", "structlog", "megatron.core",
               "rollmesh.training.megatron_ranks", "rollmesh.training.megatron_backend",
               "rollmesh.checkpoint.megatron_export", "rollmesh.engine.local_engine"]
    missing = {}
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - reported, not raised: the plan says what is missing
            missing[name] = f"{type(exc).__name__}: {exc}"
    from rollmesh.training.megatron_attention import transformer_engine_available

    return {"part": "dry_run", "ok": not missing, "parts": list(PARTS), "device": _device(),
            "missing": missing, "transformer_engine": transformer_engine_available()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("part", choices=(*PARTS, "dry_run"))
    parser.add_argument("--out", type=Path, required=True)
    options = parser.parse_args(argv)
    out = options.out
    out.mkdir(parents=True, exist_ok=True)
    if _device() == "cpu":  # torch's default team on a shared CPU oversubscribes it many times over
        torch.set_num_threads(int(os.environ.get("SMOKE_THREADS", "1")))
    if options.part == "dry_run":
        record = dry_run()
        print(json.dumps(record), flush=True)
        return 0 if record["ok"] else 1
    if options.part in ("megatron_tp1", "megatron_tp2"):
        part_megatron(out, int(options.part[-1]))
        return 0
    body = {"models": part_models, "offload": part_offload, "engine": part_engine}[options.part]
    _run(out, options.part, lambda: body(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
