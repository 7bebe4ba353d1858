"""A fake SGLang server: the native HTTP API of ``python -m sglang.launch_server``, in-process.

SGLang pins a CUDA torch and cannot run on the CPU machines the suite runs on, so it is faked at
its true edge, its HTTP API (tests/support/fakes.py holds the other edges' fakes; this one is an aiohttp
server, so it has its own module). It behaves like the real server on each point the backend
depends on, each with its upstream source (sgl-project/sglang, read through the code index):

- ``/generate`` answers ``{"text", "output_ids", "meta_info"}`` with ``finish_reason``
  ``{"type": "stop", "matched": id|str}`` / ``{"type": "length", "length"}`` / ``{"type":
  "abort"}``, ``output_token_logprobs`` as (logprob, id, text), ``weight_version``, base64 int32
  ``routed_experts`` (``tokenizer_manager.py``, ``detokenizer_manager.py``).
- A ``stop`` string under ``--skip-tokenizer-init`` is a 400 (``sampling_params.py``
  ``raise_if_tokenizer_required``, sglang#27882); otherwise stop strings are matched in the decoded
  output, and ``stop_token_ids`` on ids, the matching token kept in ``output_ids`` (``schedule_batch.py``
  ``Req.check_finished``).
- Routed-expert rows are ``num_hidden_layers`` wide, 0 on dense layers (``routed_experts_capturer.py``
  sizes its buffers by ``hf_text_config.num_hidden_layers``; only MoE layers capture), cover
  ``[routed_experts_start_len, seqlen - 1)``, and with ``stop_edge`` one row more when a request
  stops (the payload Miles trims, ``miles/rollout/sglang_rollout.py``).
- ``/pause_generation`` ``abort`` ends held requests now with their partial output; ``retract``
  and ``in_place`` keep them waiting until ``/continue_generation`` (``scheduler.py``
  ``pause_generation``). ``/flush_cache`` answers 400 while any request waits or runs
  (``Scheduler.flush_cache`` needs ``is_fully_idle``). ``/update_weights_from_disk`` with
  ``flush_cache`` (SGLang's default: true) while requests wait kills the scheduler (``assert
  flush_cache_success``, ``scheduler_components/weight_updater.py``; fixed only on sglang-miles,
  #31962): the fake then drops every connection, as a dead server refuses them.
"""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from aiohttp import web

from rollmesh.engine.sglang_routes import RoutedExpertsShape

# Two MoE layers around a dense one: rows are 3 wide on the wire, 2 wide once read.
SHAPE = RoutedExpertsShape(num_layers=2, top_k=2, num_experts=8, sparse_layers=(0, 2), num_hidden_layers=3)
EOS = 2


def expert(position: int, layer: int, k: int, num_experts: int = SHAPE.num_experts) -> int:
    """The fake's routing rule: a pure function of the absolute position, so slices can be checked."""
    return (position * 7 + layer * 3 + k) % num_experts


def encode_rows(rows: np.ndarray) -> str:
    return base64.b64encode(rows.astype("<i4").tobytes()).decode()


