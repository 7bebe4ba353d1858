"""Checkpoint formats, the HF writer and the resharder, on the demo model's real state dict; the
resharder's export of a trained demo model, loaded by transformers with its tokenizer."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from support.fakes import RecordingPublisher

from rollmesh.checkpoint import (
    CheckpointReadError,
    CheckpointWriteError,
    ResharderLogic,
    UnsupportedCheckpointFormatError,
    load_torch_checkpoint,
    plan_shards,
    read_checkpoint,
    read_hf_checkpoint,
    save_torch_checkpoint,
    write_hf_checkpoint,
)
from rollmesh.config import ModelConfig, ResharderConfig, TrainerConfig
from rollmesh.messages import CheckpointConverted, CheckpointSaved

pytestmark = pytest.mark.unit

# Small enough to force several shards of the ~2.6 MB demo model, and below the largest tensors
# (its MLP weights are 256 KiB) so the one-tensor-per-oversized-shard rule is exercised too.
SMALL_SHARD_BYTES = 200_000
# The torch format holds the tiny model of older runs: nothing writes it now, but their
# checkpoints are still converted, with the model config they were saved with.
OLD_RUN_MODEL_CONFIG = {"family": "tiny", "vocab_size": 260, "d_model": 128, "n_layers": 2, "n_heads": 4,
                        "max_seq_len": 256, "seed": 0}


@pytest.fixture(scope="module")
def state_dict(demo_model_dir: Path) -> dict[str, torch.Tensor]:
    return read_hf_checkpoint(demo_model_dir)


def model_config_dict() -> dict:
    return dict(OLD_RUN_MODEL_CONFIG)


def assert_same_tensors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype, name
        assert torch.equal(got[name], tensor), name


def test_torch_checkpoint_round_trips_tensors_and_meta(tmp_path: Path, state_dict) -> None:
    path = save_torch_checkpoint(
        tmp_path / "ckpt", state_dict, model_config=model_config_dict(), step=7, weight_version=3
    )
    loaded, meta = load_torch_checkpoint(path)
    assert_same_tensors(loaded, state_dict)
    assert (meta.step, meta.weight_version) == (7, 3)
    assert meta.model_config == model_config_dict()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no staging left behind


def test_torch_checkpoint_save_replaces_an_existing_one(tmp_path: Path, state_dict) -> None:
    path = tmp_path / "ckpt"
    save_torch_checkpoint(path, {"x": torch.zeros(2)}, model_config={}, step=1, weight_version=1)
    save_torch_checkpoint(path, state_dict, model_config={}, step=2, weight_version=2)
    loaded, meta = load_torch_checkpoint(path)
    assert_same_tensors(loaded, state_dict)
    assert meta.step == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_torch_checkpoint_failed_save_leaves_the_old_one_and_no_staging(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "ckpt"
    save_torch_checkpoint(path, {"x": torch.zeros(2)}, model_config={}, step=1, weight_version=1)

    def crash_half_way(obj, file) -> None:
        Path(file).write_bytes(b"half a pickle")
        raise RuntimeError("disk full")

    monkeypatch.setattr(torch, "save", crash_half_way)
    with pytest.raises(CheckpointWriteError):
        save_torch_checkpoint(path, {"x": torch.ones(2)}, model_config={}, step=2, weight_version=2)
    monkeypatch.undo()
    loaded, meta = load_torch_checkpoint(path)
    assert torch.equal(loaded["x"], torch.zeros(2)) and meta.step == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_torch_checkpoint_rejects_config_that_is_not_json(tmp_path: Path) -> None:
    with pytest.raises(CheckpointWriteError):
        save_torch_checkpoint(
            tmp_path / "ckpt", {"x": torch.zeros(1)}, model_config={"bad": object()},
            step=0, weight_version=0,
        )
    assert list(tmp_path.iterdir()) == []


def test_torch_checkpoint_missing_directory_is_a_read_error(tmp_path: Path) -> None:
    with pytest.raises(CheckpointReadError) as caught:
        load_torch_checkpoint(tmp_path / "absent")
    assert caught.value.path == str(tmp_path / "absent")


@pytest.mark.parametrize("format", ["megatron_torch_dist", "megatron_legacy", "nonsense"])
def test_reader_registry_rejects_formats_without_a_reader(tmp_path: Path, format: str) -> None:
    with pytest.raises(UnsupportedCheckpointFormatError) as caught:
        read_checkpoint(tmp_path, format)
    assert caught.value.format == format
    assert caught.value.path == str(tmp_path)


def test_plan_shards_packs_greedily_and_isolates_oversized_tensors() -> None:
    sizes = {"a": 40, "b": 50, "c": 20, "huge": 500, "d": 10, "e": 90, "f": 5}
    assert plan_shards(sizes, 100) == [["a", "b"], ["c"], ["huge"], ["d", "e"], ["f"]]


def test_hf_writer_shards_by_size_with_hf_names_and_exact_index(tmp_path: Path, state_dict) -> None:
    out = tmp_path / "hf"
    files = write_hf_checkpoint(
        state_dict, out, max_shard_bytes=SMALL_SHARD_BYTES, config={"tie_word_embeddings": True}
    )
    shards = [name for name in files if name.endswith(".safetensors")]
    total = len(shards)
    assert total >= 3
    assert shards == [f"model-{i:05d}-of-{total:05d}.safetensors" for i in range(1, total + 1)]
    assert files[total:] == ["sha256_manifest.json", "config.json", "model.safetensors.index.json"]
    assert sorted(p.name for p in out.iterdir()) == sorted(files)
    manifest = json.loads((out / "sha256_manifest.json").read_text())
    assert manifest == {shard: hashlib.sha256((out / shard).read_bytes()).hexdigest() for shard in shards}

    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index) == {"metadata", "weight_map"}
    nbytes = {name: t.numel() * t.element_size() for name, t in state_dict.items()}
    assert index["metadata"] == {"total_size": sum(nbytes.values())}
    assert set(index["weight_map"]) == set(state_dict)

    rebuilt: dict[str, torch.Tensor] = {}
    for shard in shards:
        tensors = load_file(out / shard)
        assert all(index["weight_map"][name] == shard for name in tensors)
        shard_bytes = sum(nbytes[name] for name in tensors)
        assert shard_bytes <= SMALL_SHARD_BYTES or len(tensors) == 1
        with safe_open(out / shard, framework="pt") as handle:
            assert handle.metadata() == {"format": "pt"}  # transformers requires it
        rebuilt.update(tensors)
    assert rebuilt.keys() == state_dict.keys()
    assert_same_tensors({name: rebuilt[name] for name in state_dict}, state_dict)
    assert json.loads((out / "config.json").read_text()) == {"tie_word_embeddings": True}
    assert_same_tensors(read_hf_checkpoint(out), state_dict)


def test_hf_writer_puts_everything_in_one_shard_when_it_fits(tmp_path: Path, state_dict) -> None:
    files = write_hf_checkpoint(state_dict, tmp_path / "hf", max_shard_bytes=1 << 30, config={})
    assert files[0] == "model-00001-of-00001.safetensors"
    assert len(files) == 4


def test_hf_writer_accepts_shared_and_non_contiguous_tensors(tmp_path: Path) -> None:
    # safetensors refuses shared storage and non-contiguous views; the writer must copy them.
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    tensors = {"a": base, "a_alias": base, "row": base[1], "t": base.T}
    write_hf_checkpoint(tensors, tmp_path / "hf", max_shard_bytes=1 << 20, config={})
    assert_same_tensors(read_hf_checkpoint(tmp_path / "hf"), tensors)


def test_hf_reader_names_the_missing_index(tmp_path: Path) -> None:
    with pytest.raises(CheckpointReadError):
        read_hf_checkpoint(tmp_path)


def saved_event(source: Path, *, step: int = 5, format: str = "torch", model_config: dict | None = None) -> CheckpointSaved:
    return CheckpointSaved(step=step, weight_version=2, path=str(source), format=format,
                           model_config=model_config or {})


async def test_resharder_converts_a_torch_checkpoint_to_hf(tmp_path: Path, state_dict) -> None:
    source = save_torch_checkpoint(
        tmp_path / "ckpt", state_dict, model_config=model_config_dict(), step=5, weight_version=2
    )
    resharder = ResharderLogic(
        ResharderConfig(max_shard_bytes=SMALL_SHARD_BYTES), export_root=tmp_path / "hf"
    )
    converted = await resharder.handle_checkpoint_saved(saved_event(source))
    assert isinstance(converted, CheckpointConverted)
    assert converted.hf_path == str(tmp_path / "hf" / "step_00000005")
    assert (converted.step, converted.weight_version) == (5, 2)
    assert converted.source_path == str(source)
    hf_dir = Path(converted.hf_path)
    assert converted.num_bytes == sum((hf_dir / name).stat().st_size for name in converted.files)
    assert_same_tensors(read_hf_checkpoint(hf_dir), state_dict)
    assert json.loads((hf_dir / "config.json").read_text()) == model_config_dict()


async def test_resharder_converting_the_same_step_twice_gives_the_same_result(
    tmp_path: Path, state_dict, demo_model_dir: Path
) -> None:
    source = save_torch_checkpoint(
        tmp_path / "ckpt", state_dict, model_config={}, step=5, weight_version=2
    )
    resharder = ResharderLogic(
        ResharderConfig(max_shard_bytes=SMALL_SHARD_BYTES), export_root=tmp_path / "hf"
    )
    event = saved_event(source, model_config={"path": str(demo_model_dir)})
    first = await resharder.handle_checkpoint_saved(event)
    assert "tokenizer.json" in first.files  # the tokenizer files are part of the export
    mtimes = {name: (Path(first.hf_path) / name).stat().st_mtime_ns for name in first.files}
    second = await resharder.handle_checkpoint_saved(event)
    assert second == first
    # The redelivered event reused the export instead of writing it again.
    assert mtimes == {name: (Path(first.hf_path) / name).stat().st_mtime_ns for name in first.files}
    # A fresh resharder (a restarted actor) also answers the same message.
    again = ResharderLogic(
        ResharderConfig(max_shard_bytes=SMALL_SHARD_BYTES), export_root=tmp_path / "hf"
    )
    assert await again.handle_checkpoint_saved(event) == first
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["step_00000005"]


async def test_resharder_redoes_an_export_of_the_same_step_from_another_source(
    tmp_path: Path, state_dict
) -> None:
    old = save_torch_checkpoint(
        tmp_path / "old", {"x": torch.ones(3)}, model_config={}, step=5, weight_version=2
    )
    new = save_torch_checkpoint(
        tmp_path / "new", state_dict, model_config={}, step=5, weight_version=2
    )
    resharder = ResharderLogic(ResharderConfig(), export_root=tmp_path / "hf")
    await resharder.handle_checkpoint_saved(saved_event(old))
    converted = await resharder.handle_checkpoint_saved(saved_event(new))
    assert_same_tensors(read_hf_checkpoint(Path(converted.hf_path)), state_dict)


def test_an_export_of_a_trained_demo_model_loads_in_transformers_with_its_tokenizer_and_chat_template(
    tmp_path: Path, demo_model_dir: Path
) -> None:
    import transformers

    from rollmesh.chat import ChatModel
    from rollmesh.rollout.molar_mass import MolarMassTask
    from rollmesh.training.torch_backend import TorchTrainerBackend
    from rollmesh.training.warm_start import conversation_sequence

    torch.manual_seed(0)
    model_config = ModelConfig(path=str(demo_model_dir))
    backend = TorchTrainerBackend(model_config, TrainerConfig(torch_threads=1))
    task = MolarMassTask()
    conversation = [*task.messages({"formula": "NaCl"}), {"role": "assistant", "content": "58.440"}]
    chat = ChatModel.from_config(model_config)
    backend.sft_step([conversation_sequence(chat, conversation, tools=task.tools())], lr=1e-2)  # trained
    path, layout = backend.save_checkpoint(tmp_path / "checkpoints", iteration=3)
    saved = CheckpointSaved(step=3, weight_version=1, path=str(path), format=layout,
                            model_config={"path": model_config.path})
    converted = ResharderLogic(ResharderConfig(), export_root=tmp_path / "hf").convert(saved)
    export = Path(converted.hf_path)

    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert name in converted.files and (export / name).read_bytes() == (demo_model_dir / name).read_bytes()
    tokenizer = transformers.AutoTokenizer.from_pretrained(export)
    rendered = tokenizer.apply_chat_template(task.messages({"formula": "NaCl"}), tools=task.tools(),
                                             add_generation_prompt=True, tokenize=False)
    assert rendered == chat.render(task.messages({"formula": "NaCl"}), tools=task.tools(), add_generation_prompt=True)
    ids = tokenizer(rendered, add_special_tokens=False)["input_ids"]
    assert ids == chat.encode(rendered)
    model = transformers.AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32)
    with torch.no_grad():
        theirs = model(torch.tensor([ids])).logits
        ours = backend.model(torch.tensor([ids]))
    torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-4)  # the trained weights, not the seed's


async def test_resharder_fails_the_export_when_the_model_directory_is_gone(tmp_path: Path, state_dict) -> None:
    source = save_torch_checkpoint(tmp_path / "ckpt", state_dict, model_config={}, step=5, weight_version=2)
    resharder = ResharderLogic(ResharderConfig(), export_root=tmp_path / "hf")
    event = saved_event(source, model_config={"path": str(tmp_path / "deleted-model")})
    with pytest.raises(CheckpointReadError, match="tokenizer") as caught:
        await resharder.handle_checkpoint_saved(event)
    assert caught.value.path == str(tmp_path / "deleted-model")


@pytest.mark.parametrize("format", ["megatron_torch_dist", "megatron_legacy"])
async def test_resharder_names_a_missing_megatron_checkpoint(tmp_path: Path, format: str) -> None:
    # Real Megatron conversions: tests/test_checkpoint_convert.py.
    resharder = ResharderLogic(ResharderConfig(), export_root=tmp_path / "hf")
    with pytest.raises(CheckpointReadError, match="no such checkpoint directory"):
        await resharder.handle_checkpoint_saved(saved_event(tmp_path / "ckpt", format=format))
    assert not (tmp_path / "hf" / "step_00000005").exists()


async def test_resharder_logic_answers_checkpoint_saved_converted_or_failed(tmp_path: Path, state_dict) -> None:
    """The role's handler: a checkpoint that converts -> CheckpointConverted; one that is not
    there -> CheckpointConversionFailed naming why, and the event is settled (no raise)."""
    from rollmesh.messages import CheckpointConversionFailed
    from rollmesh.messages.subjects import CHECKPOINT_CONVERTED, CHECKPOINT_FAILED
    from rollmesh.ports import MessageContext

    source = save_torch_checkpoint(tmp_path / "ckpt", state_dict, model_config=model_config_dict(), step=5,
                                   weight_version=2)
    publisher = RecordingPublisher()
    logic = ResharderLogic(ResharderConfig(), export_root=tmp_path / "hf", publisher=publisher)
    [subscription] = logic.subscriptions()
    await subscription.handler(saved_event(source), MessageContext(subject="rl.ns.ckpt.saved"))
    missing = saved_event(tmp_path / "gone", step=6, format="megatron_torch_dist")
    await subscription.handler(missing, MessageContext(subject="rl.ns.ckpt.saved"))

    [converted] = publisher.messages(CHECKPOINT_CONVERTED)
    assert converted.hf_path == str(tmp_path / "hf" / "step_00000005")
    [failed] = publisher.messages(CHECKPOINT_FAILED)
    assert isinstance(failed, CheckpointConversionFailed)
    assert (failed.step, failed.error_type) == (6, "CheckpointReadError")


def test_resharder_logic_refuses_to_serve_without_a_publisher(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="publisher"):
        ResharderLogic(ResharderConfig(), export_root=tmp_path / "hf").subscriptions()


def test_the_resharder_role_starts_without_importing_torch(tmp_path: Path) -> None:
    """Every mesh starts a resharder; torch (seconds of CPU in its new process) waits for the
    first checkpoint to convert."""
    import subprocess
    import sys

    code = ("import sys; from pathlib import Path; from rollmesh.actors.resharder import ResharderActor; "
            "from rollmesh.checkpoint import CheckpointReadError, ResharderLogic; "
            "from rollmesh.config import ResharderConfig; "
            # Serving needs a publisher, never called here.
            f"logic = ResharderLogic(ResharderConfig(), export_root=Path({str(tmp_path)!r}), publisher=object()); "
            "assert logic.subscriptions(), 'serves nothing'; "
            "assert 'torch' not in sys.modules, 'imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_checkpoint_package_exports_what_it_states() -> None:
    import rollmesh.checkpoint as package

    assert all(hasattr(package, name) for name in package.__all__)


def test_a_rerun_after_a_writer_was_killed_mid_write_publishes_and_clears_its_staging(tmp_path: Path, state_dict):
    """A converter killed mid-write leaves its staging directory (and no published one); the rerun
    writes the same export and removes what the dead writer left, never a live writer's."""
    import subprocess
    import sys

    out = tmp_path / "hf"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    abandoned = tmp_path / f".hf.staging-{dead.stdout.strip()}-0123abcd"
    abandoned.mkdir()
    (abandoned / "model-00001-of-00002.safetensors").write_bytes(b"half a shard")
    live = tmp_path / f".hf.staging-{os.getpid()}-4567ef01"  # a concurrent writer still running
    live.mkdir()
    files = write_hf_checkpoint(state_dict, out, max_shard_bytes=SMALL_SHARD_BYTES, config={})
    assert not abandoned.exists() and live.exists()
    again = write_hf_checkpoint(state_dict, out, max_shard_bytes=SMALL_SHARD_BYTES, config={})
    assert again == files and sorted(p.name for p in out.iterdir()) == sorted(files)
    assert_same_tensors(read_hf_checkpoint(out), state_dict)
