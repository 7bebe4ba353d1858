"""The ``http`` reward: a reward server scores the samples, which are POSTed to it in batches.

Knows httpx, threads and the reward types; nothing of Ray, NATS or the agent loop. Rollouts
finish one at a time, each scoring in a thread of its own, so calls are gathered: the first call
to a server opens a batch, and every call that arrives within ``batch_window_s`` of it (up to
``max_batch``) goes in the same POST::

    POST url  {"samples": [{"row", "messages", "final_text", "finish_reason", "answer"}, ...]}
    answer    {"rewards": [float | {name: float}, ...]}   (in the samples' order)

One flusher thread per server and settings in the process sends the batches, one POST at a
time; it ends as soon as nothing waits, so an idle process holds no thread. A server that does
not answer, answers 5xx or 429 is tried again ``retries`` times with exponential backoff; then
every caller of the batch gets a ``RewardUnavailableError`` (as for a 4xx or a malformed answer:
the server's or the config's fault, never the model's, so never a zero). The API key (from the
environment variable ``api_key_env``) goes in an ``Authorization: Bearer`` header and is never
logged nor put in an error.

Hand-rolled batching: httpx has none, and a general micro-batching library would be one more
dependency for some fifty lines.
"""

from __future__ import annotations

import json
import os
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import httpx

from rollmesh.rewards.errors import RewardUnavailableError
from rollmesh.rewards.reward_input import RewardInput, score_of

# Each argument ``http`` takes, with the types it accepts (checked at config load).
ARG_TYPES: dict[str, tuple[type, ...]] = {
    "url": (str,), "timeout_s": (int, float), "retries": (int,), "backoff_s": (int, float),
    "headers": (dict,), "api_key_env": (str,), "batch_window_s": (int, float), "max_batch": (int,),
}
# Retried: the server may come back. Any other non-2xx status is final.
RETRIED_STATUS = frozenset({429, 500, 502, 503, 504})


def check_args(args: dict[str, Any]) -> str:
    """What is wrong with ``http``'s ``args`` beyond their types ("" when nothing is)."""
    url = args.get("url", "")
    if not url.startswith(("http://", "https://")):
        return f"argument 'url' must be an http:// or https:// URL, not {url!r}"
    return check_client_args(args)


def check_client_args(args: dict[str, Any]) -> str:
    """The checks ``http`` and ``judge`` share (timeout, retries, headers)."""
    for key in ("timeout_s", "batch_window_s", "backoff_s"):
        if key in args and (args[key] < 0 or key == "timeout_s" and args[key] == 0):
            return f"argument {key!r} must be above 0, not {args[key]!r}"
    for key, least in (("retries", 0), ("max_batch", 1)):
        if key in args and args[key] < least:
            return f"argument {key!r} must be at least {least}, not {args[key]!r}"
    headers = args.get("headers", {})
    if not all(isinstance(key, str) and isinstance(value, str) for key, value in headers.items()):
        return "argument 'headers' must map header names to strings"
    return ""


def request_headers(reward: str, headers: dict[str, str], api_key_env: str) -> tuple[dict[str, str], str]:
    """The headers to send and the API key in them ("" when none), read from the environment now."""
    sent = dict(headers)
    if not api_key_env:
        return sent, ""
    key = os.environ.get(api_key_env, "")
    if not key:
        raise RewardUnavailableError(reward, f"the environment variable {api_key_env} (api_key_env) is not set")
    sent["Authorization"] = f"Bearer {key}"
    return sent, key


def post_json(reward: str, client: httpx.Client, url: str, body: bytes, *, headers: dict[str, str],
              secret: str, retries: int, backoff_s: float) -> Any:
    """POST ``body`` and return the decoded JSON answer, retrying what may pass; raises
    ``RewardUnavailableError`` saying what went wrong last (``secret`` never appears in it)."""
    problem = ""
    for attempt in range(retries + 1):
        if attempt:
            time.sleep(backoff_s * 2 ** (attempt - 1))
        try:
            response = client.post(url, content=body, headers={**headers, "Content-Type": "application/json"})
        except httpx.TimeoutException as exc:
            problem = f"no answer within the timeout ({type(exc).__name__})"
            continue
        except httpx.TransportError as exc:  # refused, reset, DNS: the server is down or unreachable
            problem = f"server unreachable ({type(exc).__name__}: {exc})"
            continue
        if response.status_code in RETRIED_STATUS:
            problem = f"server answered HTTP {response.status_code}"
            continue
        if not response.is_success:
            return _fail(reward, f"server answered HTTP {response.status_code}: {response.text[:200]!r}", secret)
        try:
            return response.json()
        except ValueError:
            return _fail(reward, f"malformed answer: not JSON: {response.text[:200]!r}", secret)
    return _fail(reward, f"{url}: {problem} after {retries + 1} attempt(s)", secret)


def _fail(reward: str, reason: str, secret: str) -> Any:
    raise RewardUnavailableError(reward, reason.replace(secret, "***") if secret else reason)


