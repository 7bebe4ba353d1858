"""Supervised stages on the trainer: batches read from a stage's data (rendered, gathered to
batch_tokens, bad rows reported), a step that trains a packed batch and records the stage's place
in the ledger atomically with its weights, and a restarted trainer that reads on from there."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest
import torch

from support.fakes import RecordingPublisher
from rollmesh.chat.chat_model import ChatModel
from rollmesh.config import ModelConfig, TrainerConfig
from rollmesh.messages.subjects import WEIGHTS_PUBLISHED
from rollmesh.run_config import StageConfig
from rollmesh.training.ledger import TrainingLedger
from rollmesh.training.supervised import SupervisedSource
from rollmesh.training.torch_backend import TorchTrainerBackend
from rollmesh.training.trainer_logic import TrainerLogic

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]


def chat_rows(count: int) -> list[dict]:
    return [{"messages": [{"role": "user", "content": f"What is {i} + 1?"},
                          {"role": "assistant", "content": str(i + 1)}]} for i in range(count)]


def write_rows(path: Path, rows: list) -> Path:
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))
    return path


def sft_stage(data: Path, **fields) -> StageConfig:
    return msgspec.convert({"kind": "sft", "data": str(data), "steps": 1, "shuffle": False, **fields}, StageConfig)


def test_a_batch_gathers_examples_to_batch_tokens_names_them_and_skips_bad_rows(tmp_path, demo_model_dir):
    rows = chat_rows(12)
    rows[1] = {"messages": "not a list"}
    data = write_rows(tmp_path / "sft.jsonl", rows)
    chat = ChatModel.load(demo_model_dir)
    one = len(chat.encode(chat.render(rows[0]["messages"], add_generation_prompt=False)))
    source = SupervisedSource(sft_stage(data, batch_tokens=3 * one), "sft", chat, max_seq_len=512)
    batch = source.batch(0)
    assert batch.groups == ["sft/e0/i0", "sft/e0/i2", "sft/e0/i3"]  # row 1 (line 2) is bad
    assert batch.next_position == 4 and batch.tokens >= 3 * one - 3 and len(batch.bad_rows) == 1
    assert ":2:" in batch.bad_rows[0]
    assert all(sum(mask) < len(ids) for ids, mask in batch.sequences)  # only the answers train
    # An epoch's end bounds a batch: nothing is read at or past it.
    last = source.batch(10, end_position=12)
    assert last.groups == ["sft/e0/i10", "sft/e0/i11"] and last.next_position == 12
    source.close()


def test_midtrain_rows_are_text_trained_whole(tmp_path, demo_model_dir):
    data = write_rows(tmp_path / "text.jsonl", [{"prompt": "the cat sat on the mat " * 4}] * 3)
    chat = ChatModel.load(demo_model_dir)
    batch = SupervisedSource(sft_stage(data, kind="midtrain", batch_tokens=10_000), "mid", chat,
                             max_seq_len=16).batch(0, end_position=3)
    assert len(batch.sequences) == 3
    assert all(len(ids) == 16 and mask == [1] * 16 for ids, mask in batch.sequences)  # cut to the row


def trainer(run_dir: Path, model: Path, bus: RecordingPublisher) -> TrainerLogic:
    torch.set_num_threads(1)
    config = TrainerConfig(lr=1e-3)
    model_config = ModelConfig(path=str(model))
    return TrainerLogic(config, model_config, TorchTrainerBackend(model_config, config), bus, run_dir=run_dir,
                        clock=lambda: 500.0)


async def test_a_supervised_step_is_durable_with_its_place_and_a_restarted_trainer_reads_on(tmp_path, demo_model_dir):
    data = write_rows(tmp_path / "sft.jsonl", chat_rows(8))
    stage = sft_stage(data, batch_tokens=40, steps=3)
    bus = RecordingPublisher()
    logic = trainer(tmp_path, demo_model_dir, bus)
    await logic.start()
    first = await logic.supervised_step(stage, "sft", position=0, tokens_before=0)
    assert first["step"] == 1 and first["examples"] >= 1 and first["loss"] > 0
    assert bus.messages(WEIGHTS_PUBLISHED)[-1].version == first["weight_version"] == 1
    ledger = TrainingLedger(tmp_path / "trainer" / "ledger.jsonl")
    place = ledger.stage_cursor("sft")
    assert place == {"stage": "sft", "next_position": first["next_position"], "tokens": first["tokens"]}
    assert ledger.read().last.groups == [f"sft/e0/i{i}" for i in range(first["next_position"])]

    restarted = trainer(tmp_path, demo_model_dir, RecordingPublisher())
    await restarted.start()  # from the ledger: the step and the weights of the last durable step
    assert (restarted.step, restarted.version) == (1, 1)
    second = await restarted.supervised_step(stage, "sft", position=place["next_position"],
                                             tokens_before=place["tokens"])
    groups = ledger.read().last.groups
    assert second["step"] == 2 and groups[0] == f"sft/e0/i{first['next_position']}"
    assert ledger.stage_cursor("sft")["tokens"] == first["tokens"] + second["tokens"]


async def test_supervised_steps_save_full_checkpoints_every_checkpoint_every_and_keep_the_newest(tmp_path, demo_model_dir):
    data = write_rows(tmp_path / "sft.jsonl", chat_rows(8))
    torch.set_num_threads(1)
    config = TrainerConfig(lr=1e-3, checkpoint_every=1, keep_checkpoints=1)
    model_config = ModelConfig(path=str(demo_model_dir))
    logic = TrainerLogic(config, model_config, TorchTrainerBackend(model_config, config), RecordingPublisher(),
                         run_dir=tmp_path, clock=lambda: 500.0)
    await logic.start()
    position = 0
    for _ in range(2):
        position = (await logic.supervised_step(sft_stage(data, batch_tokens=40), "sft", position=position,
                                                tokens_before=0))["next_position"]
    kept = sorted(path.name for path in (tmp_path / "checkpoints").iterdir() if path.name.startswith(("iter_", "step_")))
    assert kept == ["iter_0000002", "step_00000002.trainer_state.pt"]
