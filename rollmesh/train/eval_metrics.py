"""The metrics of one evaluation: mean@n, pass@k and majority@n over its samples.

Plain logic: knows math-verify (to normalize math answers for voting) and nothing of NATS, Ray or
files. A sample is one rollout of one prompt; a failed one (``RolloutFailed``, or never answered)
is an infrastructure failure, not a zero: it is counted in ``failed`` and left out of every
statistic, so a prompt is scored over its successful samples only.

- ``mean@n``: the mean reward over every successful sample.
- ``pass@k``: per prompt, the unbiased estimator of Chen et al. 2021 (HumanEval),
  ``1 - C(n-c, k) / C(n, k)`` with ``n`` successful samples of which ``c`` pass (reward >=
  ``threshold``), computed as a product (the binomials overflow); averaged over prompts. A prompt
  with fewer than ``k`` successful samples uses ``k = n``. As prime-rl computes it
  (src/prime_rl/orchestrator/eval_utils.py, ``_pass_at_k``), which passes a sample whose reward
  is 1.0: here ``reward >= threshold``, so a weighted total above 1 passes too.
- ``majority@n``: per prompt, the most frequent normalized final answer wins and the prompt scores
  the reward of its first sample with that answer; a tie goes to the answer met first in sample
  order. As verl's ``calc_maj_val`` (verl/trainer/ppo/metric_utils.py) votes, without its
  bootstrap resampling: every prompt here has all its samples in one evaluation. Only where
  answers can be compared: when any successful sample's answer is unknown, it is left out.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

# math-verify's own parse timeout is signal.alarm based: usable in the main thread only.
MATH_PARSE_TIMEOUT_S = 5


@dataclass(frozen=True)
class EvalSample:
    """One sample of one prompt: its reward (None when it failed), its normalized final answer
    (None when unknown) and its failure kind ("" when it did not fail)."""

    prompt: int
    sample: int
    reward: float | None
    answer: str | None = None
    failed: str = ""


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of a prompt with ``n`` samples of which ``c`` pass: ``1 - C(n-c, k) /
    C(n, k)`` as ``1 - prod_{i=n-c+1}^{n} (1 - k / i)``; ``k`` above ``n`` is taken as ``n``."""
    if n <= 0:
        raise ValueError("pass@k of a prompt without samples")
    if not 0 <= c <= n:
        raise ValueError(f"{c} passing samples of {n}")
    k = min(k, n)
    if n - c < k:
        return 1.0
    product = 1.0
    for i in range(n - c + 1, n + 1):
        product *= 1.0 - k / i
    return 1.0 - product


def majority_reward(samples: Sequence[EvalSample]) -> float:
    """The reward of the first sample with the most frequent answer (ties: the answer met first)."""
    counts: dict[str, int] = {}
    first: dict[str, float] = {}
    for sample in sorted(samples, key=lambda s: s.sample):
        assert sample.answer is not None and sample.reward is not None
        counts[sample.answer] = counts.get(sample.answer, 0) + 1
        first.setdefault(sample.answer, sample.reward)
    # max() keeps the first of equal counts, and dicts keep insertion (sample) order.
    winner = max(counts, key=counts.__getitem__)
    return first[winner]


def eval_metrics(samples: Iterable[EvalSample], *, n_samples: int, pass_k: Sequence[int] = (),
                 threshold: float = 1.0) -> dict[str, float | int]:
    """``{"mean@n", "pass@k" (each k; default 1 and n), "majority@n", "prompts", "samples",
    "failed"}``; the rewards' keys are left out when no sample succeeded, ``majority@n`` when
    answers cannot be compared. ``n`` is ``n_samples`` as configured."""
    by_prompt: dict[int, list[EvalSample]] = {}
    failed = 0
    for sample in samples:
        by_prompt.setdefault(sample.prompt, [])
        if sample.reward is None:
            failed += 1
        else:
            by_prompt[sample.prompt].append(sample)
    scored = [group for _, group in sorted(by_prompt.items()) if group]
    rewards = [s.reward for group in scored for s in group]
    metrics: dict[str, float | int] = {"prompts": len(by_prompt), "samples": len(rewards), "failed": failed}
    if not scored:
        return metrics
    metrics[f"mean@{n_samples}"] = sum(rewards) / len(rewards)  # type: ignore[arg-type]
    for k in sorted(set(pass_k) or {1, n_samples}):
        values = [pass_at_k(len(group), sum(s.reward >= threshold for s in group), k)  # type: ignore[operator]
                  for group in scored]
        metrics[f"pass@{k}"] = sum(values) / len(values)
    if all(s.answer is not None for group in scored for s in group):
        metrics[f"majority@{n_samples}"] = sum(majority_reward(group) for group in scored) / len(scored)
    return metrics


def normalize_answer(text: str, *, math: bool) -> str:
    """The answer a sample votes with: for math, what math-verify parses from ``text`` in sympy's
    string form, a number made exact (``0.5``, ``\\frac{1}{2}`` and ``\\boxed{1/2}`` all vote
    ``1/2``), or the stripped text when nothing parses; else the whitespace-stripped text."""
    stripped = text.strip()
    if not math or not stripped:
        return stripped
    import sympy
    from math_verify import parse

    in_main = threading.current_thread() is threading.main_thread()
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # it warns when its timeout is off
    try:
        parsed = parse(stripped, parsing_timeout=MATH_PARSE_TIMEOUT_S if in_main else None)  # type: ignore[arg-type]
        if not parsed:
            return stripped
        value = parsed[0]
        if isinstance(value, sympy.Float):
            value = sympy.nsimplify(value, rational=True)
        return str(value)
    except Exception:  # math-verify's or sympy's own failure on this text (its timeout included)
        return stripped
