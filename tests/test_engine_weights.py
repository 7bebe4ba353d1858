"""Weight files: atomic safetensors writes, sha256-checked reads, staging what was read."""

from __future__ import annotations

import hashlib

import pytest
import torch

from support.engine_models import babbling_model
from rollmesh.engine.decode import DecodeEngine
from rollmesh.engine.errors import WeightsChecksumError, WeightsFileError
from rollmesh.engine.weights import load_weights, save_weights

pytestmark = pytest.mark.unit


def state_of(model) -> dict[str, torch.Tensor]:
    """A state dict safetensors can write: tied tensors (the demo's head is its embedding) are
    written as separate copies, as the trainer's published files hold them."""
    return {name: tensor.clone() for name, tensor in model.state_dict().items()}


def test_saved_weights_load_back_equal_with_the_returned_checksum(tmp_path, demo_model_dir) -> None:
    state = state_of(babbling_model(demo_model_dir))
    path = tmp_path / "v1" / "model.safetensors"
    sha256, num_bytes = save_weights(state, path)
    data = path.read_bytes()
    assert (sha256, num_bytes) == (hashlib.sha256(data).hexdigest(), len(data))
    assert [p.name for p in path.parent.iterdir()] == ["model.safetensors"]  # no tmp left
    loaded = load_weights(path, expected_sha256=sha256)
    assert loaded.keys() == state.keys()
    assert all(torch.equal(loaded[name], state[name]) for name in state)


def test_loading_weights_with_a_wrong_checksum_raises(tmp_path) -> None:
    path = tmp_path / "model.safetensors"
    sha256, _ = save_weights({"w": torch.ones(3)}, path)
    with pytest.raises(WeightsChecksumError) as caught:
        load_weights(path, expected_sha256="0" * 64)
    assert caught.value.actual == sha256 and caught.value.path == str(path)


def test_missing_or_malformed_weight_files_raise_file_errors(tmp_path) -> None:
    with pytest.raises(WeightsFileError):
        load_weights(tmp_path / "absent.safetensors")
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"not safetensors at all")
    with pytest.raises(WeightsFileError):
        load_weights(garbage)
    shared = torch.ones(4)
    with pytest.raises(WeightsFileError):
        save_weights({"a": shared, "b": shared}, tmp_path / "shared.safetensors")


def test_loaded_weights_stage_into_a_decode_engine(tmp_path, demo_model_dir) -> None:
    path = tmp_path / "model.safetensors"
    new = babbling_model(demo_model_dir, seed=5)
    sha256, _ = save_weights(state_of(new), path)
    engine = DecodeEngine(babbling_model(demo_model_dir), max_batch=1)
    assert not torch.equal(engine.model.model.embed_tokens.weight, new.model.embed_tokens.weight)
    assert engine.stage_weights(load_weights(path, sha256), version=1)
    engine.step()
    assert engine.current_version == 1
    assert torch.equal(engine.model.model.embed_tokens.weight, new.model.embed_tokens.weight)
    assert engine.model.lm_head.weight is engine.model.model.embed_tokens.weight
