"""Guided decoding: a request's grammar (``GrammarSpec``) compiled with xgrammar, one matcher per
constrained sequence, and its token mask applied to that row's logits before sampling.

Knows xgrammar, torch and the model's Hugging Face tokenizer (read off the engine's Detokenizer);
not the chat formats (``rollmesh.serve_apps.tool_choice`` writes the grammars), not Ray.

- Importing xgrammar costs a process over a second, so it happens at the first grammar, not at
  import: workers and Serve replicas that never see one never load it.
- Compiling: one ``xgr.GrammarCompiler`` per engine, with xgrammar's own cache (keyed by the
  grammar's text), so a tool schema seen before costs a dictionary look-up. Nothing is built
  until the first grammar arrives: an engine that never sees one pays nothing at all.
- Vocabulary: the matcher's vocabulary is the tokenizer's (the engine's ``sampled_vocab_size``),
  so padded embedding rows are outside the mask and stay dropped by ``sample_tokens``.
- The end: the matcher's stop tokens are the engine's end-of-turn ids (or the grammar's
  ``end_ids``, a subset of them). Once the grammar is
  complete only those are allowed, so the model samples its own end-of-turn id under the mask
  (logprob 0 when it is the only one left) and the stop checker ends the turn ("eos") exactly as
  in a free turn: the generated ids are what the chat template would render, nothing is appended
  behind the model's back.
- What counts as constrained: a token drawn from a row whose mask removed at least one token
  (xgrammar says when a mask is all-true). Its logprob is the masked distribution's, because the
  mask is applied to the logits that ``sample_tokens`` normalises.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from collections.abc import Iterable, Sequence
from typing import Any

from typing import TYPE_CHECKING

import torch

from rollmesh.engine.errors import InvalidGrammarError, InvalidRequestError
from rollmesh.engine.protocols import GrammarSpec

if TYPE_CHECKING:
    import xgrammar as xgr


class GuidedDecoder:
    """Compiles grammars for one tokenizer and masks a batch's constrained rows."""

    def __init__(self, tokenizer: Any, *, vocab_size: int, end_of_turn_ids: Iterable[int]) -> None:
        # ``tokenizer``: the engine's Detokenizer (a ModelDirectory or ChatModel) or None.
        self._hf_tokenizer = _hf_tokenizer(tokenizer)
        self._vocab_size = vocab_size
        self._stop_ids = sorted(end_of_turn_ids)
        self._compiler: xgr.GrammarCompiler | None = None

    def compile(self, grammar: GrammarSpec, *, request_id: str | None = None) -> xgr.CompiledGrammar:
        """The compiled grammar (cached); raises InvalidGrammarError for one xgrammar refuses."""
        compiler = self._compiler_or_refuse(request_id)
        try:
            if not set(grammar.end_ids) <= set(self._stop_ids):
                raise ValueError(f"end_ids {sorted(grammar.end_ids)} are not all end-of-turn ids "
                                 f"of the model ({self._stop_ids})")
            if grammar.kind == "json_schema":
                json.loads(grammar.text)  # xgrammar's own message for bad JSON is a C++ trace
                return compiler.compile_json_schema(grammar.text, any_whitespace=False)
            if grammar.kind == "ebnf":
                return compiler.compile_grammar(grammar.text)
            if grammar.kind == "structural_tag":
                return compiler.compile_structural_tag(grammar.text)
        except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError, ValueError, its own
            raise InvalidGrammarError(grammar.kind, _first_line(exc), request_id=request_id) from exc
        raise InvalidGrammarError(grammar.kind, "unknown grammar kind", request_id=request_id)

    def matcher(self, grammar: GrammarSpec, *, request_id: str | None = None) -> Constraint:
        compiled = self.compile(grammar, request_id=request_id)
        xgr = _xgrammar()
        # Not xgrammar's override_stop_tokens: it would turn the other end ids into plain tokens,
        # allowed inside JSON strings. They stay stop tokens (allowed only at the end) and are
        # banned outright instead.
        banned = sorted(set(self._stop_ids) - set(grammar.end_ids)) if grammar.end_ids else []
        return Constraint(xgr.GrammarMatcher(compiled), banned)

    def mask(self, logits: torch.Tensor, constraints: Sequence[Constraint | None]) -> list[bool]:
        """Apply each row's grammar mask to ``logits`` [B, V] in place (disallowed ids -> -inf);
        returns per row whether its mask removed any token. Rows without one are untouched."""
        xgr = _xgrammar()
        bitmask = xgr.allocate_token_bitmask(len(constraints), self._vocab_size)
        rows = [row for row, constraint in enumerate(constraints)
                if constraint is not None and constraint.matcher.fill_next_token_bitmask(bitmask, row)]
        if rows:
            xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device),
                                            vocab_size=self._vocab_size, indices=rows)
        constrained = set(rows)
        for row, constraint in enumerate(constraints):
            if constraint is not None and constraint.banned:
                logits[row, constraint.banned] = float("-inf")
                constrained.add(row)
        return [row in constrained for row in range(len(constraints))]

    def _compiler_or_refuse(self, request_id: str | None) -> xgr.GrammarCompiler:
        if self._compiler is None:
            if self._hf_tokenizer is None:
                raise InvalidRequestError(
                    "guided decoding needs the model's tokenizer, and this engine was given none",
                    field="grammar", request_id=request_id)
            xgr = _xgrammar()
            info = xgr.TokenizerInfo.from_huggingface(
                self._hf_tokenizer, vocab_size=self._vocab_size, stop_token_ids=self._stop_ids)
            self._compiler = xgr.GrammarCompiler(info, cache_enabled=True)
        return self._compiler


@dataclass(slots=True)
class Constraint:
    """One sequence's grammar: its matcher, and the end-of-turn ids its grammar does not end on."""

    matcher: xgr.GrammarMatcher
    banned: list[int]


def accept(constraint: Constraint, token: int) -> bool:
    """Advance the grammar by the sampled ``token``; False if it refuses it (only possible for a
    token the mask did not govern, which the engine treats as a bug)."""
    matcher = constraint.matcher
    return matcher.is_terminated() or bool(matcher.accept_token(token))


def _xgrammar():
    import xgrammar

    return xgrammar


def _hf_tokenizer(tokenizer: Any) -> Any:
    """The Hugging Face tokenizer behind a ModelDirectory (``.tokenizer``) or a ChatModel
    (``.directory.tokenizer``); None for an engine without one."""
    if tokenizer is None:
        return None
    inner = getattr(tokenizer, "tokenizer", None)
    if inner is None and getattr(tokenizer, "directory", None) is not None:
        inner = tokenizer.directory.tokenizer
    return inner


def _first_line(exc: BaseException) -> str:
    """xgrammar's message without the C++ log prefix ("[21:45:03] /project/cpp/x.cc:5088: ")."""
    text = str(exc).strip() or type(exc).__name__
    return _CPP_PREFIX.sub("", text.splitlines()[0])[:500]


_CPP_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")
