"""``rollmesh convert SRC DST``: a Megatron checkpoint (torch_dist or legacy) to a Hugging Face directory.

Knows the checkpoint package and argparse. SRC is a Megatron save root (with
``latest_checkpointed_iteration.txt``) or one iteration folder; the format is detected and the
architecture read from the arguments saved with the checkpoint (``--arch`` only overrides the
detection). ``--dry-run`` prints the model and the conversion plan and writes nothing. Works
without a mesh or NATS; ``--backend ray`` spreads the shards over a Ray cluster (``RAY_ADDRESS``,
or a local Ray started for the run).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from rollmesh.cli.errors import EXIT_OK, EXIT_USAGE, CliError
from rollmesh.cli.target import positive_float

# Named here rather than imported, so `rollmesh --help` never imports torch (the checkpoint
# package checks the name again: rollmesh.checkpoint.arch_maps.FAMILIES).
ARCHITECTURES = ("llama", "qwen2", "mixtral", "qwen3_moe")
DTYPES = ("bfloat16", "float16", "float32")


def register(subparsers: Any, common: argparse.ArgumentParser) -> None:
    convert = subparsers.add_parser(
        "convert", parents=[common], help="convert a Megatron checkpoint to a Hugging Face directory",
        description="Convert a Megatron checkpoint, torch_dist or legacy per-rank files (a save root or one iteration folder), "
                    "into a directory transformers.AutoModelForCausalLM.from_pretrained loads as is.")
    convert.add_argument("src", type=Path, metavar="SRC")
    convert.add_argument("dst", type=Path, metavar="DST")
    convert.add_argument("--arch", choices=ARCHITECTURES, help="override the architecture read from the checkpoint")
    convert.add_argument("--target-tp", type=int, default=1, metavar="N",
                         help="1 (default): a Hugging Face directory; N > 1: a Megatron checkpoint resharded "
                              "to N tensor-parallel ranks (mp_rank_XX/model_optim_rng.pt), from a torch_dist SRC")
    convert.add_argument("--dtype", choices=DTYPES, help="cast the weights (default: keep the checkpoint's)")
    convert.add_argument("--max-shard-gb", type=positive_float, default=5.0, metavar="GB",
                         help="largest safetensors shard (default: %(default)s)")
    convert.add_argument("--workers", type=int, default=2, metavar="N",
                         help="shards converted at once (default: %(default)s)")
    convert.add_argument("--memory-budget-gb", type=positive_float, default=4.0, metavar="GB",
                         help="memory the workers may hold together; a tensor that cannot fit is refused by "
                              "name before anything is written (default: %(default)s)")
    convert.add_argument("--backend", choices=("threads", "ray"), default="threads",
                         help="worker threads in this process, or Ray tasks on the cluster at RAY_ADDRESS "
                              "(one node or many, sharing the file system; default: %(default)s)")
    convert.add_argument("--dry-run", action="store_true", help="print the model and the plan, write nothing")
    convert.set_defaults(handler=run_convert)


def run_convert(args: argparse.Namespace) -> int:
    if args.target_tp < 1:
        raise CliError("--target-tp must be at least 1", exit_code=EXIT_USAGE)
    if args.workers < 1:
        raise CliError("--workers must be at least 1", exit_code=EXIT_USAGE)
    import torch

    from rollmesh.checkpoint.errors import CheckpointError
    from rollmesh.checkpoint.megatron_export import ExportOptions, describe_export, inspect_source

    options = ExportOptions(arch=args.arch, dtype=getattr(torch, args.dtype) if args.dtype else None,
                            max_shard_bytes=int(args.max_shard_gb * 2**30),
                            memory_budget_bytes=int(args.memory_budget_gb * 2**30), workers=args.workers,
                            backend=args.backend)
    try:
        if args.dry_run:
            for line in describe_export(args.src, options):
                print(line)
            return EXIT_OK
        if args.target_tp > 1:
            source = inspect_source(args.src, arch=args.arch)
            if source.layout != "torch_dist":
                raise CliError("--target-tp N > 1 reshards torch_dist checkpoints only", exit_code=EXIT_USAGE)
            from rollmesh.checkpoint.megatron_args import saved_args
            from rollmesh.checkpoint.tp_reshard import reshard_torch_dist

            files = reshard_torch_dist(source.folder, args.dst, source.model.spec, tp=args.target_tp,
                                       args=saved_args(source.folder))
            print(f"resharded {source.folder} -> {args.dst}: tensor parallel {args.target_tp}, {len(files)} files")
            return EXIT_OK
        files = _export_with_progress(args, options)
    except CheckpointError as exc:
        raise CliError(str(exc)) from exc
    except ValueError as exc:
        raise CliError(str(exc), exit_code=EXIT_USAGE) from exc
    print(f"converted {args.src} -> {args.dst}: {len(files)} files")
    return EXIT_OK


def _export_with_progress(args: argparse.Namespace, options: Any) -> list[str]:
    """The export, with a progress bar on a terminal and a line per finished shard otherwise."""
    from rollmesh.checkpoint.megatron_export import export_to_hf

    if args.backend == "ray":
        import ray

        ray.init(address=os.environ.get("RAY_ADDRESS"), include_dashboard=False, log_to_driver=False)
    if not sys.stderr.isatty():
        return export_to_hf(args.src, args.dst, options, progress=_progress_lines())
    from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn

    columns = (*Progress.get_default_columns()[:1], BarColumn(), DownloadColumn(), TransferSpeedColumn(),
               TimeRemainingColumn())
    with Progress(*columns, transient=True) as bar:
        task = bar.add_task("converting", total=None)
        return export_to_hf(args.src, args.dst, options,
                            progress=lambda done, total: bar.update(task, completed=done, total=total))


def _progress_lines() -> Any:
    printed = [-1]  # the last tenth reported: a line per 10%, however many shards

    def report(done: int, total: int) -> None:
        tenth = 10 * done // max(total, 1)
        if tenth > printed[0]:
            printed[0] = tenth
            print(f"converted {done / 2**20:.1f} of {total / 2**20:.1f} MiB ({100 * done / max(total, 1):.0f}%)",
                  file=sys.stderr, flush=True)

    return report
