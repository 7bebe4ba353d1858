"""``rollmesh convert SRC DST``: a Megatron checkpoint (torch_dist or legacy) to a Hugging Face directory.

Knows the checkpoint package and argparse. SRC is a Megatron save root (with
``latest_checkpointed_iteration.txt``) or one iteration folder; the format is detected and the
architecture read from the arguments saved with the checkpoint (``--arch`` only overrides the
detection). ``--dry-run`` prints the model and the conversion plan and writes nothing. Works
without a mesh or NATS; ``--backend ray`` spreads the shards over Ray: the Ray of the mesh in
``--run-dir`` (its address and token from ``mesh.json``), else the cluster at ``RAY_ADDRESS`` (its
token, if it wants one, from the cluster's own ``RAY_AUTH_*`` variables), else a local Ray started
for the run (on loopback, token auth on, the token in a private temporary directory).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, nullcontext
from pathlib import Path
from typing import Any

from rollmesh.cli.errors import EXIT_OK, EXIT_USAGE, CliError
from rollmesh.cli.target import load_cli_config, positive_float, read_cli_mesh_address

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
                         help="worker threads in this process, or Ray tasks: on the Ray of --run-dir's mesh, "
                              "the cluster at RAY_ADDRESS, or a local Ray of its own (one node or many, "
                              "sharing the file system; default: %(default)s)")
    convert.add_argument("--run-dir", type=Path, metavar="DIR",
                         help="with --backend ray: use the Ray of the mesh running in DIR (mesh.json names "
                              "its address and token)")
    convert.add_argument("--dry-run", action="store_true", help="print the model and the plan, write nothing")
    convert.set_defaults(handler=run_convert)


def run_convert(args: argparse.Namespace) -> int:
    if args.target_tp < 1:
        raise CliError("--target-tp must be at least 1", exit_code=EXIT_USAGE)
    if args.workers < 1:
        raise CliError("--workers must be at least 1", exit_code=EXIT_USAGE)
    if args.run_dir is not None and args.backend != "ray":
        raise CliError("--run-dir names the mesh whose Ray --backend ray uses; add --backend ray",
                       exit_code=EXIT_USAGE)
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
        with _ray_for_convert(args) if args.backend == "ray" else nullcontext():
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

    if not sys.stderr.isatty():
        return export_to_hf(args.src, args.dst, options, progress=_progress_lines())
    from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn

    columns = (*Progress.get_default_columns()[:1], BarColumn(), DownloadColumn(), TransferSpeedColumn(),
               TimeRemainingColumn())
    with Progress(*columns, transient=True) as bar:
        task = bar.add_task("converting", total=None)
        return export_to_hf(args.src, args.dst, options,
                            progress=lambda done, total: bar.update(task, completed=done, total=total))


@contextmanager
def _ray_for_convert(args: argparse.Namespace) -> Iterator[None]:
    """Ray for the shards: the mesh's of --run-dir, RAY_ADDRESS's, or a local one of its own."""
    import ray

    from rollmesh.local_ray import LocalRayEnvironment, write_ray_auth_token

    config = load_cli_config(args)
    with ExitStack() as stack:
        if args.run_dir is not None:
            info = read_cli_mesh_address(args, config)
            if not info.ray_address:
                raise CliError(f"the mesh in {info.run_dir} names no Ray address in its mesh.json")
            address, options = info.ray_address, {}
            if info.ray_auth_token_file:  # a Ray the mesh started: loopback, its token
                host = address.rsplit(":", 1)[0].strip("[]")
                environment = LocalRayEnvironment(token_file=info.ray_auth_token_file, node_ip_address=host)
                environment.apply()
                stack.callback(environment.restore)
            print(f"Ray: the mesh's, at {address} (run dir {info.run_dir})", file=sys.stderr, flush=True)
        elif os.environ.get("RAY_ADDRESS"):
            address, options = os.environ["RAY_ADDRESS"], {}
        else:  # a Ray of its own, kept to this machine like a mesh's
            token_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="rollmesh-convert-ray-"))
            environment = LocalRayEnvironment(token_file=write_ray_auth_token(token_dir),
                                              node_ip_address=config.ray.node_ip_address)
            environment.apply()
            stack.callback(environment.restore)
            address, options = None, environment.init_options()
        ray.init(address=address, include_dashboard=False, log_to_driver=False, **options)
        stack.callback(ray.shutdown)
        yield


def _progress_lines() -> Any:
    printed = [-1]  # the last tenth reported: a line per 10%, however many shards

    def report(done: int, total: int) -> None:
        tenth = 10 * done // max(total, 1)
        if tenth > printed[0]:
            printed[0] = tenth
            print(f"converted {done / 2**20:.1f} of {total / 2**20:.1f} MiB ({100 * done / max(total, 1):.0f}%)",
                  file=sys.stderr, flush=True)

    return report
