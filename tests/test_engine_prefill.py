"""Prefill results and the typed errors bad requests get (prefill and decode admission), on the
demo model directory."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch

from support.engine_models import EngineModels
from rollmesh.engine.decode import DecodeEngine
from rollmesh.engine.errors import (
    CapacityError,
    DuplicateRequestError,
    InvalidRequestError,
    PromptTooLongError,
)
from rollmesh.engine.prefill import PrefillEngine, PrefillResult
from rollmesh.messages.base import SamplingParams

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """Tiny tensors on a shared 2-core machine: a second torch thread only spins."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def demo(demo_model_dir: Path) -> EngineModels:
    return EngineModels(demo_model_dir)


def test_prefill_returns_kv_pages_and_logits_that_pickle_small(demo) -> None:
    model = demo.model()
    layout = model.kv_layout()
    result = PrefillEngine(model, version=3, block_size=4).prefill([1, 2, 3, 4, 5, 6])
    # [layers, K/V, blocks, block_size, kv heads, head_dim]: six tokens fill two 4-token blocks.
    assert result.pages.shape == (layout.num_layers, 2, 2, 4, layout.num_kv_heads, layout.head_dim)
    assert result.pages.is_contiguous() and result.pages.dtype == torch.float32
    assert result.num_tokens == 6 and result.weight_version == 3 and result.block_size == 4
    full = model(torch.tensor([[1, 2, 3, 4, 5, 6]]))[0, -1]
    torch.testing.assert_close(result.last_logits, full, atol=1e-5, rtol=0)
    # last_logits must not drag every position's logits into the object store.
    assert len(pickle.dumps(result)) < result.pages.numel() * 4 + 2 * model.vocab_size * 4 + 4096


def test_prefill_applies_staged_weights_at_the_next_call(demo) -> None:
    engine = PrefillEngine(demo.model(seed=0))
    before = engine.prefill([5, 6, 7])
    assert engine.stage_weights(demo.model(seed=1).state_dict(), 1)
    assert engine.current_version == 0
    after = engine.prefill([5, 6, 7])
    assert after.weight_version == 1 and engine.pop_activation() == 1
    assert not torch.allclose(before.last_logits, after.last_logits)


# Stand-ins for the demo model's sizes, filled in by the test: a prompt that fills the whole
# context (nothing fits), and the first id past the vocabulary.
FILLS_CONTEXT, PAST_VOCAB = "fills-context", "past-vocab"


@pytest.mark.parametrize(
    ("input_ids", "error", "field"),
    [
        ([], InvalidRequestError, "input_ids"),
        (FILLS_CONTEXT, PromptTooLongError, "input_ids"),
        (PAST_VOCAB, InvalidRequestError, "input_ids"),
        ([1, -1], InvalidRequestError, "input_ids"),
        ([1.0, 2.0], InvalidRequestError, "input_ids"),
        ([[1, 2]], InvalidRequestError, "input_ids"),
        ([1, "a"], InvalidRequestError, "input_ids"),
        ([True, False], InvalidRequestError, "input_ids"),
    ],
)
def test_prefill_rejects_bad_prompts_with_typed_errors(demo, input_ids, error, field) -> None:
    model = demo.model()
    if input_ids == FILLS_CONTEXT:
        input_ids = [5] * model.max_seq_len
    elif input_ids == PAST_VOCAB:
        input_ids = [1, model.vocab_size]
    with pytest.raises(error) as caught:
        PrefillEngine(model).prefill(input_ids, request_id="r1")
    assert caught.value.field == field and caught.value.request_id == "r1"


def test_prefill_accepts_the_longest_prompt_that_leaves_one_position(demo) -> None:
    model = demo.model()
    longest = model.max_seq_len - 1
    assert PrefillEngine(model).prefill([5] * longest).num_tokens == longest


def test_decode_admission_rejects_duplicates_full_batches_and_foreign_kv(demo) -> None:
    model = demo.model()
    prefill = PrefillEngine(model).prefill([1, 2, 3])
    engine = demo.engine(model, max_batch=1)
    sampling = SamplingParams(temperature=0.0, max_new_tokens=8)
    engine.add_prefilled("a", prefill, sampling)
    with pytest.raises(DuplicateRequestError):
        engine.add_prefilled("a", prefill, sampling)
    with pytest.raises(CapacityError) as caught:
        engine.add_prefilled("b", prefill, sampling)
    assert caught.value.max_batch == 1
    wrong = PrefillResult(prefill.input_ids, prefill.pages[:, :, :, :2], prefill.last_logits, 0)
    with pytest.raises(InvalidRequestError) as bad_kv:
        demo.engine(model, max_batch=1).add_prefilled("c", wrong, sampling)
    assert bad_kv.value.field == "prefill.pages"
    with pytest.raises(InvalidRequestError) as bad_stop:
        demo.engine(model, max_batch=1).add_prefilled("d", prefill, SamplingParams(stop=[""]))
    assert bad_stop.value.field == "sampling.stop"
    with pytest.raises(InvalidRequestError) as no_text:  # an engine given no tokenizer has no text
        DecodeEngine(model, max_batch=1).add_prefilled("e", prefill, SamplingParams(stop=["x"]))
    assert no_text.value.field == "sampling.stop"
    assert engine.num_active() == 1  # failed admissions changed nothing