@dataclass(frozen=True)
class _Settings:
    url: str
    timeout_s: float
    retries: int
    backoff_s: float
    headers: tuple[tuple[str, str], ...]
    api_key_env: str
    batch_window_s: float
    max_batch: int


class _Batcher:
    """The calls waiting for one server (with one set of settings), and the thread sending them."""

    def __init__(self, settings: _Settings) -> None:
        self.settings = settings
        self._waiting: list[tuple[dict[str, Any], Future]] = []
        self._opened = 0.0  # when the oldest waiting call arrived
        self._changed = threading.Condition()
        self._flusher: threading.Thread | None = None

    def submit(self, sample: dict[str, Any]) -> Future:
        future: Future = Future()
        with self._changed:
            if not self._waiting:
                self._opened = time.monotonic()
            self._waiting.append((sample, future))
            self._changed.notify()
            if self._flusher is None:
                # Daemon: a process that exits mid-batch does not wait for the server.
                self._flusher = threading.Thread(target=self._flush_all, daemon=True,
                                                 name=f"http-reward-flusher {self.settings.url}")
                self._flusher.start()
        return future

    def _flush_all(self) -> None:
        try:
            self._flush_until_idle()
        except BaseException as exc:  # a bug here: the waiting calls hear of it, the next starts anew
            with self._changed:
                waiting, self._waiting, self._flusher = self._waiting, [], None
            for _, future in waiting:
                future.set_exception(RewardUnavailableError("http", f"the batch sender failed: {exc!r}"))
            raise

    def _flush_until_idle(self) -> None:
        settings = self.settings
        with httpx.Client(timeout=settings.timeout_s) as client:
            while True:
                with self._changed:
                    deadline = self._opened + settings.batch_window_s
                    while len(self._waiting) < settings.max_batch and time.monotonic() < deadline:
                        self._changed.wait(deadline - time.monotonic())
                    batch, self._waiting = self._waiting[:settings.max_batch], self._waiting[settings.max_batch:]
                    self._opened = time.monotonic()  # the rest waited long enough: they go next
                self._send(client, batch)
                with self._changed:
                    if not self._waiting:
                        self._flusher = None  # idle: the next call starts a new flusher
                        return

    def _send(self, client: httpx.Client, batch: list[tuple[dict[str, Any], Future]]) -> None:
        settings = self.settings
        try:
            headers, secret = request_headers("http", dict(settings.headers), settings.api_key_env)
            body = json.dumps({"samples": [sample for sample, _ in batch]}, default=str).encode()
            answer = post_json("http", client, settings.url, body, headers=headers, secret=secret,
                               retries=settings.retries, backoff_s=settings.backoff_s)
            rewards = answer.get("rewards") if isinstance(answer, dict) else None
            if not isinstance(rewards, list) or len(rewards) != len(batch):
                raise RewardUnavailableError("http", f"malformed answer: expected {{\"rewards\": [...]}} with "
                                                     f"{len(batch)} value(s), got {json.dumps(answer)[:200]}")
        except BaseException as exc:  # every caller hears of it; none waits forever
            for _, future in batch:
                future.set_exception(exc)
            if not isinstance(exc, Exception):
                raise
            return
        for (_, future), value in zip(batch, rewards):
            future.set_result(value)


_batchers: dict[_Settings, _Batcher] = {}
_batchers_lock = threading.Lock()


def batcher_for(settings: _Settings) -> _Batcher:
    with _batchers_lock:
        return _batchers.setdefault(settings, _Batcher(settings))


def http_reward(sample: RewardInput, *, url: str, timeout_s: float = 30.0, retries: int = 3,
                backoff_s: float = 0.5, headers: dict[str, str] | None = None, api_key_env: str = "",
                batch_window_s: float = 0.05, max_batch: int = 32) -> float | dict[str, float]:
    """The reward the server at ``url`` gives ``sample`` (a float or a dict of named floats),
    batched with the calls made meanwhile. Raises ``RewardUnavailableError`` when the server
    is down, errs, times out after ``retries`` retries, or answers something malformed."""
    settings = _Settings(url, float(timeout_s), retries, float(backoff_s), tuple(sorted((headers or {}).items())),
                         api_key_env, float(batch_window_s), max_batch)
    payload = {"row": sample.row, "messages": sample.messages, "final_text": sample.final_text,
               "finish_reason": sample.finish_reason, "answer": sample.answer}
    # The flusher always settles the future; the bound only guards against a bug leaving it.
    patience = batch_window_s + (retries + 1) * (timeout_s + 5.0) + backoff_s * 2 ** retries + 60.0
    try:
        value = batcher_for(settings).submit(payload).result(timeout=patience)
    except TimeoutError as exc:
        raise RewardUnavailableError("http", f"{url}: no result within {patience:.0f} s") from exc
    except RewardUnavailableError as exc:  # the batch's one error: each caller raises its own
        raise RewardUnavailableError("http", exc.reason) from exc
    try:
        score_of(value)
    except ValueError as exc:
        raise RewardUnavailableError("http", f"malformed answer: {exc}") from exc
    return value
