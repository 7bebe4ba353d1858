"""``rollmesh convert SRC DST``: a Megatron checkpoint (torch_dist or legacy) to a Hugging Face directory.

Knows the checkpoint package and argparse. SRC is a Megatron save root (with
``latest_checkpointed_iteration.txt``) or one iteration folder; the format is detected and the
architecture read from the arguments saved with the checkpoint (``--arch`` only overrides the
detection). ``--dry-run`` prints the model and the conversion plan and writes nothing. Works
without a mesh, NATS or Ray.
"""

from __future__ import annotations

import argparse
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
    convert.add_argument("--max-task-gb", type=positive_float, default=2.0, metavar="GB",
                         help="memory budget of one conversion task (default: %(default)s)")
    convert.add_argument("--dry-run", action="store_true", help="print the model and the plan, write nothing")
    convert.set_defaults(handler=run_convert)


def run_convert(args: argparse.Namespace) -> int:
    if args.target_tp < 1:
        raise CliError("--target-tp must be at least 1", exit_code=EXIT_USAGE)
    import torch

    from rollmesh.checkpoint.convert_planner import describe_plan, plan_tasks
    from rollmesh.checkpoint.errors import CheckpointError
    from rollmesh.checkpoint.megatron_args import describe_model, detect_format, resolve_iteration_dir, saved_args
    from rollmesh.checkpoint.megatron_to_hf import hf_config
    from rollmesh.checkpoint.torch_dist_reader import TorchDistCheckpoint

    dtype = getattr(torch, args.dtype) if args.dtype else None
    try:
        folder = resolve_iteration_dir(args.src)
        layout = detect_format(folder)
        model = describe_model(saved_args(folder), family=args.arch)
        if args.dry_run:
            spec = model.spec
            print(f"{folder}: {layout}, {spec.family}, {spec.num_layers} layers, hidden {spec.hidden_size}, "
                  f"{spec.num_heads} heads in {spec.num_query_groups} groups, vocab {spec.vocab_size}"
                  + (f", {spec.num_experts} experts" if spec.num_experts else ""))
            if layout == "torch_dist":  # the legacy format has no index to plan from
                tensors = TorchDistCheckpoint(folder).tensors()
                for line in describe_plan(plan_tasks(tensors, max_task_bytes=int(args.max_task_gb * 2**30))):
                    print(line)
            return EXIT_OK
        if args.target_tp > 1:
            if layout != "torch_dist":
                raise CliError("--target-tp N > 1 reshards torch_dist checkpoints only", exit_code=EXIT_USAGE)
            from rollmesh.checkpoint.tp_reshard import reshard_torch_dist

            files = reshard_torch_dist(folder, args.dst, model.spec, tp=args.target_tp, args=saved_args(folder))
            print(f"resharded {folder} -> {args.dst}: tensor parallel {args.target_tp}, {len(files)} files")
            return EXIT_OK
        config = hf_config(model.spec, norm_epsilon=model.norm_epsilon, rope_theta=model.rope_theta,
                           max_position_embeddings=model.max_position_embeddings,
                           dtype=dtype or model.dtype, moe_top_k=model.moe_top_k)
        files = _convert_with_progress(folder, layout, args, model, config, dtype)
    except CheckpointError as exc:
        raise CliError(str(exc)) from exc
    except ValueError as exc:
        raise CliError(str(exc), exit_code=EXIT_USAGE) from exc
    print(f"converted {folder} -> {args.dst}: {len(files)} files")
    return EXIT_OK


def _convert_with_progress(folder: Path, layout: str, args: argparse.Namespace, model: Any,
                           config: dict[str, Any], dtype: Any) -> list[str]:
    from rollmesh.checkpoint.megatron_to_hf import convert_legacy_to_hf, convert_torch_dist_to_hf

    convert = convert_torch_dist_to_hf if layout == "torch_dist" else convert_legacy_to_hf
    kwargs = dict(config=config, max_shard_bytes=int(args.max_shard_gb * 2**30), dtype=dtype)
    if not sys.stderr.isatty():
        return convert(folder, args.dst, model.spec, **kwargs)
    from rich.progress import Progress

    with Progress(transient=True) as bar:
        task = bar.add_task("converting", total=None)
        return convert(folder, args.dst, model.spec, **kwargs,
                       progress=lambda done, total: bar.update(task, completed=done, total=total))
