"""When a generated sequence is done: an end-of-turn id, a stop string, or its token budget.

Knows the Detokenizer seam only. Any of the model's end-of-turn ids ends a generation with finish
reason "eos" (a model may have several). Stop strings are searched in the tokenizer's decoding of
the *generated* tokens, special tokens kept, and only in its tail: a string that newly appeared
must end in the newest token, and every token carries at least one byte of text, so a tail of as
many tokens as the longest stop string has UTF-8 bytes contains it. One token more is decoded in
front, because some decoders drop the leading space of the first token they are given (a special
token that decodes to nothing inside a stop string still breaks the match). This keeps the
per-step cost independent of how long the sequence has grown.
"""

from __future__ import annotations

from collections.abc import Iterable

from rollmesh.engine.errors import InvalidRequestError
from rollmesh.engine.protocols import Detokenizer, FinishReason


class StopChecker:
    """Decides, after each appended token, whether one sequence has finished and why.

    ``detokenizer`` None (an engine that was given no tokenizer) can stop at end-of-turn ids and
    budgets only: a request with stop strings is refused.
    """

    __slots__ = ("_stop", "_window", "_end_ids", "_max_new_tokens", "_detokenizer")

    def __init__(
        self,
        *,
        stop: list[str],
        max_new_tokens: int,
        end_of_turn_ids: Iterable[int],
        detokenizer: Detokenizer | None,
        request_id: str | None = None,
    ) -> None:
        if any(not s for s in stop):
            raise InvalidRequestError(
                "empty stop string", field="sampling.stop", request_id=request_id
            )
        if stop and detokenizer is None:
            raise InvalidRequestError(
                "stop strings need the model's tokenizer, and this engine was given none",
                field="sampling.stop", request_id=request_id,
            )
        self._stop = tuple(stop)
        self._window = max((len(s.encode("utf-8")) + 1 for s in stop), default=0)
        self._end_ids = frozenset(end_of_turn_ids)
        self._max_new_tokens = max_new_tokens
        self._detokenizer = detokenizer

    @property
    def max_new_tokens(self) -> int:
        return self._max_new_tokens

    def check(self, token_ids: list[int]) -> FinishReason | None:
        """The finish reason after ``token_ids[-1]`` was appended, or None to keep going."""
        if token_ids[-1] in self._end_ids:
            return "eos"
        if self._stop:
            tail = self._detokenizer.decode(token_ids[-self._window:])
            if any(s in tail for s in self._stop):
                return "stop"
        if len(token_ids) >= self._max_new_tokens:
            return "length"
        return None
