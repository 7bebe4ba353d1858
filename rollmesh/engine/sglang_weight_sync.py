"""Weight versions into SGLang servers without files: an NCCL broadcast, or CUDA IPC when colocated.

Knows torch.distributed and the weight endpoints of ``sglang_client``; not Ray, not NATS, not how
the servers were started. The protocol is the one Miles runs (radixark/miles
``miles/backends/megatron_utils/update_weight/update_weight_from_distributed.py``) against SGLang's
``http_server.py`` and ``io_struct.py``:

- ``connect``: the trainer picks a rendezvous address and port; world size = 1 + every server's
  GPUs. Every server's ``/init_weights_update_group`` (``rank_offset`` = its first rank) is called
  at once while the trainer joins as rank 0; each call returns when all have joined.
- ``publish(state_dict, version)``: pause every server, then bucket by bucket (at most
  ``bucket_bytes``): ``/update_weights_from_distributed`` (names, dtypes, shapes, the version
  label on the last bucket only) to every server while rank 0 broadcasts the bucket's tensors one
  by one in that order; every server answers once it loaded the bucket. Then continue. A server
  labelled with the version therefore holds all of it: a push that failed part way leaves the old
  label, and the worker that then sees the announcement loads the version's files
  (``SGLangDiskWeights.adopt_pushed``).
- ``close``: ``/destroy_weights_update_group`` and the trainer's group destroyed.

``SGLangWeightPush`` is what the trainer holds (``trainer.weight_sync = "nccl"`` or ``"ipc"``): it
joins the group at the first version (and again after a failure) and turns every failure into a
``WeightSyncError``, after which the trainer's announced files are the fallback.

``publish_ipc`` is the colocated variant (``/update_weights_from_tensor``): the trainer's CUDA
tensors are shared as ForkingPickler CUDA IPC handles (SGLang's ``MultiprocessingSerializer``:
a pickle, base64, one per TP rank), nothing is copied, and the tensors must stay alive until the
server answered. Both return ``WeightSyncStats`` (the pause and the whole update).

Pause: ``"in_place"`` by default, without flushing the cache: SGLang's ``retract`` followed by a
flush can trip ``assert flush_cache_success`` under load (fixed only on the sglang-miles branch),
and an abort would cut requests short. Paused requests keep their old-weight KV; their later
tokens carry the new version label.

The group is SGLang's own ``init_custom_process_group`` recipe (python/sglang/srt/utils; verl and
Miles copy it): a process group outside the default one (the trainer's megatron group stays
untouched), rendezvous keys prefixed by the group name as SGLang's side prefixes them. It uses
torch's private ``_new_process_group_helper``, as upstream does: no public API makes a second
world. NCCL needs CUDA: on CPU the same protocol runs over gloo (``backend="gloo"``), which the
tests use against a fake server process.
"""

from __future__ import annotations

import asyncio
import base64
import io
import socket
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Literal

import httpx
import structlog
import torch
import torch.distributed as dist
import torch.multiprocessing  # noqa: F401  registers torch's tensor reductions with ForkingPickler
from multiprocessing.reduction import ForkingPickler

from rollmesh.checkpoint.hf_writer import plan_shards
from rollmesh.engine.errors import WeightSyncError
from rollmesh.engine.sglang_client import PauseMode, SGLangClient

_log = structlog.get_logger("rollmesh.engine.sglang_weight_sync")


@dataclass(frozen=True)
class WeightSyncStats:
    version: int
    buckets: int
    num_bytes: int
    pause_s: float  # paused -> continued: generation stopped this long
    total_s: float  # the whole update, the pause and the bucketing around it


def init_custom_process_group(*, backend: str, init_method: str, world_size: int, rank: int, group_name: str,
                              timeout: timedelta) -> dist.ProcessGroup:
    """A process group beside the default one, rendezvousing as SGLang's
    ``init_custom_process_group`` does (so the two sides find each other's keys)."""
    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
        rendezvous,
    )

    store, rank, world_size = next(rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    group, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), store, group_name=group_name,
                                         backend_options=None, timeout=timeout)
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def dtype_name(dtype: torch.dtype) -> str:
    """torch's name, as SGLang reads it back with ``getattr(torch, name)``."""
    return str(dtype).removeprefix("torch.")


