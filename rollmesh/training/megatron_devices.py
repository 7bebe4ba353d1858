"""Where a megatron rank runs: its place in the job (global rank, world, rank on its node) as the
launcher of the rank processes gives it, the device it takes, the torch.distributed backend and
rendezvous, and the CUDA RNG seeding megatron-core needs before its first forward.

Knows os.environ's launcher variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE: the names
torchrun and ``MegatronRanks`` set), torch's device and process-group calls and megatron-core's
``model_parallel_cuda_manual_seed``; nothing of models, losses, Ray or NATS.

One GPU per rank: rank LOCAL_RANK of a node takes GPU LOCAL_RANK, as torchrun's ranks do. More
ranks on a node than GPUs is refused (``TooManyRanksError``) instead of stacking ranks on one GPU
(``rank % count`` did: every rank on GPU 0 once ranks outnumbered GPUs, and NCCL refuses two
ranks of one communicator on one device anyway). Without CUDA every rank runs on the CPU.
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Mapping

import torch

from rollmesh.training.errors import RankPlacementError, TooManyRanksError


@dataclasses.dataclass(frozen=True)
class RankPlacement:
    """One rank's place: global ``rank`` of ``world_size``, ``local_rank`` of the
    ``local_world_size`` ranks on its node, and the rendezvous (global rank 0's node)."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int

    def environment(self) -> dict[str, str]:
        """The launcher variables that give this placement (what ``placement_from_env`` reads)."""
        return {"RANK": str(self.rank), "WORLD_SIZE": str(self.world_size), "LOCAL_RANK": str(self.local_rank),
                "LOCAL_WORLD_SIZE": str(self.local_world_size), "MASTER_ADDR": self.master_addr,
                "MASTER_PORT": str(self.master_port)}


def _int_variable(env: Mapping[str, str], name: str, default: int | None = None) -> int:
    value = env.get(name)
    if value is None:
        if default is None:
            raise RankPlacementError("not set (the launcher of the rank processes sets it)", variable=name)
        return default
    try:
        return int(value)
    except ValueError as exc:
        raise RankPlacementError(f"{value!r} is not an integer", variable=name) from exc


def placement_from_env(env: Mapping[str, str], *, master_addr: str, master_port: int) -> RankPlacement:
    """This rank's placement from the launcher's RANK, WORLD_SIZE and LOCAL_RANK (LOCAL_WORLD_SIZE:
    default WORLD_SIZE, every rank on one node) and the configured rendezvous
    (``trainer.megatron.master_addr``/``master_port``; MASTER_ADDR/MASTER_PORT when set, as a
    launcher that picked the port sets them). ``RankPlacementError`` when they do not fit."""
    world = _int_variable(env, "WORLD_SIZE")
    rank = _int_variable(env, "RANK")
    local_rank = _int_variable(env, "LOCAL_RANK")
    local_world = _int_variable(env, "LOCAL_WORLD_SIZE", world)
    port = _int_variable(env, "MASTER_PORT", master_port)
    if world < 1:
        raise RankPlacementError(f"{world} ranks", variable="WORLD_SIZE")
    if not 0 <= rank < world:
        raise RankPlacementError(f"rank {rank} outside a world of {world}", variable="RANK")
    if not 1 <= local_world <= world:
        raise RankPlacementError(f"{local_world} ranks on this node of a world of {world}", variable="LOCAL_WORLD_SIZE")
    if not 0 <= local_rank < local_world:
        raise RankPlacementError(f"local rank {local_rank} outside the node's {local_world} ranks", variable="LOCAL_RANK")
    if not 0 < port <= 65535:
        raise RankPlacementError(f"port {port} (0 means 'pick one', which only the launcher can do)",
                                 variable="MASTER_PORT")
    return RankPlacement(rank=rank, world_size=world, local_rank=local_rank, local_world_size=local_world,
                         master_addr=env.get("MASTER_ADDR", master_addr), master_port=port)


def check_node_capacity(ranks_on_node: int, gpus: int) -> None:
    """``TooManyRanksError`` when a node with ``gpus`` GPUs (0: a CPU node, any number of ranks)
    would hold more ranks than GPUs."""
    if gpus and ranks_on_node > gpus:
        raise TooManyRanksError(ranks_on_node=ranks_on_node, gpus=gpus)


def rank_device(placement: RankPlacement, gpus: int) -> torch.device:
    """The device of a rank: GPU ``local_rank`` when the node has GPUs (``gpus``), else the CPU."""
    if not gpus:
        return torch.device("cpu")
    check_node_capacity(placement.local_world_size, gpus)
    return torch.device("cuda", placement.local_rank)


def dist_backend(configured: str, device: torch.device) -> str:
    """``trainer.megatron.dist_backend``: "auto" is nccl on GPUs, gloo on the CPU."""
    if configured != "auto":
        return configured
    return "nccl" if device.type == "cuda" else "gloo"


def init_rank(placement: RankPlacement, *, configured_backend: str, timeout_s: float) -> torch.device:
    """Take this rank's device and join the process group (TCP rendezvous at the master's address).
    Returns the device. ``timeout_s``: the collectives' own timeout, so a rank whose peer died
    leaves its collective then, not never."""
    import torch.distributed as dist

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    device = rank_device(placement, gpus)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = dist_backend(configured_backend, device)
    dist.init_process_group(backend, init_method=f"tcp://{placement.master_addr}:{placement.master_port}",
                            rank=placement.rank, world_size=placement.world_size,
                            timeout=datetime.timedelta(seconds=timeout_s),
                            # NCCL binds its communicator to the rank's device at once.
                            device_id=device if device.type == "cuda" else None)
    return device


def current_device() -> torch.device:
    """The device this rank's model, batches and collectives live on (``init_rank`` set it)."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def seed_model_parallel_rng(seed: int) -> bool:
    """On CUDA, megatron-core's CUDA RNG tracker: its "model-parallel-rng" state (and the data- and
    expert-parallel ones), which megatron forks around dropout and activation recompute in every
    forward; its first forward raises without them. True when seeded; on the CPU there is no CUDA
    state to seed and ``megatron_cpu_shims`` answers the forks."""
    if not torch.cuda.is_available():
        return False
    from megatron.core import tensor_parallel

    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return True


def to_host(value):
    """``value`` with every tensor in it (dicts, lists, tuples) moved to
    the CPU: what crosses a process boundary (pickled to the trainer) must not be a CUDA tensor,
    which would unpickle onto a GPU of the receiver, or fail there without one."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu() if value.device.type != "cpu" else value
    if isinstance(value, dict):
        return {key: to_host(item) for key, item in value.items()}
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a NamedTuple
        return type(value)(*(to_host(item) for item in value))
    if isinstance(value, list | tuple):
        return type(value)(to_host(item) for item in value)
    return value
