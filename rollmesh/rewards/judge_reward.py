"""The ``judge`` reward: an LLM judge, through any OpenAI-compatible chat-completions endpoint
(rollmesh's own Serve app included), scores the final answer.

Knows httpx (through ``http_reward``'s POST with retries), the OpenAI chat-completions shape and
the reward types; nothing of Ray, NATS or the agent loop. The prompt is a template (``prompt``,
or a file ``prompt_file``) in which ``{question}`` (the last user message the model was given),
``{answer}`` (the row's reference answer) and ``{response}`` (the final answer) are replaced;
nothing else in it is touched, so a template may hold braces of its own (a JSON example). The
judge's reply is searched with ``score_regex``: the first group of its last match is a number, or
a word that ``labels`` maps to a number (``{yes = 1.0, no = 0.0}``); the number is divided by
``max_score``. A judge that does not answer, or whose answer holds no score in range, is a
``RewardUnavailableError``: the judge failed, not the model, so it is never a zero.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import httpx

from rollmesh.rewards.errors import RewardInputError, RewardUnavailableError
from rollmesh.rewards.http_reward import check_client_args, post_json, request_headers
from rollmesh.rewards.reward_input import RewardInput

DEFAULT_SCORE_REGEX = r"(?i)score\s*[:=]\s*([0-9]+(?:\.[0-9]+)?)"
PLACEHOLDERS = ("{question}", "{answer}", "{response}")
ARG_TYPES: dict[str, tuple[type, ...]] = {
    "url": (str,), "model": (str,), "prompt": (str,), "prompt_file": (str,), "score_regex": (str,),
    "labels": (dict,), "max_score": (int, float), "temperature": (int, float), "max_tokens": (int,),
    "timeout_s": (int, float), "retries": (int,), "backoff_s": (int, float), "headers": (dict,),
    "api_key_env": (str,),
}


def check_args(args: dict[str, Any]) -> str:
    """What is wrong with ``judge``'s ``args`` beyond their types ("" when nothing is)."""
    if not args.get("url", "").startswith(("http://", "https://")):
        return f"argument 'url' must be an http:// or https:// URL, not {args.get('url', '')!r}"
    if not args.get("model"):
        return "argument 'model' is required (the model name the endpoint serves)"
    if ("prompt" in args) == ("prompt_file" in args):
        return "give exactly one of 'prompt' (a template) or 'prompt_file' (a file holding one)"
    if "prompt_file" in args and not Path(args["prompt_file"]).is_file():
        return f"argument 'prompt_file': no file {args['prompt_file']!r}"
    try:
        pattern = re.compile(args.get("score_regex", DEFAULT_SCORE_REGEX))
    except re.error as exc:
        return f"argument 'score_regex' is not a regular expression: {exc}"
    if pattern.groups < 1:
        return "argument 'score_regex' needs a group around the score"
    labels = args.get("labels", {})
    if not all(isinstance(value, (int, float)) and not isinstance(value, bool) for value in labels.values()):
        return "argument 'labels' must map words to numbers"
    if args.get("max_score", 1.0) <= 0:
        return f"argument 'max_score' must be above 0, not {args['max_score']!r}"
    return check_client_args(args)


def chat_completions_url(url: str) -> str:
    """The endpoint of a base URL: ``.../v1`` (as OpenAI clients take it) or the server's root."""
    url = url.rstrip("/")
    if url.endswith("/chat/completions"):
        return url
    return f"{url}/chat/completions" if url.endswith("/v1") else f"{url}/v1/chat/completions"


def question_of(sample: RewardInput) -> str:
    """The last user message before the model's first turn (what it was asked)."""
    question = ""
    for message in sample.messages:
        if message.get("role") == "assistant":
            break
        if message.get("role") == "user" and isinstance(message.get("content"), str):
            question = message["content"]
    return question or str(sample.row.get("prompt", ""))


def fill_prompt(template: str, sample: RewardInput) -> str:
    if "{answer}" in template and sample.answer is None:
        raise RewardInputError("judge", "the prompt shows {answer}, but the row has no answer")
    values = {"{question}": question_of(sample), "{answer}": sample.answer or "", "{response}": sample.final_text}
    # One pass, so a placeholder inside the response is not replaced in turn.
    return re.sub("|".join(re.escape(p) for p in PLACEHOLDERS), lambda match: values[match.group(0)], template)


def read_score(text: str, *, score_regex: str, labels: dict[str, float], max_score: float) -> float:
    """The judge's score in [0, 1]; ``RewardUnavailableError`` when ``text`` holds none."""
    # The last match: a judge that reasons first may quote scores before it gives its own.
    match = None
    for match in re.finditer(score_regex, text):
        pass
    if match is None:
        raise RewardUnavailableError("judge", f"no score in the judge's answer ({score_regex!r}): {text[:200]!r}")
    found = match.group(1)
    if labels:
        folded = {word.casefold(): value for word, value in labels.items()}
        if found.casefold() not in folded:
            raise RewardUnavailableError("judge", f"the judge answered {found!r}, not one of {sorted(labels)}")
        score = float(folded[found.casefold()])
    else:
        try:
            score = float(found)
        except ValueError as exc:
            raise RewardUnavailableError("judge", f"the judge's score {found!r} is not a number") from exc
    if not 0.0 <= score <= max_score:
        raise RewardUnavailableError("judge", f"the judge's score {score} is outside 0..{max_score}")
    return score / max_score


def judge_reward(sample: RewardInput, *, url: str, model: str, prompt: str = "", prompt_file: str = "",
                 score_regex: str = DEFAULT_SCORE_REGEX, labels: dict[str, float] | None = None,
                 max_score: float = 1.0, temperature: float = 0.0, max_tokens: int = 512,
                 timeout_s: float = 30.0, retries: int = 3, backoff_s: float = 0.5,
                 headers: dict[str, str] | None = None, api_key_env: str = "") -> float:
    """The judge's score of ``sample``'s final answer, scaled into [0, 1] by ``max_score``."""
    try:
        # Read on the rollout worker, where the reward runs: the run file's checks saw it on theirs.
        template = prompt or Path(prompt_file).read_text(encoding="utf-8")
    except OSError as exc:
        raise RewardUnavailableError("judge", f"prompt_file {prompt_file!r} cannot be read here: {exc}") from exc
    content = fill_prompt(template, sample)
    sent, secret = request_headers("judge", headers or {}, api_key_env)
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": content}],
                       "temperature": temperature, "max_tokens": max_tokens}).encode()
    with httpx.Client(timeout=timeout_s) as client:
        answer = post_json("judge", client, chat_completions_url(url), body, headers=sent, secret=secret,
                           retries=retries, backoff_s=backoff_s)
    # The OpenAI chat completion object: {"choices": [{"message": {"role", "content"}, ...}], ...}.
    try:
        text = answer["choices"][0]["message"]["content"]
    except (KeyError, IndexError, TypeError):
        text = None
    if not isinstance(text, str):
        raise RewardUnavailableError("judge", f"malformed answer: no choices[0].message.content in "
                                              f"{json.dumps(answer)[:200]}")
    return read_score(text, score_regex=score_regex, labels=labels or {}, max_score=float(max_score))
