"""Hugging Face safetensors checkpoints: sharded writer and index-driven reader.

Knows torch, safetensors and the HF on-disk layout; not Megatron, not model architectures (name
maps and HF config keys come from the caller). Layout: ``model-00001-of-0000N.safetensors`` shards,
``model.safetensors.index.json`` (``{"metadata": {"total_size": ...}, "weight_map": {...}}``) and
``config.json``, always with the index, even for one shard. Shard limits count tensor bytes, as
HF's own writer does; each file adds a small JSON header on top. ``copy_tokenizer_files`` puts a
model directory's tokenizer, chat template and generation config beside an export, so the export
loads as a whole model (``AutoTokenizer`` and ``apply_chat_template`` included).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import msgspec
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor

from rollmesh.checkpoint.atomic_dir import staged_directory, write_file_atomically
from rollmesh.checkpoint.errors import CheckpointReadError, CheckpointWriteError
from rollmesh.checkpoint.meta import read_json_struct
from rollmesh.checkpoint.safetensors_stream import SHARD_METADATA

INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"
# sha256 of every shard, so a copy of the export can be checked without loading it.
MANIFEST_FILE = "sha256_manifest.json"
SINGLE_FILE = "model.safetensors"
# What a model directory ships for its tokenizer, chat template and generation settings besides
# the weights and config.json; transformers reads whichever of them exist.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "chat_template.json",
                   "generation_config.json", "special_tokens_map.json", "added_tokens.json", "vocab.json",
                   "merges.txt", "tokenizer.model")


class _HfIndex(msgspec.Struct, frozen=True):
    metadata: dict[str, Any]
    weight_map: dict[str, str]


def shard_file_name(index: int, total: int) -> str:
    """HF's name for shard ``index`` (1-based) of ``total``."""
    return f"model-{index:05d}-of-{total:05d}.safetensors"


def plan_shards(sizes: dict[str, int], max_shard_bytes: int) -> list[list[str]]:
    """Pack tensor names greedily, in order, into shards of at most ``max_shard_bytes``.

    A tensor larger than the limit gets a shard of its own. Order is kept, so the plan (and the
    files) are the same on every run.
    """
    if max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes must be positive, not {max_shard_bytes}")
    shards: list[list[str]] = []
    current: list[str] = []
    current_bytes = 0
    for name, size in sizes.items():
        if current and current_bytes + size > max_shard_bytes:
            shards.append(current)
            current, current_bytes = [], 0
        current.append(name)
        current_bytes += size
    if current:
        shards.append(current)
    return shards


def write_hf_checkpoint(
    state_dict: dict[str, Tensor],
    out_dir: Path,
    *,
    max_shard_bytes: int,
    config: dict[str, Any],
) -> list[str]:
    """Write an HF checkpoint directory at ``out_dir`` atomically; return its file names.

    Shard files come first, in order, then the sha256 manifest, ``config.json`` and the index.
    """
    out_dir = Path(out_dir)
    if not state_dict:
        raise CheckpointWriteError("empty state dict", path=str(out_dir))
    try:
        config_bytes = json.dumps(config, indent=2, sort_keys=True).encode()
    except (TypeError, ValueError) as exc:
        raise CheckpointWriteError(f"config is not JSON: {exc}", path=str(out_dir)) from exc
    sizes = {name: tensor.numel() * tensor.element_size() for name, tensor in state_dict.items()}
    plan = plan_shards(sizes, max_shard_bytes)
    names = [shard_file_name(number, len(plan)) for number in range(1, len(plan) + 1)]
    weight_map = {tensor: file for file, shard in zip(names, plan) for tensor in shard}
    index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}
    with staged_directory(out_dir) as staging:
        for file, shard in zip(names, plan):
            # safetensors refuses tensors that share storage (tied weights) or are not contiguous;
            # a private contiguous CPU copy per shard satisfies both and bounds memory to a shard.
            tensors = {name: state_dict[name].detach().cpu().contiguous().clone() for name in shard}
            try:
                save_file(tensors, str(staging / file), metadata=SHARD_METADATA)
            except (SafetensorError, ValueError, RuntimeError) as exc:
                raise CheckpointWriteError(f"{file}: {exc}", path=str(out_dir)) from exc
        manifest = {file: _sha256_of(staging / file) for file in names}
        (staging / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        (staging / CONFIG_FILE).write_bytes(config_bytes + b"\n")
        (staging / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")  # last: it names the rest
    return [*names, MANIFEST_FILE, CONFIG_FILE, INDEX_FILE]


def copy_tokenizer_files(model_dir: Path, out_dir: Path) -> list[str]:
    """Copy the ``TOKENIZER_FILES`` that ``model_dir`` has into the export ``out_dir`` (each one
    atomically); returns their names. A missing ``model_dir`` is a ``CheckpointReadError``: an
    export without its tokenizer would look whole and fail only when someone loads it."""
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    if not model_dir.is_dir():
        raise CheckpointReadError("the model directory to take the tokenizer from is missing", path=str(model_dir))
    copied = []
    for name in TOKENIZER_FILES:
        if (model_dir / name).is_file():
            write_file_atomically(out_dir / name, (model_dir / name).read_bytes())
            copied.append(name)
    return copied


def _sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def list_hf_files(directory: Path) -> list[str]:
    """The files of an HF checkpoint, in the order ``write_hf_checkpoint`` returns them."""
    directory = Path(directory)
    index = _read_index(directory)
    shards = list(dict.fromkeys(sorted(index.weight_map.values())))
    extras = [name for name in (MANIFEST_FILE, CONFIG_FILE, INDEX_FILE) if (directory / name).is_file()]
    return [*shards, *extras]


def read_hf_checkpoint(directory: Path) -> dict[str, Tensor]:
    """Load every tensor the index names (or the single ``model.safetensors``) onto the CPU."""
    directory = Path(directory)
    if not (directory / INDEX_FILE).exists() and (directory / SINGLE_FILE).is_file():
        return _load_shard(directory, SINGLE_FILE)
    index = _read_index(directory)
    loaded: dict[str, dict[str, Tensor]] = {}
    for file in dict.fromkeys(index.weight_map.values()):
        loaded[file] = _load_shard(directory, file)
    state_dict: dict[str, Tensor] = {}
    for name, file in index.weight_map.items():
        if name not in loaded[file]:
            raise CheckpointReadError(f"{name} is not in {file}", path=str(directory))
        state_dict[name] = loaded[file][name]
    return state_dict


def _read_index(directory: Path) -> _HfIndex:
    index = read_json_struct(directory / INDEX_FILE, _HfIndex)
    for file in index.weight_map.values():
        # The index is data from disk: a name with a separator could point outside the directory.
        if Path(file).name != file or file in ("", ".", ".."):
            raise CheckpointReadError(f"bad shard name {file!r} in index", path=str(directory))
    return index


def _load_shard(directory: Path, file: str) -> dict[str, Tensor]:
    try:
        return load_file(str(directory / file), device="cpu")
    except (OSError, SafetensorError) as exc:
        raise CheckpointReadError(f"{file}: {exc}", path=str(directory)) from exc
