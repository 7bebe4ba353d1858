"""The megatron backend's rank processes, and ``MegatronRanks``: the trainer's handle on them.

Knows processes, ``multiprocessing.connection`` and torch.distributed set-up; the training itself
is ``MegatronTrainerBackend``'s, run unchanged in every rank. Nothing of Ray or NATS.

Why processes of their own: megatron-core keeps its parallel state in module globals and each
rank needs its own torch.distributed process (and, on GPUs, its own device), so the trainer
actor cannot host the ranks itself. It starts ``world_size`` children
(``python -m rollmesh.training.megatron_ranks``), which connect back over an authenticated
loopback connection, and ``MegatronRanks`` offers the ``TrainerBackend`` methods: each call is
sent to every rank (every backend method is a collective) and rank 0's answer returned, except
``training_state`` / ``load_training_state``, which are per rank (each rank's own optimizer
shards and RNG state).

Failures. A rank that raises answers with its traceback; one that dies, or a call that outlasts
``call_timeout_s`` (a rank dead inside a collective leaves the others waiting in it), fails the
call. Either way ``MegatronRanksError`` names the rank and the method, and the group is closed:
a collective cannot be resumed half-done, so the trainer fails and its restart resumes from the
last durable step (the ledger), as after any other crash.

Transfer. Arguments and answers are pickled over the connection, weights included: fine for
models of a few GB on one machine; larger ones would publish their buckets from rank 0 itself.
Answers are moved to the CPU first (``megatron_devices.to_host``): a pickled CUDA tensor would
unpickle onto the trainer's GPU, or fail in a trainer without one.

Placement (``megatron_devices``): each child gets the launcher variables (RANK, WORLD_SIZE,
LOCAL_RANK, LOCAL_WORLD_SIZE) and the rendezvous of ``trainer.megatron.master_addr`` /
``master_port`` (port 0: a free one here), and takes GPU LOCAL_RANK; more ranks than this node's
GPUs are refused before any starts (``TooManyRanksError``). Every rank is started on this node:
ranks on other nodes would be started by their own launcher (torchrun, srun) with the same
variables and rendezvous, and would need a way to reach this handle, which is not built.
"""

from __future__ import annotations

import os
import pickle
import secrets
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from multiprocessing.connection import Client, Connection, answer_challenge, deliver_challenge
from pathlib import Path
from typing import Any

import torch

from rollmesh.moved_names import forward_moved_names
from rollmesh.training.errors import MegatronRanksError
from rollmesh.training.megatron_devices import (
    RankPlacement,
    check_node_capacity,
    init_rank,
    placement_from_env,
    to_host,
)

# Answered by every rank for itself (the others: rank 0 answers for all).
PER_RANK_METHODS = frozenset({"training_state", "load_training_state", "device_memory"})


def _send(connection: Connection, value: Any) -> None:
    # Plain pickle, not Connection.send: torch registers its tensors with multiprocessing's
    # pickler to pass them as shared-memory file descriptors, which only work between processes
    # multiprocessing started (ours are plain subprocesses). Plain pickle copies them by value.
    connection.send_bytes(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL))


