"""Writes a small arithmetic dataset for `rollmesh train`: sums and differences of small numbers.

Four JSONL files in ``--out`` (default: ``data/`` beside this script, where the examples'
train_*.toml run files look for them), one row per problem, answers as strings::

    {"prompt": "What is 12 + 7?", "answer": "19"}
    {"prompt": "What is 12 - 7?", "answer": "5"}

- ``arithmetic_train.jsonl``: ``--train`` rows, the RL stage's prompts;
- ``arithmetic_eval.jsonl``: ``--eval`` held-out rows, none of them a training row;
- ``arithmetic_sft.jsonl``: the training rows as chat demonstrations for an SFT stage, the answer
  alone as the assistant's turn (a short format a tiny model learns quickly, and the one the math
  reward reads): ``{"messages": [{"role": "user", "content": "What is 12 + 7?"},
  {"role": "assistant", "content": "19"}]}``. Only ``--sft-exact`` of them (by seed) answer
  exactly; the rest are off by one, a sloppy teacher, so that a model trained on them answers
  right only some of the time and RL has something to fix (as the demo's warm start rounds 70% of
  its answers);
- ``arithmetic_text.jsonl``: the training rows as raw text for a midtrain stage, one worked sum per
  row: ``{"text": "12 + 7 = 19"}``.

SFT and midtraining see only training rows: the eval rows stay held out from every stage.

Every problem ``a + b`` and ``a - b`` (with ``a >= b``, so no answer is negative) over operands 0 to
``--max-operand`` is listed once and ``--train + --eval`` of them are drawn without replacement by
``--seed``: no row repeats, and eval rows are disjoint from train rows. The same arguments write the
same files. Standard library only, so it runs before anything is installed:

    python examples/make_arithmetic_data.py --out examples/data --train 125 --eval 30 --seed 0
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

TRAIN_FILE = "arithmetic_train.jsonl"
EVAL_FILE = "arithmetic_eval.jsonl"
SFT_FILE = "arithmetic_sft.jsonl"
TEXT_FILE = "arithmetic_text.jsonl"
DEFAULT_OUT = Path(__file__).resolve().parent / "data"


def all_problems(max_operand: int) -> list[tuple[int, str, int]]:
    """Every ``(a, op, b)`` once, in a fixed order (the draw's seed then decides the rows)."""
    operands = range(max_operand + 1)
    sums = [(a, "+", b) for a in operands for b in operands]
    differences = [(a, "-", b) for a in operands for b in operands if a >= b]
    return sums + differences


def row(problem: tuple[int, str, int]) -> dict[str, str]:
    a, op, b = problem
    return {"prompt": f"What is {a} {op} {b}?", "answer": str(a + b if op == "+" else a - b)}


def sft_row(problem: tuple[int, str, int], *, off_by: int = 0) -> dict[str, list[dict[str, str]]]:
    """A demonstration, its answer ``off_by`` from the right one (never below 0)."""
    question = row(problem)
    answer = int(question["answer"]) + off_by
    if answer < 0:
        answer = int(question["answer"]) - off_by
    return {"messages": [{"role": "user", "content": question["prompt"]},
                         {"role": "assistant", "content": str(answer)}]}


def sft_offsets(count: int, *, exact: float, seed: int) -> list[int]:
    """Each demonstration's error: 0 for a fraction ``exact`` of them, else -1 or +1, by seed."""
    rng = random.Random(f"sft-{seed}")
    return [0 if rng.random() < exact else rng.choice((-1, 1)) for _ in range(count)]


def text_row(problem: tuple[int, str, int]) -> dict[str, str]:
    a, op, b = problem
    return {"text": f"{a} {op} {b} = {row(problem)['answer']}"}


def draw_problems(*, train: int, eval_rows: int, seed: int, max_operand: int) -> tuple[list, list]:
    """The training and the held-out problems: ``train + eval_rows`` distinct ones drawn by seed."""
    problems = all_problems(max_operand)
    if train + eval_rows > len(problems):
        raise ValueError(f"--train {train} + --eval {eval_rows} rows asked, but operands 0..{max_operand} "
                         f"make only {len(problems)} distinct problems: raise --max-operand")
    drawn = random.Random(seed).sample(problems, train + eval_rows)
    return drawn[:train], drawn[train:]


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(item) + "\n" for item in rows), encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, metavar="DIR",
                        help="the folder to write the four files into (default: examples/data)")
    parser.add_argument("--train", type=int, default=125, metavar="N", help="training rows (default 125)")
    parser.add_argument("--eval", type=int, default=30, metavar="N", help="held-out rows (default 30)")
    parser.add_argument("--seed", type=int, default=0, metavar="S", help="which problems are drawn (default 0)")
    parser.add_argument("--sft-exact", type=float, default=0.5, metavar="F",
                        help="the share of SFT demonstrations that answer exactly; the rest are off by one "
                             "(default 0.5; 1 for a perfect teacher)")
    parser.add_argument("--max-operand", type=int, default=9, metavar="K",
                        help="operands run from 0 to K (default 9: 155 distinct problems, few enough for "
                             "the demo's tiny model to learn in minutes)")
    args = parser.parse_args(argv)
    if args.train < 1 or args.eval < 0 or args.max_operand < 0:
        parser.error("--train must be at least 1, --eval and --max-operand at least 0")
    if not 0.0 <= args.sft_exact <= 1.0:
        parser.error("--sft-exact is a share, from 0 to 1")
    try:
        train, held_out = draw_problems(train=args.train, eval_rows=args.eval, seed=args.seed,
                                        max_operand=args.max_operand)
    except ValueError as exc:
        parser.error(str(exc))
    args.out.mkdir(parents=True, exist_ok=True)
    write_jsonl(args.out / TRAIN_FILE, [row(problem) for problem in train])
    write_jsonl(args.out / EVAL_FILE, [row(problem) for problem in held_out])
    offsets = sft_offsets(len(train), exact=args.sft_exact, seed=args.seed)
    write_jsonl(args.out / SFT_FILE, [sft_row(problem, off_by=off) for problem, off in zip(train, offsets)])
    write_jsonl(args.out / TEXT_FILE, [text_row(problem) for problem in train])
    print(f"wrote {len(train)} rows to {args.out / TRAIN_FILE}, {SFT_FILE} and {TEXT_FILE}, "
          f"{len(held_out)} to {args.out / EVAL_FILE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