def serialize_for_ipc(named_tensors: list[tuple[str, torch.Tensor]]) -> str:
    """SGLang's ``MultiprocessingSerializer.serialize(..., output_str=True)``: CUDA tensors become
    IPC handles, nothing is copied."""
    buffer = io.BytesIO()
    ForkingPickler(buffer).dump(named_tensors)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class SGLangWeightSync:
    """The trainer's end of weight updates into ``servers`` (NCCL, gloo on CPU, or CUDA IPC)."""

    def __init__(self, servers: Sequence[SGLangClient], *, gpus_per_server: int = 1, backend: str = "nccl",
                 master_address: str = "127.0.0.1", group_name: str = "rollmesh_weights",
                 bucket_bytes: int = 512 << 20, pause_mode: PauseMode = "in_place",
                 timeout_s: float = 600.0) -> None:
        if not servers:
            raise ValueError("SGLangWeightSync needs at least one server")
        self.servers = list(servers)
        self.gpus_per_server = gpus_per_server
        self.backend = backend
        self.master_address = master_address
        self.group_name = group_name
        self.bucket_bytes = bucket_bytes
        self.pause_mode = pause_mode
        self.timeout = timedelta(seconds=timeout_s)
        # Tensors travel from where NCCL can send them; gloo sends from the CPU.
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        # CUDA IPC on a GPU; on a CPU-only machine (the tests) ForkingPickler shares CPU memory.
        self.ipc_device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
            else torch.device("cpu")
        self._group: dist.ProcessGroup | None = None

    @property
    def world_size(self) -> int:
        return 1 + self.gpus_per_server * len(self.servers)

    async def connect(self) -> None:
        port = free_port(self.master_address)
        joins = [server.init_weights_update_group(
            master_address=self.master_address, master_port=port, rank_offset=1 + i * self.gpus_per_server,
            world_size=self.world_size, group_name=self.group_name, backend=self.backend)
            for i, server in enumerate(self.servers)]
        join_here = asyncio.to_thread(init_custom_process_group, backend=self.backend,
                                      init_method=f"tcp://{self.master_address}:{port}",
                                      world_size=self.world_size, rank=0, group_name=self.group_name,
                                      timeout=self.timeout)
        outcomes = await asyncio.gather(join_here, *joins, return_exceptions=True)
        errors = [o for o in outcomes if isinstance(o, BaseException)]
        if errors:
            if not isinstance(outcomes[0], BaseException):
                dist.destroy_process_group(outcomes[0])
            raise errors[0]
        self._group = outcomes[0]
        _log.info("sglang_weight_group_joined", servers=len(self.servers), world_size=self.world_size,
                  backend=self.backend)

    async def publish(self, state_dict: Mapping[str, torch.Tensor], version: int) -> WeightSyncStats:
        """Broadcast ``state_dict`` into every server as ``version``: pause, buckets, continue."""
        if self._group is None:
            raise RuntimeError("connect() first")
        started = time.perf_counter()
        plan = self._plan(state_dict)
        await self._on_every_server(lambda s: s.pause_generation(self.pause_mode))
        paused = time.perf_counter()
        try:
            for number, names in enumerate(plan, start=1):
                tensors = [state_dict[name].detach().to(self.device).contiguous() for name in names]
                label = version if number == len(plan) else None  # the label says "all of it"
                updates = self._on_every_server(lambda s: s.update_weights_from_distributed(
                    names=list(names), dtypes=[dtype_name(t.dtype) for t in tensors],
                    shapes=[list(t.shape) for t in tensors], group_name=self.group_name, version=label))
                await asyncio.gather(updates, asyncio.to_thread(self._broadcast, tensors))
        finally:
            # Never leave the servers paused, even when a bucket failed (they keep the old label
            # only if no bucket arrived; a partial update is reported by the raised error).
            await self._on_every_server(lambda s: s.continue_generation())
        done = time.perf_counter()
        return WeightSyncStats(version, len(plan), sum(self._sizes(state_dict).values()), done - paused,
                               done - started)

    async def publish_ipc(self, state_dict: Mapping[str, torch.Tensor], version: int, *,
                          tp_size: int = 1) -> WeightSyncStats:
        """Colocated servers (same GPUs): ``state_dict``'s CUDA tensors shared by IPC handle."""
        started = time.perf_counter()
        plan = self._plan(state_dict)
        await self._on_every_server(lambda s: s.pause_generation(self.pause_mode))
        paused = time.perf_counter()
        try:
            for number, names in enumerate(plan, start=1):
                # Alive until every server answered: the servers read this memory in place. CPU
                # tensors (a trainer that hands its state dict to the host) go to the GPU first:
                # SGLang opens CUDA IPC handles only.
                named = [(name, state_dict[name].detach().to(self.ipc_device).contiguous()) for name in names]
                payload = [serialize_for_ipc(named)] * tp_size
                label = version if number == len(plan) else None
                await self._on_every_server(lambda s: s.update_weights_from_tensor(
                    serialized_named_tensors=payload, version=label))
                del named
        finally:
            await self._on_every_server(lambda s: s.continue_generation())
        done = time.perf_counter()
        return WeightSyncStats(version, len(plan), sum(self._sizes(state_dict).values()), done - paused,
                               done - started)

    async def close(self) -> None:
        if self._group is None:
            return
        group, self._group = self._group, None
        try:
            await self._on_every_server(lambda s: s.destroy_weights_update_group(self.group_name))
        finally:
            dist.destroy_process_group(group)

    def _broadcast(self, tensors: list[torch.Tensor]) -> None:
        works = [dist.broadcast(tensor, src=0, group=self._group, async_op=True) for tensor in tensors]
        for work in works:
            work.wait()

    def _sizes(self, state_dict: Mapping[str, torch.Tensor]) -> dict[str, int]:
        return {name: t.numel() * t.element_size() for name, t in state_dict.items()}

    def _plan(self, state_dict: Mapping[str, torch.Tensor]) -> list[list[str]]:
        return [list(names) for names in plan_shards(self._sizes(state_dict), self.bucket_bytes)] if state_dict else []

    async def _on_every_server(self, call) -> None:
        outcomes = await asyncio.gather(*(call(s) for s in self.servers), return_exceptions=True)
        errors = [o for o in outcomes if isinstance(o, BaseException)]
        for extra in errors[1:]:
            _log.warning("sglang_weight_call_failed", error=str(extra))
        if errors:
            raise errors[0]


