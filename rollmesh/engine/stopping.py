"""When a generated sequence is done: EOS, a stop string, or its token budget.

Knows the Detokenizer seam only. Stop strings are searched in the decoded text of the *generated*
tokens, and only in its tail: a string that newly appeared must end in the newest token, so a tail
of as many tokens as the longest stop string has UTF-8 bytes contains it (every token carries at
least one byte; a special token that decodes to nothing inside a stop string breaks the match).
This keeps the per-step cost independent of how long the sequence has grown.
"""

from __future__ import annotations

from rollmesh.engine.errors import InvalidRequestError
from rollmesh.engine.protocols import Detokenizer, FinishReason


class StopChecker:
    """Decides, after each appended token, whether one sequence has finished and why."""

    __slots__ = ("_stop", "_window", "_eos_id", "_max_new_tokens", "_detokenizer")

    def __init__(
        self,
        *,
        stop: list[str],
        max_new_tokens: int,
        detokenizer: Detokenizer,
        request_id: str | None = None,
    ) -> None:
        if any(not s for s in stop):
            raise InvalidRequestError(
                "empty stop string", field="sampling.stop", request_id=request_id
            )
        self._stop = tuple(stop)
        self._window = max((len(s.encode("utf-8")) for s in stop), default=0)
        self._eos_id = detokenizer.eos_id
        self._max_new_tokens = max_new_tokens
        self._detokenizer = detokenizer

    @property
    def max_new_tokens(self) -> int:
        return self._max_new_tokens

    def check(self, token_ids: list[int]) -> FinishReason | None:
        """The finish reason after ``token_ids[-1]`` was appended, or None to keep going."""
        if token_ids[-1] == self._eos_id:
            return "eos"
        if self._stop:
            tail = self._detokenizer.decode(token_ids[-self._window:])
            if any(s in tail for s in self._stop):
                return "stop"
        if len(token_ids) >= self._max_new_tokens:
            return "length"
        return None
