"""Load Hugging Face safetensors checkpoints (sharded with an index, or one file) into a model.

Knows the safetensors layout on disk and transformers 5.x's in-memory fused-expert names; does
not know the maths. The key check is strict: every model tensor must come from the checkpoint
and every checkpoint tensor must land in the model, else ``CheckpointKeysError`` lists them.

Names: transformers >= 5 keeps MoE experts fused in memory (``mlp.experts.gate_up_proj``
[E, 2I, H] and ``mlp.experts.down_proj`` [E, H, I], and Mixtral's ``block_sparse_moe`` renamed
``mlp``) but ``save_pretrained`` writes the per-expert hub layout. Files therefore load as they
are; ``split_fused_experts`` maps a live transformers state dict to the same hub names.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from rollmesh.engine.errors import WeightsFileError
from rollmesh.engine.models.errors import CheckpointKeysError
from rollmesh.engine.models.families import build_causal_lm
from rollmesh.engine.models.hf_config import HFModelConfig, read_hf_config
from rollmesh.engine.models.llama import CausalLM

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_TIED_HEAD = "lm_head.weight"


def load_hf_model(
    model_dir: str | Path, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> CausalLM:
    """Build the model ``config.json`` describes and load its safetensors, strictly."""
    model_dir = Path(model_dir)
    config = read_hf_config(model_dir)
    # Built on the meta device: no random init of weights that are about to be replaced.
    with torch.device("meta"):
        model = build_causal_lm(config)
    state_dict = read_safetensors(model_dir, dtype=dtype, device=device)
    load_state_dict_strict(model, state_dict, path=str(model_dir))
    return model.eval()


def read_safetensors(
    model_dir: str | Path, *, dtype: torch.dtype | None = None, device: str | torch.device = "cpu"
) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint directory, via its index if it has one."""
    model_dir = Path(model_dir)
    index_path = model_dir / INDEX_FILE
    if index_path.exists():
        shards = _read_index(index_path)
    elif (model_dir / SINGLE_FILE).exists():
        shards = {SINGLE_FILE: None}
    else:
        raise WeightsFileError(str(model_dir), f"neither {INDEX_FILE} nor {SINGLE_FILE} found")
    tensors: dict[str, torch.Tensor] = {}
    for shard, expected_keys in shards.items():
        shard_path = model_dir / shard
        try:
            with safe_open(str(shard_path), framework="pt", device=str(device)) as f:
                keys = set(f.keys())
                if expected_keys is not None and not expected_keys <= keys:
                    absent = sorted(expected_keys - keys)
                    raise WeightsFileError(
                        str(shard_path), f"index maps {len(absent)} tensors here it lacks: {absent[:8]}"
                    )
                for key in sorted(expected_keys if expected_keys is not None else keys):
                    t = f.get_tensor(key)
                    tensors[key] = t.to(dtype) if dtype is not None and t.is_floating_point() else t
        except (OSError, SafetensorError) as exc:
            raise WeightsFileError(str(shard_path), f"cannot read shard: {exc}") from exc
    return tensors


def _read_index(index_path: Path) -> dict[str, set[str]]:
    try:
        weight_map = json.loads(index_path.read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise WeightsFileError(str(index_path), f"malformed index: {exc!r}") from exc
    if not isinstance(weight_map, dict):
        raise WeightsFileError(str(index_path), "weight_map is not an object")
    shards: dict[str, set[str]] = {}
    for key, shard in weight_map.items():
        # A shard name is a file beside the index, never a path out of the directory.
        if not isinstance(shard, str) or Path(shard).name != shard:
            raise WeightsFileError(str(index_path), f"bad shard name {shard!r} for {key}")
        shards.setdefault(shard, set()).add(key)
    return shards


def load_state_dict_strict(
    model: CausalLM, state_dict: dict[str, torch.Tensor], *, path: str | None = None
) -> None:
    """Assign ``state_dict`` into ``model`` after checking names and shapes exactly.

    A tied model takes ``lm_head.weight`` from the embedding, so the checkpoint may omit it
    (HF omits it when saving tied models) and, if present, it is ignored.
    """
    expected = {k: v.shape for k, v in model.state_dict().items()}
    state_dict = dict(state_dict)
    if model.config.tie_word_embeddings:
        expected.pop(_TIED_HEAD, None)
        state_dict.pop(_TIED_HEAD, None)
    missing = sorted(expected.keys() - state_dict.keys())
    unexpected = sorted(state_dict.keys() - expected.keys())
    mismatched = sorted(
        f"{k} {tuple(state_dict[k].shape)} != {tuple(shape)}"
        for k, shape in expected.items()
        if k in state_dict and state_dict[k].shape != shape
    )
    if missing or unexpected or mismatched:
        raise CheckpointKeysError(path=path, missing=missing, unexpected=unexpected, mismatched=mismatched)
    # assign=True swaps in the loaded tensors (needed for a meta-built model); re-tie afterwards
    # because assignment gives the embedding a new Parameter the head no longer shares.
    model.load_state_dict(state_dict, strict=False, assign=True)
    model.tie_weights()


_FUSED = re.compile(r"^(model\.layers\.\d+)\.mlp\.(experts\.gate_up_proj|experts\.down_proj|gate\.weight)$")


def split_fused_experts(
    state_dict: dict[str, torch.Tensor], config: HFModelConfig
) -> dict[str, torch.Tensor]:
    """Rename a transformers 5.x in-memory MoE state dict to the per-expert checkpoint names."""
    if config.moe is None:
        return dict(state_dict)
    mixtral = config.model_type == "mixtral"
    ffn = config.feed_forward_name
    gate_name, up_name, down_name = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    out: dict[str, torch.Tensor] = {}
    for key, tensor in state_dict.items():
        match = _FUSED.match(key)
        if match is None:
            out[key] = tensor
            continue
        layer, what = match.groups()
        if what == "gate.weight":
            out[f"{layer}.{ffn}.gate.weight"] = tensor
        elif what == "experts.gate_up_proj":
            # [E, 2I, H]: rows [0, I) are the gate projection, [I, 2I) the up projection.
            gate, up = tensor.chunk(2, dim=1)
            for e in range(tensor.shape[0]):
                out[f"{layer}.{ffn}.experts.{e}.{gate_name}.weight"] = gate[e]
                out[f"{layer}.{ffn}.experts.{e}.{up_name}.weight"] = up[e]
        else:
            for e in range(tensor.shape[0]):
                out[f"{layer}.{ffn}.experts.{e}.{down_name}.weight"] = tensor[e]
    return out