def _receive(connection: Connection) -> Any:
    return pickle.loads(connection.recv_bytes())


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class MegatronRanks:
    """``world_size`` rank processes running ``MegatronTrainerBackend``; a ``TrainerBackend``."""

    def __init__(self, model_config, trainer_config, *, log_dir: Path | None = None) -> None:
        self.layout = trainer_config.megatron
        self.world_size = self.layout.world_size
        # Every rank runs here, one GPU each: refused before anything starts.
        check_node_capacity(self.world_size, torch.cuda.device_count() if torch.cuda.is_available() else 0)
        self._lock = threading.Lock()  # one call at a time: calls are collectives
        self._closed = False
        self._authkey = secrets.token_bytes(32)
        self._server = socket.create_server(("127.0.0.1", 0))
        env = {**os.environ, "ROLLMESH_RANKS_AUTHKEY": self._authkey.hex(),
               "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[2]),
                                                           os.environ.get("PYTHONPATH")])),
               "OMP_NUM_THREADS": str(trainer_config.torch_threads)}
        host, port = self._server.getsockname()
        master_port = self.layout.master_port or _free_port()
        self._logs = []
        self._processes: list[subprocess.Popen] = []
        self._connections: list[Connection | None] = [None] * self.world_size
        try:
            for rank in range(self.world_size):
                # A file, not a pipe: a rank that writes more than a pipe holds would block.
                log = (open(log_dir / f"megatron_rank{rank}.log", "ab") if log_dir is not None
                       else tempfile.TemporaryFile())
                self._logs.append(log)
                placement = RankPlacement(rank=rank, world_size=self.world_size, local_rank=rank,
                                          local_world_size=self.world_size, master_addr=self.layout.master_addr,
                                          master_port=master_port)
                self._processes.append(subprocess.Popen(
                    [sys.executable, "-m", "rollmesh.training.megatron_ranks", f"{host}:{port}"],
                    env={**env, **placement.environment()}, stdout=log, stderr=subprocess.STDOUT))
            self._accept(timeout_s=self.layout.start_timeout_s)
            for connection in self._connections:
                _send(connection, (model_config, trainer_config))
            self._collect("start", timeout_s=self.layout.start_timeout_s)
        except BaseException:
            self.close()
            raise

    def _accept(self, *, timeout_s: float) -> None:
        """Every rank's connection, authenticated as ``multiprocessing.connection.Listener``
        does; fails as soon as a rank process exits, or after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        self._server.settimeout(0.5)
        for _ in range(self.world_size):
            while True:
                dead = [rank for rank, process in enumerate(self._processes) if process.poll() is not None]
                if dead:
                    raise MegatronRanksError(rank=dead[0], method="start", detail=self._output_of(dead[0]))
                if time.monotonic() > deadline:
                    raise MegatronRanksError(rank=-1, method="start", detail=f"no connection within {timeout_s:.0f} s")
                try:
                    sock, _ = self._server.accept()
                    break
                except TimeoutError:
                    continue
            sock.settimeout(None)
            connection = Connection(sock.detach())
            deliver_challenge(connection, self._authkey)
            answer_challenge(connection, self._authkey)
            rank = _receive(connection)
            self._connections[rank] = connection

    def _output_of(self, rank: int) -> str:
        """The tail of a rank's output (its traceback, when it died)."""
        log = self._logs[rank]
        log.flush()
        with open(log.name if isinstance(log.name, str) else f"/proc/self/fd/{log.fileno()}", "rb") as f:
            return f.read()[-4000:].decode(errors="replace") or f"exited with {self._processes[rank].poll()}"

    def _collect(self, method: str, *, timeout_s: float) -> list[Any]:
        deadline = time.monotonic() + timeout_s
        answers: list[Any] = []
        for rank, connection in enumerate(self._connections):
            assert connection is not None
            while not connection.poll(0.5):
                if self._processes[rank].poll() is not None:
                    self._fail(rank, method, self._output_of(rank))
                if time.monotonic() > deadline:
                    self._fail(rank, method, f"no answer within {timeout_s:.0f} s")
            try:
                status, value = _receive(connection)
            except (EOFError, OSError):
                self._fail(rank, method, "the rank process closed its connection")
            if status == "error":
                self._fail(rank, method, value)
            answers.append(value)
        return answers

    def _fail(self, rank: int, method: str, detail: str):
        self.close()
        raise MegatronRanksError(rank=rank, method=method, detail=detail)

    def _call(self, method: str, *args: Any, per_rank_args: list[tuple] | None = None, **kwargs: Any) -> list[Any]:
        with self._lock:
            if self._closed:
                raise MegatronRanksError(rank=-1, method=method, detail="the ranks were closed after a failure")
            for rank, connection in enumerate(self._connections):
                assert connection is not None
                call_args = per_rank_args[rank] if per_rank_args is not None else args
                try:
                    _send(connection, (method, call_args, kwargs))
                except OSError:
                    self._fail(rank, method, "the rank process closed its connection")
            return self._collect(method, timeout_s=self.layout.call_timeout_s)

    # TrainerBackend
    def sft_step(self, sequences, *, lr: float) -> dict[str, float] | float:
        """PackedRows -> their stats; (tokens, mask) pairs -> the loss (``MegatronTrainerBackend``)."""
        return self._call("sft_step", sequences, lr=lr)[0]

    def policy_step(self, samples, *, current_version: int | None = None) -> dict[str, float]:
        return self._call("policy_step", samples, current_version=current_version)[0]

    def state_dict(self):
        return self._call("state_dict")[0]

    def load_state_dict(self, weights) -> None:
        self._call("load_state_dict", weights)

    def save_checkpoint(self, out_dir: Path, *, iteration: int, weight_version: int = 0) -> tuple[Path, str]:
        return self._call("save_checkpoint", out_dir, iteration=iteration, weight_version=weight_version)[0]

    def training_state(self) -> dict[str, Any]:
        """Every rank's own state, in rank order, with the layout they belong to."""
        return {"layout": self._layout_key(), "ranks": self._call("training_state")}

    def load_training_state(self, state: dict[str, Any]) -> None:
        if state.get("layout") != self._layout_key():
            raise MegatronRanksError(rank=-1, method="load_training_state",
                                      detail=f"saved by layout {state.get('layout')}, loading on {self._layout_key()}")
        self._call("load_training_state", per_rank_args=[(rank_state,) for rank_state in state["ranks"]])

    def device_memory(self, *, reset: bool = True) -> list[dict[str, Any]]:
        """Every rank's device and peak allocated bytes since the last call (None off CUDA)."""
        return self._call("device_memory", reset=reset)

    def _layout_key(self) -> dict[str, int]:
        return {"tensor_parallel": self.layout.tensor_parallel, "pipeline_parallel": self.layout.pipeline_parallel,
                "expert_parallel": self.layout.expert_parallel, "data_parallel": self.layout.data_parallel}

    def close(self) -> None:
        """Stop every rank (idempotent)."""
        self._closed = True
        for connection in self._connections:
            if connection is not None:
                try:
                    _send(connection, ("close", (), {}))
                except OSError:
                    pass
        for process in self._processes:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        for connection in self._connections:
            if connection is not None:
                connection.close()
        self._server.close()
        for log in self._logs:
            log.close()