class SGLangWeightPush:
    """The trainer's push of each new version into the mesh's SGLang servers (``urls``: their
    admin URLs): ``"nccl"`` broadcasts (over gloo where there is no CUDA), ``"ipc"`` shares the
    tensors with colocated servers. ``push`` raises ``WeightSyncError`` on any failure, after
    which the group is left and joined again for the next version."""

    def __init__(self, urls: Sequence[str], *, method: Literal["nccl", "ipc"], gpus_per_server: int = 1,
                 master_address: str = "127.0.0.1", bucket_bytes: int = 512 << 20,
                 pause_mode: PauseMode = "in_place", timeout_s: float = 600.0) -> None:
        self.method = method
        self.gpus_per_server = gpus_per_server
        self._http = httpx.AsyncClient()
        servers = [SGLangClient(url, self._http, admin_timeout_s=timeout_s) for url in urls]
        self.sync = SGLangWeightSync(servers, gpus_per_server=gpus_per_server,
                                     backend="nccl" if torch.cuda.is_available() else "gloo",
                                     master_address=master_address, bucket_bytes=bucket_bytes,
                                     pause_mode=pause_mode, timeout_s=timeout_s)
        self._joined = False

    async def push(self, state_dict: Mapping[str, torch.Tensor], version: int) -> WeightSyncStats:
        try:
            if self.method == "ipc":
                return await self.sync.publish_ipc(state_dict, version, tp_size=self.gpus_per_server)
            if not self._joined:
                await self.sync.connect()
                self._joined = True
            return await self.sync.publish(state_dict, version)
        except Exception as exc:
            await self._leave()  # a broadcast cut short leaves the group unusable
            raise WeightSyncError(version, self.method, f"{type(exc).__name__}: {exc}") from exc

    async def _leave(self) -> None:
        if not self._joined:
            return
        self._joined = False
        try:
            await self.sync.close()
        except Exception as exc:  # the servers may be what failed; the next push joins afresh
            _log.warning("sglang_weight_group_leave_failed", error=repr(exc))

    async def aclose(self) -> None:
        await self._leave()
        await self._http.aclose()
