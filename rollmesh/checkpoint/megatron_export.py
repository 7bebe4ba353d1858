"""One Megatron checkpoint (save root or iteration folder, torch_dist or legacy) -> one Hugging
Face directory: the entry point ``rollmesh convert`` and the resharder actor share.

Knows the save layout and saved arguments (``megatron_args``), the HF config (``hf_config``) and
the two converters: the planned, parallel one for torch_dist (``convert_executor``) and the
whole-file merge for the legacy format, which has no index to plan from.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from rollmesh.checkpoint.arch_maps import Family
from rollmesh.checkpoint.convert_executor import Backend, convert_planned, plan_conversion
from rollmesh.checkpoint.megatron_args import ModelDescription, describe_model, detect_format, resolve_iteration_dir, saved_args
from rollmesh.checkpoint.megatron_to_hf import convert_legacy_to_hf, hf_config

Layout = Literal["torch_dist", "megatron_legacy"]


@dataclass(frozen=True)
class ExportOptions:
    arch: Family | None = None  # overrides the architecture read from the saved arguments
    dtype: torch.dtype | None = None  # None: keep the checkpoint's
    max_shard_bytes: int = 5 << 30
    memory_budget_bytes: int = 4 << 30  # summed over the workers
    workers: int = 2
    backend: Backend = "threads"


@dataclass(frozen=True)
class MegatronSource:
    folder: Path  # the iteration folder
    layout: Layout
    model: ModelDescription


def inspect_source(src: str | Path, *, arch: Family | None = None) -> MegatronSource:
    folder = resolve_iteration_dir(src)
    layout: Layout = detect_format(folder)  # type: ignore[assignment]
    return MegatronSource(folder, layout, describe_model(saved_args(folder), family=arch, path=str(folder)))


def export_to_hf(src: str | Path, dst: str | Path, options: ExportOptions = ExportOptions(),
                 progress: Callable[[int, int], None] | None = None) -> list[str]:
    """Write the HF directory ``dst`` from the Megatron checkpoint ``src``; returns its files."""
    source = inspect_source(src, arch=options.arch)
    model = source.model
    config = hf_config(model.spec, norm_epsilon=model.norm_epsilon, rope_theta=model.rope_theta,
                       max_position_embeddings=model.max_position_embeddings,
                       dtype=options.dtype or model.dtype, moe_top_k=model.moe_top_k)
    if source.layout == "torch_dist":
        return convert_planned(source.folder, dst, model.spec, config=config, max_shard_bytes=options.max_shard_bytes,
                               memory_budget_bytes=options.memory_budget_bytes, workers=options.workers,
                               backend=options.backend, dtype=options.dtype, progress=progress)
    return convert_legacy_to_hf(source.folder, dst, model.spec, config=config, max_shard_bytes=options.max_shard_bytes,
                                dtype=options.dtype, progress=progress)


def describe_export(src: str | Path, options: ExportOptions = ExportOptions()) -> list[str]:
    """What ``--dry-run`` prints: the model, then (torch_dist) one line per planned shard."""
    source = inspect_source(src, arch=options.arch)
    spec = source.model.spec
    lines = [f"{source.folder}: {source.layout}, {spec.family}, {spec.num_layers} layers, hidden {spec.hidden_size}, "
             f"{spec.num_heads} heads in {spec.num_query_groups} groups, vocab {spec.vocab_size}"
             + (f", {spec.num_experts} experts" if spec.num_experts else "")]
    if source.layout != "torch_dist":
        return [*lines, "legacy per-rank files: no index to plan from; every rank file is loaded and merged"]
    plan = plan_conversion(source.folder, spec, dtype=options.dtype, max_shard_bytes=options.max_shard_bytes,
                           memory_budget_bytes=options.memory_budget_bytes, workers=options.workers)
    lines.append(f"{len(plan.jobs)} shard(s), {plan.total_bytes} bytes, {options.workers} worker(s) within "
                 f"{options.memory_budget_bytes} bytes of memory ({options.backend})")
    for job in plan.jobs:
        names = list(dict.fromkeys(unit.name for unit in job.units))
        lines.append(f"  {job.file}: {job.out_bytes} bytes, holds at most {job.memory_bytes}, {len(job.units)} "
                     f"unit(s): {', '.join(names[:3])}{' ...' if len(names) > 3 else ''}")
    return lines
