"""Guided decoding in the decode engine: a grammar's mask on its row only, logprobs of the masked
distribution, a constrained turn that parses and ends with the model's own end-of-turn id, flags
per token, invalid grammars refused before anything runs, padded ids still never sampled."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import torch

from support.engine_models import EngineModels, model_tokenizer, prefer_tokens
from rollmesh.engine.decode import DecodeEngine
from rollmesh.engine.errors import InvalidGrammarError, InvalidRequestError
from rollmesh.engine.guided_decoding import GuidedDecoder
from rollmesh.engine.models import load_hf_model
from rollmesh.engine.protocols import GenerateOptions, GenerationResult, GrammarSpec
from rollmesh.engine.sampling import sample_tokens
from rollmesh.messages.base import SamplingParams

pytestmark = pytest.mark.unit

# Finite: even a babbling model reaches the grammar's end within the budget.
SCHEMA = {"type": "object", "properties": {"unit": {"enum": ["g", "kg"]}, "ok": {"type": "boolean"}},
          "required": ["unit", "ok"]}
GRAMMAR = GrammarSpec("json_schema", json.dumps(SCHEMA))


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def demo(demo_model_dir: Path) -> EngineModels:
    return EngineModels(demo_model_dir)


def run_to_completion(engine: DecodeEngine) -> dict[str, GenerationResult]:
    done: dict[str, GenerationResult] = {}
    while engine.has_work():
        done.update((s.request_id, s) for s in engine.step())
    return done


def test_a_constrained_rows_logprob_is_the_log_softmax_over_its_allowed_tokens(demo) -> None:
    tokenizer = demo.tokenizer
    guided = GuidedDecoder(tokenizer, vocab_size=tokenizer.vocab_size,
                           end_of_turn_ids=tokenizer.end_of_turn_ids)
    logits = torch.randn(2, tokenizer.vocab_size, generator=torch.Generator().manual_seed(1))
    before = logits.clone()
    matcher = guided.matcher(GRAMMAR)
    assert guided.mask(logits, [matcher, None]) == [True, False]
    assert torch.equal(logits[1], before[1])  # the free row is untouched
    allowed = torch.isfinite(logits[0])
    assert 0 < int(allowed.sum()) < tokenizer.vocab_size
    assert tokenizer.decode([int(allowed.nonzero()[0])]).startswith("{")
    for temperature in (0.0, 1.0):
        chosen, logprobs, *_ = sample_tokens(logits, torch.tensor([temperature] * 2),
                                             torch.tensor([1.0, 1.0]), torch.Generator().manual_seed(0))
        token = int(chosen[0])
        assert allowed[token]
        expected = torch.log_softmax(before[0][allowed], dim=-1)[int(allowed[:token].sum())]
        assert float(logprobs[0]) == pytest.approx(float(expected), abs=1e-5)


def test_a_constrained_generation_parses_and_leaves_the_batchs_free_rows_alone(demo) -> None:
    model = demo.model()
    tokenizer = demo.tokenizer
    ids = tokenizer.encode("<|im_start|>user\nweigh it<|im_end|>\n<|im_start|>assistant\n")
    free = SamplingParams(temperature=0.0, max_new_tokens=12)
    alone = demo.engine(model, max_batch=1)
    alone.add_prompt("free", ids, free)
    expected = run_to_completion(alone)["free"]

    engine = demo.engine(model, max_batch=2)
    engine.add_prompt("guided", ids, SamplingParams(temperature=1.0, max_new_tokens=64),
                      GenerateOptions(grammar=GRAMMAR))
    engine.add_prompt("free", ids, free)
    done = run_to_completion(engine)
    guided = done["guided"]
    assert guided.finish_reason == "eos" and guided.token_ids[-1] in tokenizer.end_of_turn_ids
    jsonschema.validate(json.loads(tokenizer.decode(guided.token_ids[:-1])), SCHEMA)
    assert len(guided.constrained) == len(guided.token_ids) and all(guided.constrained)
    assert all(lp <= 0 for lp in guided.logprobs)
    assert done["free"].token_ids == expected.token_ids and done["free"].constrained == []
    assert done["free"].logprobs == pytest.approx(expected.logprobs, abs=1e-5)
    assert engine.sampler.constrained_active == 0  # no step masks anything after the grammar's turn


def test_an_invalid_grammar_is_refused_before_admission_and_the_engine_keeps_serving(demo) -> None:
    engine = demo.engine(demo.model(), max_batch=1)
    ids = demo.tokenizer.encode("hello")
    sampling = SamplingParams(temperature=0.0, max_new_tokens=3)
    for bad in (GrammarSpec("json_schema", '{"type": "object", "properties": '),
                GrammarSpec("json_schema", '{"type": "strng"}'),
                GrammarSpec("ebnf", "root ::= missing_rule"),
                GrammarSpec("json_schema", json.dumps(SCHEMA), end_ids=(5,))):  # 5 ends no turn
        with pytest.raises(InvalidGrammarError) as caught:
            engine.add_prompt("bad", ids, sampling, GenerateOptions(grammar=bad))
        assert caught.value.field == "grammar" and caught.value.kind == bad.kind
    engine.add_prompt("good", ids, sampling)
    assert run_to_completion(engine)["good"].token_ids


def test_an_engine_without_a_tokenizer_refuses_a_grammar(demo) -> None:
    engine = DecodeEngine(demo.model(), max_batch=1)
    with pytest.raises(InvalidRequestError, match="tokenizer") as caught:
        engine.add_prompt("r", [1, 2, 3], SamplingParams(max_new_tokens=2),
                          GenerateOptions(grammar=GRAMMAR))
    assert caught.value.field == "grammar"


def test_padded_ids_stay_masked_under_a_grammar(chat_model_dir_with_weights: Path) -> None:
    tokenizer = model_tokenizer(chat_model_dir_with_weights)
    model = load_hf_model(chat_model_dir_with_weights)
    assert model.vocab_size > tokenizer.vocab_size
    prefer_tokens(model, slice(tokenizer.vocab_size, None))  # would rather say a padded id
    engine = DecodeEngine(model, max_batch=1, tokenizer=tokenizer)
    engine.add_prompt("r", tokenizer.encode("Hello"), SamplingParams(temperature=1.0, max_new_tokens=40),
                      GenerateOptions(grammar=GRAMMAR))
    done = run_to_completion(engine)["r"]
    assert done.token_ids and all(t < tokenizer.vocab_size for t in done.token_ids)


def test_xgrammar_is_loaded_only_when_a_grammar_arrives() -> None:
    """Importing it costs a process over a second: engines and the chat route without a grammar
    never pay it."""
    code = ("import sys, rollmesh.engine, rollmesh.serve_apps.chat_requests; "
            "assert 'xgrammar' not in sys.modules, 'imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