def _init_distributed(layout, placement: RankPlacement) -> None:
    """Join the process group on this rank's device (``megatron_devices.init_rank``), then
    megatron-core's parallel state."""
    init_rank(placement, configured_backend=layout.dist_backend, timeout_s=layout.call_timeout_s)
    from rollmesh.training.megatron_cpu_shims import install_cpu_shims

    install_cpu_shims()
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tensor_parallel, pipeline_model_parallel_size=layout.pipeline_parallel,
        expert_model_parallel_size=layout.expert_parallel)


def serve_rank(address: str) -> None:
    """One rank's process (placed by the launcher variables, ``megatron_devices``): connect,
    build the backend, answer calls until "close"."""
    host, port = address.rsplit(":", 1)
    connection = Client((host, int(port)), authkey=bytes.fromhex(os.environ.pop("ROLLMESH_RANKS_AUTHKEY")))
    rank = int(os.environ["RANK"])
    _send(connection, rank)
    model_config, trainer_config = _receive(connection)
    try:
        layout = trainer_config.megatron
        placement = placement_from_env(os.environ, master_addr=layout.master_addr, master_port=layout.master_port)
        torch.set_num_threads(trainer_config.torch_threads)
        _init_distributed(layout, placement)
        from rollmesh.training.megatron_backend import MegatronTrainerBackend

        backend = MegatronTrainerBackend(model_config, trainer_config)
    except BaseException:
        _send(connection, ("error", traceback.format_exc()))
        raise
    _send(connection, ("ok", None))
    while True:
        try:
            method, args, kwargs = _receive(connection)
        except (EOFError, OSError):
            break  # the trainer is gone
        if method == "close":
            break
        try:
            result = getattr(backend, method)(*args, **kwargs)
            _send(connection, ("ok", to_host(result) if rank == 0 or method in PER_RANK_METHODS else None))
        except Exception:
            _send(connection, ("error", traceback.format_exc()))
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    serve_rank(sys.argv[1])


# MegatronRanksFailed was renamed (errors end in Error): the old name warns for one release.
__getattr__ = forward_moved_names(__name__, {"MegatronRanksFailed": "rollmesh.training.errors:MegatronRanksError"})
