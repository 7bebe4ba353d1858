"""Sequence packing (``rollmesh.training.packing``) and packed SFT steps on the torch backend:
first-fit decreasing, reset positions, the block-diagonal mask, the boundary target, and the
proof that matters: one packed row of 3 examples has the loss and gradients of the 3 examples run
separately (right-padded, plain causal), while a row without the resets does not. RoPE is
relative, so under the block mask positions not reset would change only rounding: the attention
reset is what these losses prove.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rollmesh.training.packing import (
    PackedRow,
    PackingError,
    SequenceTooLongError,
    block_causal_mask,
    collate_rows,
    pack_sequences,
    position_ids,
)

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]

TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=300,
            intermediate_size=128, eos_token_id=2, max_position_embeddings=256, tie_word_embeddings=True,
            rope_theta=10000.0)


def examples(lengths=(9, 14, 6), seed: int = 0) -> list[tuple[list[int], list[int]]]:
    """(ids, loss mask) pairs: a 3-token prompt masked out, the rest trained."""
    rng = np.random.default_rng(seed)
    return [(rng.integers(3, TINY["vocab_size"], n).tolist(), [0] * 3 + [1] * (n - 3)) for n in lengths]


def test_pack_sequences_is_first_fit_decreasing_and_keeps_every_token():
    sequences = [([i] * n, [1] * n) for i, n in enumerate([3, 7, 5, 2, 6, 4])]
    rows = pack_sequences(sequences, max_seq_len=10)
    # Longest first into the first row with room: 7 -> r0; 6 -> r1; 5 -> r2; 4 -> r1; 3 -> r0; 2 -> r2.
    assert [row.segment_lengths for row in rows] == [(7, 3), (6, 4), (5, 2)]
    assert rows[0].ids == (1,) * 7 + (0,) * 3
    assert sorted(t for row in rows for t in row.ids) == sorted(t for ids, _ in sequences for t in ids)
    assert pack_sequences(sequences, max_seq_len=10) == rows  # deterministic


def test_pack_sequences_refuses_an_example_longer_than_a_row_with_its_index():
    with pytest.raises(SequenceTooLongError) as caught:
        pack_sequences([([1] * 4, [1] * 4), ([1] * 11, [1] * 11)], max_seq_len=10)
    assert (caught.value.index, caught.value.length, caught.value.max_seq_len) == (1, 11, 10)
    with pytest.raises(PackingError) as mismatched:
        pack_sequences([([1, 2], [1])], max_seq_len=10)
    assert mismatched.value.index == 0


def test_a_row_checks_its_segments():
    with pytest.raises(ValueError, match="segment_lengths"):
        PackedRow((1, 2, 3), (1, 1, 1), (2, 2))


def test_positions_reset_and_attention_stays_inside_each_example():
    row = PackedRow((5, 6, 7, 8, 9), (1,) * 5, (3, 2))
    assert position_ids(row) == [0, 1, 2, 0, 1]
    batch = collate_rows([row, PackedRow.single([4, 4, 4], [1, 1, 1])], pad_id=0)
    assert batch.positions[0].tolist() == [0, 1, 2, 0]
    allowed = batch.attention[0, 0]
    assert allowed[3].tolist() == [False, False, False, True]  # the 2nd example's first token sees only itself
    assert allowed[2].tolist() == [True, True, True, False]
    # Padding attends padding (no all-False row: a fully masked softmax row is NaN).
    assert block_causal_mask(batch.segments).any(-1).all()
    assert batch.tokens == 8 and batch.inputs.shape == (2, 4)


def test_collate_never_trains_a_segments_first_token_whatever_the_mask_says():
    row = PackedRow((5, 6, 7, 8, 9), (1,) * 5, (3, 2))
    batch = collate_rows([row], pad_id=0)
    # Targets 6, 7, 8, 9: 8 starts the 2nd example, predicted from the 1st's last token: not trained.
    assert batch.mask[0].tolist() == [1.0, 1.0, 0.0, 1.0]
    assert batch.trained_tokens == 3


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    pytest.importorskip("transformers", reason="transformers builds the reference HF checkpoint")
    from support.hf_llamas import save_random_llama

    return save_random_llama(TINY, tmp_path_factory.mktemp("packing") / "llama")


def _loss_and_grads(llama_dir, rows):
    from rollmesh.config import ModelConfig, TrainerConfig
    from rollmesh.training.torch_backend import TorchTrainerBackend

    backend = TorchTrainerBackend(ModelConfig(path=str(llama_dir)), TrainerConfig(lr=1e-3, seed=0))
    loss, batch = backend.sft_loss(rows)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in backend.model.named_parameters()}
    return float(loss.detach()), batch.trained_tokens, grads


def test_a_packed_row_has_the_loss_and_gradients_of_its_examples_run_separately(llama_dir):
    sequences = examples()
    separate_loss, separate_count, separate = _loss_and_grads(llama_dir, [PackedRow.single(*s) for s in sequences])
    packed_rows = pack_sequences(sequences, max_seq_len=64)
    assert len(packed_rows) == 1 and len(packed_rows[0].segment_lengths) == 3
    packed_loss, packed_count, packed = _loss_and_grads(llama_dir, packed_rows)
    assert packed_count == separate_count
    assert packed_loss == pytest.approx(separate_loss, rel=1e-5)
    for name in separate:
        torch.testing.assert_close(packed[name], separate[name], rtol=1e-4, atol=1e-6, msg=name)
    # The same tokens as one example (no position reset, attention across the boundaries, and
    # the boundary targets trained): another loss.
    row = packed_rows[0]
    unreset_loss, _, unreset = _loss_and_grads(llama_dir, [PackedRow.single(row.ids, row.loss_mask)])
    assert abs(unreset_loss - separate_loss) > 1e-3
    # Boundary targets masked as packing does, but attention and positions not reset: still another.
    leaky = PackedRow(row.ids, row.loss_mask, (len(row.ids),))
    boundary_masked = list(row.loss_mask)
    start = 0
    for length in row.segment_lengths:
        boundary_masked[start] = 0
        start += length
    leaky_loss, leaky_count, _ = _loss_and_grads(llama_dir, [PackedRow(leaky.ids, tuple(boundary_masked),
                                                                       leaky.segment_lengths)])
    assert leaky_count == separate_count and abs(leaky_loss - separate_loss) > 1e-3


def test_torch_backend_packed_sft_step_reports_real_and_trained_tokens(llama_dir):
    from rollmesh.config import ModelConfig, TrainerConfig
    from rollmesh.training.torch_backend import TorchTrainerBackend

    backend = TorchTrainerBackend(ModelConfig(path=str(llama_dir)), TrainerConfig(lr=1e-3, seed=0))
    rows = pack_sequences(examples((9, 14, 6, 20)), max_seq_len=24)
    stats = backend.sft_step(rows, lr=1e-2)
    assert stats["tokens"] == 9 + 14 + 6 + 20
    assert stats["trained_tokens"] == (9 - 3) + (14 - 3) + (6 - 3) + (20 - 3)
    assert stats["rows"] == len(rows) == 3 and stats["loss"] > 0
    # The old pairs still train and give the loss alone (the demo's warm start).
    assert isinstance(backend.sft_step(examples(), lr=1e-2), float)
