"""Writes a small arithmetic dataset for `rollmesh train`: sums and differences of small numbers.

Two JSONL files in ``--out`` (default: ``data/`` beside this script, where examples/train_rl.toml
looks for them), one row per problem, answers as strings::

    {"prompt": "What is 12 + 7?", "answer": "19"}
    {"prompt": "What is 12 - 7?", "answer": "5"}

- ``arithmetic_train.jsonl``: ``--train`` rows, the RL stage's prompts;
- ``arithmetic_eval.jsonl``: ``--eval`` held-out rows, none of them a training row.

Every problem ``a + b`` and ``a - b`` (with ``a >= b``, so no answer is negative) over operands 0 to
``--max-operand`` is listed once and ``--train + --eval`` of them are drawn without replacement by
``--seed``: no row repeats, and eval rows are disjoint from train rows. The same arguments write the
same files. Standard library only, so it runs before anything is installed:

    python examples/make_arithmetic_data.py --out examples/data --train 1000 --eval 200 --seed 0
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

TRAIN_FILE = "arithmetic_train.jsonl"
EVAL_FILE = "arithmetic_eval.jsonl"
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


def make_rows(*, train: int, eval_rows: int, seed: int, max_operand: int) -> tuple[list[dict], list[dict]]:
    problems = all_problems(max_operand)
    if train + eval_rows > len(problems):
        raise ValueError(f"--train {train} + --eval {eval_rows} rows asked, but operands 0..{max_operand} "
                         f"make only {len(problems)} distinct problems: raise --max-operand")
    drawn = random.Random(seed).sample(problems, train + eval_rows)
    return [row(problem) for problem in drawn[:train]], [row(problem) for problem in drawn[train:]]


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(item) + "\n" for item in rows), encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, metavar="DIR",
                        help=f"the folder to write {TRAIN_FILE} and {EVAL_FILE} into (default: examples/data)")
    parser.add_argument("--train", type=int, default=1000, metavar="N", help="training rows (default 1000)")
    parser.add_argument("--eval", type=int, default=200, metavar="N", help="held-out rows (default 200)")
    parser.add_argument("--seed", type=int, default=0, metavar="S", help="which problems are drawn (default 0)")
    parser.add_argument("--max-operand", type=int, default=50, metavar="K",
                        help="operands run from 0 to K (default 50: 3,927 distinct problems)")
    args = parser.parse_args(argv)
    if args.train < 1 or args.eval < 0 or args.max_operand < 0:
        parser.error("--train must be at least 1, --eval and --max-operand at least 0")
    try:
        train, held_out = make_rows(train=args.train, eval_rows=args.eval, seed=args.seed,
                                    max_operand=args.max_operand)
    except ValueError as exc:
        parser.error(str(exc))
    args.out.mkdir(parents=True, exist_ok=True)
    write_jsonl(args.out / TRAIN_FILE, train)
    write_jsonl(args.out / EVAL_FILE, held_out)
    print(f"wrote {len(train)} rows to {args.out / TRAIN_FILE} and {len(held_out)} to {args.out / EVAL_FILE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