class FakeSGLang:
    """One fake SGLang server. ``/generate`` answers what ``responder(prompt)`` returns (default:
    ``completion_len`` tokens 100, 101, ...) until a stop, then EOS; cut at ``max_new_tokens``
    (finish "length"). Logprob of token i: ``-0.5 - i/10``. ``decode`` (ids -> text) stands for the
    server's tokenizer, which stop strings need; ``skip_tokenizer_init`` launches it without one.
    ``honour_start_len=False`` returns routed experts from position 0 (builds that ignore the
    start). ``fail_status`` makes the next generate answer that status. ``hold`` keeps generates
    waiting until ``release`` (and, while paused, until continue). ``legacy`` serves model info
    only at ``/get_model_info`` (builds before ``/model_info``)."""

    def __init__(self, *, label: str = "0", honour_start_len: bool = True, legacy: bool = False,
                 skip_tokenizer_init: bool = False, shape: RoutedExpertsShape = SHAPE,
                 responder: Callable[[list[int]], list[int]] | None = None,
                 decode: Callable[[list[int]], str] | None = None, stop_edge: bool = False) -> None:
        self.label = label
        self.honour_start_len = honour_start_len
        self.legacy = legacy
        self.skip_tokenizer_init = skip_tokenizer_init
        self.shape = shape
        self.responder = responder
        self.decode = decode
        self.stop_edge = stop_edge
        self.completion_len = 4
        self.context_len = 64
        self.finish_reason: dict[str, Any] | None = None
        self.fail_status: int | None = None
        self.requests: list[tuple[str, Any]] = []
        self.traceparents: list[tuple[str, str | None]] = []  # (path, traceparent header)
        self.hold = False
        self.pending = 0  # generates received and not answered: SGLang's waiting + running
        self.paused: str | None = None
        self.crashed = ""  # why the scheduler died ("" while alive)
        self._released = asyncio.Event()
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._aborted = False
        self.url = ""
        self._runner: web.AppRunner | None = None

    def bodies(self, path: str) -> list[Any]:
        return [body for p, body in self.requests if p == path]

    async def start(self, port: int = 0) -> str:
        @web.middleware
        async def record_and_die(request: web.Request, handler: Any) -> web.StreamResponse:
            if self.crashed:  # a dead server answers nothing
                request.transport.close()
                raise ConnectionResetError(self.crashed)
            self.traceparents.append((request.path, request.headers.get("traceparent")))
            return await handler(request)

        app = web.Application(middlewares=[record_and_die])
        app.router.add_post("/generate", self._generate)
        app.router.add_get("/health_generate", self._health)
        app.router.add_get("/get_model_info", self._model_info)
        app.router.add_get("/model_info", self._model_info)
        app.router.add_post("/pause_generation", self._pause)
        app.router.add_post("/continue_generation", self._continue)
        app.router.add_post("/flush_cache", self._flush)
        app.router.add_post("/update_weights_from_disk", self._update)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", port)
        await site.start()
        host, port = self._runner.addresses[0][:2]
        self.url = f"http://{host}:{port}"
        return self.url

    async def stop(self) -> None:
        self._released.set()
        self._resumed.set()
        if self._runner is not None:
            await self._runner.cleanup()

    def release(self) -> None:
        self._released.set()

    # -- generation ---------------------------------------------------------------------------

    async def _generate(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.requests.append(("/generate", body))
        if self.fail_status is not None:
            status, self.fail_status = self.fail_status, None
            return web.json_response({"error": {"message": f"scripted {status}"}}, status=status)
        prompt, sampling = body["input_ids"], body["sampling_params"]
        stops = sampling.get("stop") or []
        if stops and self.skip_tokenizer_init:
            # sampling_params.py raise_if_tokenizer_required; /generate turns the ValueError into 400.
            return web.json_response({"error": {"message": (
                f"stop={stops!r} is unavailable when skip_tokenizer_init=True "
                "(requires tokenizer to decode tokens to text for matching).")}}, status=400)
        if len(prompt) > self.context_len:
            return web.json_response({"error": {"message": (
                f"The input ({len(prompt)} tokens) is longer than the model's context length "
                f"({self.context_len} tokens).")}}, status=400)
        self.pending += 1
        try:
            if self.hold:
                await self._released.wait()
            if not self._aborted:
                await self._resumed.wait()  # paused in place or retracted: waits for continue
            output_ids, finish = self._decode_tokens(prompt, sampling)
        finally:
            self.pending -= 1
        meta: dict[str, Any] = {
            "id": body.get("rid"), "finish_reason": finish, "prompt_tokens": len(prompt),
            "completion_tokens": len(output_ids), "cached_tokens": len(prompt) // 2,
            "weight_version": self.label,
            "output_token_logprobs": [(-0.5 - i / 10, t, None) for i, t in enumerate(output_ids)],
        }
        if body.get("return_routed_experts"):
            meta["routed_experts"] = self._routes(body, len(prompt) + len(output_ids), finish)
        return web.json_response({"text": "", "output_ids": output_ids, "meta_info": meta})

    def _decode_tokens(self, prompt: list[int], sampling: dict[str, Any]) -> tuple[list[int], dict[str, Any]]:
        budget = sampling["max_new_tokens"]
        if self._aborted:
            return [100, 101][:budget], {"type": "abort", "message": "Abort before update weights"}
        planned = (self.responder(prompt) if self.responder is not None
                   else [100 + i for i in range(self.completion_len)] + [EOS])
        stop_ids, stops = set(sampling.get("stop_token_ids") or ()), sampling.get("stop") or []
        output: list[int] = []
        for token in planned[:budget]:
            output.append(token)
            if token in stop_ids:
                return output, {"type": "stop", "matched": token}
            if stops and self.decode is not None:
                matched = next((s for s in stops if s in self.decode(output)), None)
                if matched is not None:
                    return output, {"type": "stop", "matched": matched}
            if token == EOS:
                return output, self.finish_reason or {"type": "stop", "matched": EOS}
        if len(output) == budget:
            return output, {"type": "length", "length": budget}
        return output, self.finish_reason or {"type": "stop", "matched": EOS}

    def _routes(self, body: dict[str, Any], seqlen: int, finish: dict[str, Any]) -> str:
        start = body.get("routed_experts_start_len", 0) if self.honour_start_len else 0
        end = seqlen - 1 + (1 if self.stop_edge and finish["type"] == "stop" else 0)
        sparse = set(self.shape.sparse_layers or range(self.shape.wire_layers))
        rows = np.array([[[expert(p, layer, k) if layer in sparse else 0 for k in range(self.shape.top_k)]
                          for layer in range(self.shape.wire_layers)] for p in range(start, end)])
        return encode_rows(rows.reshape(-1, self.shape.wire_layers, self.shape.top_k))

    # -- admin ----------------------------------------------------------------------------------

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="")

    async def _model_info(self, request: web.Request) -> web.Response:
        if self.legacy and request.path == "/model_info":
            return web.json_response({"detail": "Not Found"}, status=404)
        return web.json_response({"model_path": "/fake", "is_generation": True, "weight_version": self.label})

    async def _pause(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.requests.append(("/pause_generation", body))
        self.paused = body.get("mode", "abort")
        if self.paused == "abort":
            self._aborted = True
            self._released.set()
        else:
            self._resumed.clear()
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def _continue(self, request: web.Request) -> web.Response:
        self.requests.append(("/continue_generation", await request.json() if request.can_read_body else None))
        self.paused, self._aborted = None, False
        self._resumed.set()
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def _flush(self, request: web.Request) -> web.Response:
        self.requests.append(("/flush_cache", None))
        if self.pending:
            return web.Response(status=400, text=(
                "Cache not flushed. Please check backend logs for more details. (When there are "
                "running or waiting requests, the operation will not be performed.)\n"))
        return web.Response(text="Cache flushed.\n")

    async def _update(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.requests.append(("/update_weights_from_disk", body))
        if not Path(body["model_path"]).exists():
            return web.json_response({"success": False, "message": f"no such path {body['model_path']}",
                                      "num_paused_requests": 0}, status=400)
        if body.get("flush_cache", True) and self.pending:
            self.crashed = "AssertionError: Cache flush failed after updating weights"
            request.transport.close()
            raise ConnectionResetError(self.crashed)
        self.label = body["weight_version"]
        return web.json_response({"success": True, "message": "Succeeded to update model weights.",
                                  "num_paused_requests": 0})
