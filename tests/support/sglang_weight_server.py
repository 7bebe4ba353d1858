"""A fake SGLang server's weight-update side, in its own process, over a real gloo group.

What it answers, and the upstream behaviour each mirrors (sgl-project/sglang, read through the
code index: ``python/sglang/srt/entrypoints/http_server.py``, ``managers/io_struct.py``,
``model_executor/model_runner.py``, ``utils`` ``init_custom_process_group``):

- ``/init_weights_update_group`` ``{master_address, master_port, rank_offset, world_size,
  group_name, backend}``: joins the group as rank ``rank_offset`` (+ TP rank 0) with the
  rendezvous of ``init_custom_process_group``; answers ``{success, message}`` once joined.
- ``/update_weights_from_distributed`` ``{names, dtypes, shapes, group_name, flush_cache,
  weight_version}``: allocates ``torch.empty(shape, dtype=getattr(torch, dtype))`` per name and
  receives each by ``broadcast(src=0)`` in order (model_runner), loads them, then sets the
  weight label if ``weight_version`` is given. 400 with ``success: false`` for an unknown group.
- ``/update_weights_from_tensor`` ``{serialized_named_tensors, load_format, flush_cache,
  weight_version}``: ``MultiprocessingSerializer.deserialize`` of its TP rank's entry (base64,
  ForkingPickler), then load and label.
- ``/destroy_weights_update_group`` ``{group_name}``, ``/pause_generation`` ``{mode}``,
  ``/continue_generation``, ``/model_info`` (``weight_version``).

It records every call in order (``GET /debug/events``) and the sha256 of every tensor it loaded
(``GET /debug/weights``), so a test checks what arrived byte for byte; ``POST /debug/reset``
forgets them. A bucket that arrives
while generation is not paused is recorded as such (the trainer must pause first).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import pickle
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from aiohttp import web

from rollmesh.engine.sglang_weight_sync import init_custom_process_group


class FakeSGLangWeights:
    def __init__(self) -> None:
        self.label = "default"
        self.paused = False
        self.groups: dict[str, dist.ProcessGroup] = {}
        self.weights: dict[str, str] = {}  # name -> sha256 of its bytes
        self.events: list[list[Any]] = []

    def app(self) -> web.Application:
        app = web.Application(client_max_size=1 << 30)
        app.router.add_post("/init_weights_update_group", self.init_group)
        app.router.add_post("/destroy_weights_update_group", self.destroy_group)
        app.router.add_post("/update_weights_from_distributed", self.update_distributed)
        app.router.add_post("/update_weights_from_tensor", self.update_tensor)
        app.router.add_post("/pause_generation", self.pause)
        app.router.add_post("/continue_generation", self.resume)
        app.router.add_get("/model_info", self.model_info)
        app.router.add_get("/debug/events", lambda r: web.json_response(self.events))
        app.router.add_get("/debug/weights", lambda r: web.json_response(self.weights))
        app.router.add_post("/debug/reset", self.reset)
        return app

    async def reset(self, request: web.Request) -> web.Response:
        """A fresh server for the next test (one process serves a whole test module)."""
        self.label, self.paused, self.weights, self.events = "default", False, {}, []
        return web.json_response({})

    async def init_group(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.events.append(["init", body["rank_offset"], body["world_size"], body["group_name"], body["backend"]])
        group = await asyncio.to_thread(
            init_custom_process_group, backend=body["backend"],
            init_method=f"tcp://{body['master_address']}:{body['master_port']}",
            world_size=body["world_size"], rank=body["rank_offset"], group_name=body["group_name"],
            timeout=timedelta(seconds=120))
        self.groups[body["group_name"]] = group
        return web.json_response({"success": True, "message": "Succeeded to initialize custom process group."})

    async def destroy_group(self, request: web.Request) -> web.Response:
        body = await request.json()
        group = self.groups.pop(body["group_name"], None)
        if group is not None:
            dist.destroy_process_group(group)
        self.events.append(["destroy", body["group_name"]])
        return web.json_response({"success": group is not None, "message": ""})

    async def update_distributed(self, request: web.Request) -> web.Response:
        body = await request.json()
        group = self.groups.get(body["group_name"])
        if group is None:
            return web.json_response({"success": False, "message": f"group {body['group_name']} not found"},
                                     status=400)
        tensors = [torch.empty(shape, dtype=getattr(torch, dtype))
                   for dtype, shape in zip(body["dtypes"], body["shapes"])]

        def receive() -> None:
            works = [dist.broadcast(t, src=0, group=group, async_op=True) for t in tensors]
            for work in works:
                work.wait()

        await asyncio.to_thread(receive)
        self._load(zip(body["names"], tensors), body.get("weight_version"))
        self.events.append(["update_distributed", body["names"], body.get("weight_version"), self.paused,
                            body["flush_cache"]])
        return web.json_response({"success": True, "message": "Succeeded to update parameter online."})

    async def update_tensor(self, request: web.Request) -> web.Response:
        body = await request.json()
        named = pickle.loads(base64.b64decode(body["serialized_named_tensors"][0]))  # TP rank 0's entry
        self._load(named, body.get("weight_version"))
        self.events.append(["update_tensor", [name for name, _ in named], body.get("weight_version"), self.paused,
                            body["flush_cache"]])
        return web.json_response({"success": True, "message": "Succeeded to update model weights."})

    def _load(self, named, label: str | None) -> None:
        for name, tensor in named:
            self.weights[name] = tensor_sha256(tensor)
        if label is not None:
            self.label = label

    async def pause(self, request: web.Request) -> web.Response:
        self.paused = True
        self.events.append(["pause", (await request.json()).get("mode")])
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def resume(self, request: web.Request) -> web.Response:
        self.paused = False
        self.events.append(["continue"])
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def model_info(self, request: web.Request) -> web.Response:
        return web.json_response({"model_path": "fake", "weight_version": self.label})


def serve(port: int) -> None:
    """The child process's entry point: serve on 127.0.0.1:``port`` until killed."""
    torch.set_num_threads(1)
    web.run_app(FakeSGLangWeights().app(), host="127.0.0.1", port=port, print=None)


def tensor_sha256(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
