"""Train-vs-inference logprob mismatch on a MoE, with and without rollout routing replay (R3).

The inference side is rollmesh's engine (``DecodeEngine``: prefill, then continuous-batching
decode) running a Qwen3-MoE in bf16, as rollout engines run, sampling at temperature 1 and
recording the routed experts. The trainer side is the same model in fp32 with the same weights
(rounded to bf16 values, so only the arithmetic differs), scoring the same tokens with
``forward_with_replay``: once routing by its own top-k, once replaying the recorded experts.
Mismatch = mean |behaviour logprob - trainer logprob| over the generated tokens. ``ratio`` =
mismatch without replay / with replay; median of ``--repeats`` (different prompts and draws).

    python benchmarks/router_replay.py [--repeats 3] [--prompts 16] [--prompt-len 48] [--new 32]
"""

from __future__ import annotations

import argparse
import copy
import random
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the shared MoE weights

from common import print_result, setup_threads  # noqa: E402
from support.moe_models import init_unit_router_weights  # noqa: E402
from rollmesh.engine.decode import DecodeEngine
from rollmesh.engine.models import CausalLM, build_causal_lm, parse_hf_config
from rollmesh.engine.protocols import GenerateOptions
from rollmesh.messages.base import SamplingParams
from rollmesh.training.losses import token_logprobs
from rollmesh.training.router_replay import compact_rows, forward_with_replay, replay_tensor, rows_for_inputs

MOE_CONFIG = dict(
    model_type="qwen3_moe", vocab_size=4096, hidden_size=256, intermediate_size=512,
    num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, num_experts=16,
    num_experts_per_tok=2, moe_intermediate_size=128, norm_topk_prob=True,
    max_position_embeddings=1024,
)
SEED = 1234


def build_moe() -> CausalLM:
    config = parse_hf_config(MOE_CONFIG)
    torch.manual_seed(SEED)
    return init_unit_router_weights(build_causal_lm(config), config.hidden_size)


def rollouts(engine_model: CausalLM, rng: random.Random, args) -> list:
    """(prompt, generated tokens, behaviour logprobs, routed rows) per request, from the engine."""
    engine = DecodeEngine(engine_model, max_batch=args.prompts, seed=rng.randrange(2**31))
    prompts = {f"r{i}": [rng.randrange(MOE_CONFIG["vocab_size"]) for _ in range(args.prompt_len)]
               for i in range(args.prompts)}
    sampling = SamplingParams(temperature=1.0, max_new_tokens=args.new)
    for request_id, prompt in prompts.items():
        engine.add_prompt(request_id, prompt, sampling, GenerateOptions(return_routed_experts=True))
    done = {}
    while engine.has_work():
        done.update((s.request_id, s) for s in engine.step())
    return [(prompts[r], done[r].token_ids, done[r].logprobs, done[r].routed_experts) for r in prompts]


def mismatch(trainer: CausalLM, runs: list, *, replay: bool) -> tuple[float, float]:
    """(mean |logprob difference| over generated tokens, share of routes that differ)."""
    moe = trainer.config.moe
    trajectories = [prompt + generated for prompt, generated, _, _ in runs]
    rows = [rows_for_inputs(compact_rows(routed, num_experts=moe.num_experts,
                                         routing_shape=trainer.routing_shape, sample=i), len(t), sample=i)
            for i, ((_, _, _, routed), t) in enumerate(zip(runs, trajectories))]
    length = max(map(len, trajectories))
    batch = torch.tensor([t + [0] * (length - len(t)) for t in trajectories])
    recorded = replay_tensor(rows, length - 1)
    with torch.no_grad():
        logits, used = forward_with_replay(trainer, batch[:, :-1], recorded if replay else None)
    logprobs = token_logprobs(logits, batch[:, 1:])
    diffs, flipped, routes = [], 0, 0
    for i, (prompt, generated, behaviour, _) in enumerate(runs):
        # Generated token j sits at position len(prompt) + j, scored by the logits one before.
        start = len(prompt) - 1
        ours = logprobs[i, start:start + len(generated)]
        diffs.append((ours - torch.tensor(behaviour)).abs())
        real = len(trajectories[i]) - 1
        flipped += int((used[i, :real].sort(-1).values != recorded[i, :real].sort(-1).values).any(-1).sum())
        routes += real * len(moe.sparse_layers)
    return torch.cat(diffs).mean().item(), flipped / routes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=48)
    parser.add_argument("--new", type=int, default=32)
    args = parser.parse_args()
    threads = setup_threads()
    trainer = build_moe()
    engine_model = copy.deepcopy(trainer).to(torch.bfloat16)
    rng = random.Random(SEED)
    with_replay, without, flips = [], [], []
    for repeat in range(args.repeats):
        runs = rollouts(engine_model, rng, args)
        # Alternate which side is measured first; the figures do not depend on it.
        order = (True, False) if repeat % 2 == 0 else (False, True)
        figures = {replay: mismatch(trainer, runs, replay=replay) for replay in order}
        with_replay.append(figures[True][0])
        without.append(figures[False][0])
        flips.append(figures[False][1])
        print(f"repeat {repeat}: mismatch without replay {without[-1]:.5f}, with {with_replay[-1]:.5f} "
              f"({without[-1] / with_replay[-1]:.2f}x); routes flipped without replay {flips[-1]:.4f}")
    ours, baseline = statistics.median(with_replay), statistics.median(without)
    parameters = sum(p.numel() for p in trainer.parameters())
    print_result(
        "router_replay", ours, baseline, "mean |logprob diff| (bf16 engine vs fp32 trainer)",
        baseline / ours,
        ratios=[round(b / a, 3) for a, b in zip(with_replay, without)],
        flipped_routes=round(statistics.median(flips), 4),
        scored_tokens=args.prompts * args.new, prompt_tokens=args.prompts * args.prompt_len,
        parameters=parameters, layers=MOE_CONFIG["num_hidden_layers"],
        experts=MOE_CONFIG["num_experts"], top_k=MOE_CONFIG["num_experts_per_tok"],
        repeats=args.repeats, threads=threads,
    )


if __name__ == "__main__":
    main()
