"""``rollmesh demo``: ``rollmesh train`` on the built-in demo run file (rollmesh/demo/run_file.py):
warm-start the tiny model (an sft stage), train it with asynchronous GRPO (an rl stage), evaluate
held-out formulas ([[eval]]), summarise.

Knows the options that size it and the config overrides of the mesh's; the job itself is the
training job's (rollmesh/cli/train.py). Prints a line per step as it goes, then the summary and
where ``summary.json`` and ``reward_curve.png`` are.
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path
from typing import Any

from rollmesh.cli.errors import EXIT_OK
from rollmesh.cli.target import load_cli_config, namespace_arg, positive_int
from rollmesh.mesh_address import new_run_dir

# CLI option -> the mesh config's field it overrides (the run file's sizes: DEMO_SIZES).
DEMO_OVERRIDES = {
    "seed": "demo.seed",
    "groups_per_step": "trainer.groups_per_step",
    "n_samples_per_prompt": "trainer.n_samples_per_prompt",
    "namespace": "namespace",
    "nats_url": "nats.url",
    "ray_address": "ray.address",
}


def register(subparsers: Any, common: argparse.ArgumentParser) -> None:
    demo = subparsers.add_parser(
        "demo", parents=[common], help="run the whole demo (warm start, async GRPO, evaluations)",
        description="Start a mesh, warm-start the tiny model on the molar-mass tool task, train it "
                    "with asynchronous GRPO, evaluate on held-out formulas, write summary.json and "
                    "reward_curve.png in the run directory, stop the mesh. Defaults come from the "
                    "config's [demo] and [trainer] sections.")
    size = demo.add_argument_group("size (to shrink it for smoke runs)")
    size.add_argument("--rl-steps", type=positive_int, metavar="N", help="RL (trainer) steps")
    size.add_argument("--sft-steps", type=int, metavar="N", help="supervised warm-start steps (0: none)")
    size.add_argument("--eval-every", type=positive_int, metavar="N", help="evaluate every N RL steps")
    size.add_argument("--eval-size", type=positive_int, metavar="N", help="held-out prompts per evaluation")
    size.add_argument("--groups-per-step", type=positive_int, metavar="N", help="GRPO groups per trainer step")
    size.add_argument("--n-samples-per-prompt", type=positive_int, metavar="N", help="rollouts per GRPO group")
    size.add_argument("--seed", type=int, metavar="S", help="demo seed")
    demo.add_argument("--no-serve", action="store_true", help="do not deploy the Serve inference app")
    demo.add_argument("--namespace", type=namespace_arg, metavar="NS", help="subject namespace")
    demo.add_argument("--nats-url", metavar="URL", help="use this NATS server instead of an embedded one")
    demo.add_argument("--ray-address", metavar="ADDR", help="join this Ray cluster instead of a local one")
    demo.add_argument("--run-dir", type=Path, metavar="DIR", help="run directory (default: a new one)")
    demo.set_defaults(handler=run_demo_command)


# CLI options that size the demo's run file (its stages and evaluation).
DEMO_SIZES = ("rl_steps", "sft_steps", "eval_every", "eval_size")


def demo_overrides(args: argparse.Namespace) -> dict[str, Any]:
    overrides = {field: getattr(args, option) for option, field in DEMO_OVERRIDES.items()}
    if args.no_serve:
        overrides["serve.enabled"] = False
    return overrides


def run_demo_command(args: argparse.Namespace) -> int:
    from rollmesh.cli.train import run_job
    from rollmesh.demo.run_file import demo_job_config

    run_dir = (Path(args.run_dir) if args.run_dir else new_run_dir(load_cli_config(args).run_root)).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    config = demo_job_config(load_cli_config(args, demo_overrides(args)), run_dir,
                             **{size: getattr(args, size) for size in DEMO_SIZES})
    warm = next((stage.steps for stage in config.stages if stage.kind == "sft"), 0)
    rl = next(stage for stage in config.stages if stage.kind == "rl")
    print(f"demo: {warm} warm-start steps, {rl.steps} RL steps of {config.trainer.groups_per_step} groups x "
          f"{config.trainer.n_samples_per_prompt} rollouts; run dir {run_dir}", flush=True)
    summary = asyncio.run(run_job(config, run_dir, None))
    print_summary(summary, run_dir)
    return EXIT_OK


def print_summary(summary: dict[str, Any], run_dir: Path) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="demo summary", show_header=False)
    table.add_column("what")
    table.add_column("value", justify="right")
    rows = [
        ("training reward, first 10% of steps", f"{summary['first_window_reward']:.3f}"),
        ("training reward, last 10% of steps", f"{summary['last_window_reward']:.3f}"),
        ("held-out eval reward, first", f"{summary['eval_reward_first']:.3f}"),
        ("held-out eval reward, last", f"{summary['eval_reward_last']:.3f}"),
        ("RL steps", str(summary["steps"])),
        ("training rollouts", str(summary["rollouts"])),
        ("weight versions", str(summary["weight_versions"])),
    ]
    if "wall_s" in summary:
        rows.append(("wall time (s)", f"{summary['wall_s']:.1f}"))
    if summary.get("failures"):
        rows.append(("failed rollouts", ", ".join(f"{k} {v}" for k, v in summary["failures"].items())))
    for row in rows:
        table.add_row(*row)
    console = Console()
    console.print(table)
    console.print(f"summary: {run_dir / 'summary.json'}", highlight=False)
    console.print(f"reward curve: {run_dir / 'reward_curve.png'}", highlight=False)
    console.print(f"final model: {summary['final_model']}", highlight=False)
