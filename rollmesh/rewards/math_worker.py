"""The child side of the ``math`` reward's worker processes: checks answers with math-verify.

Run as ``python -m rollmesh.rewards.math_worker CHECK`` by ``math_answer.MathChecker``; it imports
math-verify and nothing of rollmesh beyond this module. Protocol: one JSON line ``[gold,
answer]`` in on stdin, one JSON line out, ``["ok", bool]`` or ``["error", repr]``; ``["ready",
null]`` first, once warm. math-verify's own timeouts are ``signal.alarm`` based and work only in
a main thread; here every check runs in this process's main thread with them off
(``parsing_timeout=None``, ``timeout_seconds=None``): the parent's per-check timeout kills the
whole process instead, which also stops a check stuck in C code that no signal would interrupt.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import sys
from collections.abc import Callable

CHECK_ANSWER = "rollmesh.rewards.math_worker:check_answer"


def check_answer(gold: str, answer: str) -> bool:
    """Whether ``answer`` (the model's final text) states the same mathematical object as ``gold``.
    A bare gold (``1/2``, ``x^2``) that math-verify finds nothing in is read as LaTeX math."""
    from math_verify import parse, verify

    gold_parsed = parse(gold, parsing_timeout=None)  # type: ignore[arg-type]
    if not gold_parsed:
        gold_parsed = parse(f"${gold}$", parsing_timeout=None)  # type: ignore[arg-type]
    answer_parsed = parse(answer, parsing_timeout=None)  # type: ignore[arg-type]
    if not gold_parsed or not answer_parsed:
        return False
    return bool(verify(gold_parsed, answer_parsed, timeout_seconds=None))


def _resolve(path: str) -> Callable[[str, str], bool]:
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def serve(check_path: str) -> None:
    """Answer checks until stdin closes. The first check (sympy, math-verify's grammars) runs
    before "ready": loading must not count against a check's timeout."""
    # The protocol owns the real stdout; anything a library prints goes to stderr instead.
    replies = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)
    # It warns on every call that its own timeouts are off: they are, on purpose (see above).
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    check = _resolve(check_path)
    check("1", "1")
    replies.write(json.dumps(["ready", None]) + "\n")
    replies.flush()
    for line in sys.stdin:
        gold, answer = json.loads(line)
        try:
            reply = ["ok", bool(check(gold, answer))]
        except Exception as exc:  # math-verify's own failure on this text: reported, the worker lives on
            reply = ["error", repr(exc)]
        replies.write(json.dumps(reply) + "\n")
        replies.flush()


if __name__ == "__main__":
    serve(sys.argv[1])
