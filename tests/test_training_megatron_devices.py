"""Where a megatron rank runs (rollmesh.training.megatron_devices): its placement from the
launcher's variables, one GPU per rank by LOCAL_RANK, the refusal of more ranks than GPUs, the
rendezvous from config, the process-group backend, and tensors moved to the CPU before they
leave a rank. Plain logic: no process group, no GPU."""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch

from rollmesh.config import ConfigError, load_config
from rollmesh.training.megatron_devices import (
    RankPlacement,
    RankPlacementError,
    TooManyRanksError,
    check_node_capacity,
    dist_backend,
    placement_from_env,
    rank_device,
    to_host,
)

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

LAUNCHED = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"}


def test_a_rank_is_placed_by_the_launchers_variables_and_the_configured_rendezvous():
    placement = placement_from_env(LAUNCHED, master_addr="node0.cluster", master_port=29500)
    assert placement == RankPlacement(rank=5, world_size=8, local_rank=1, local_world_size=4,
                                      master_addr="node0.cluster", master_port=29500)
    # What MegatronRanks hands its children reads back as the same placement.
    assert placement_from_env(placement.environment(), master_addr="elsewhere", master_port=1) == placement


def test_a_launcher_that_picked_the_rendezvous_overrides_the_config():
    env = {**LAUNCHED, "MASTER_ADDR": "10.0.0.7", "MASTER_PORT": "41000"}
    placement = placement_from_env(env, master_addr="127.0.0.1", master_port=0)
    assert (placement.master_addr, placement.master_port) == ("10.0.0.7", 41000)


def test_without_local_world_size_every_rank_is_on_this_node():
    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}
    assert placement_from_env(env, master_addr="127.0.0.1", master_port=1234).local_world_size == 2


@pytest.mark.parametrize(("env", "variable"), [
    ({"WORLD_SIZE": "2", "LOCAL_RANK": "0"}, "RANK"),
    ({**LAUNCHED, "RANK": "8"}, "RANK"),
    ({**LAUNCHED, "LOCAL_RANK": "4"}, "LOCAL_RANK"),
    ({**LAUNCHED, "LOCAL_WORLD_SIZE": "9"}, "LOCAL_WORLD_SIZE"),
    ({**LAUNCHED, "WORLD_SIZE": "two"}, "WORLD_SIZE"),
    (LAUNCHED, "MASTER_PORT"),  # port 0 in config, none from the launcher: nobody picked one
])
def test_launcher_variables_that_do_not_place_a_rank_are_a_typed_error(env, variable):
    with pytest.raises(RankPlacementError) as caught:
        placement_from_env(env, master_addr="127.0.0.1", master_port=0)
    assert caught.value.variable == variable


def test_each_rank_takes_the_gpu_of_its_local_rank():
    placements = [placement_from_env({"RANK": str(4 + r), "WORLD_SIZE": "8", "LOCAL_RANK": str(r),
                                      "LOCAL_WORLD_SIZE": "4"}, master_addr="a", master_port=1) for r in range(4)]
    assert [rank_device(p, gpus=4) for p in placements] == [torch.device("cuda", r) for r in range(4)]


def test_more_ranks_on_a_node_than_gpus_are_refused_not_stacked_on_gpu_0():
    placement = placement_from_env(LAUNCHED, master_addr="a", master_port=1)  # 4 ranks on the node
    with pytest.raises(TooManyRanksError) as caught:
        rank_device(placement, gpus=2)
    assert (caught.value.ranks_on_node, caught.value.gpus) == (4, 2)
    with pytest.raises(TooManyRanksError):
        check_node_capacity(3, gpus=2)
    check_node_capacity(2, gpus=2)
    check_node_capacity(64, gpus=0)  # a CPU node runs any number of ranks


def test_without_gpus_every_rank_runs_on_the_cpu_under_gloo():
    placement = placement_from_env(LAUNCHED, master_addr="a", master_port=1)
    assert rank_device(placement, gpus=0) == torch.device("cpu")
    assert dist_backend("auto", torch.device("cpu")) == "gloo"
    assert dist_backend("auto", torch.device("cuda", 1)) == "nccl"
    assert dist_backend("gloo", torch.device("cuda", 0)) == "gloo"  # as configured


class _Pair(NamedTuple):
    first: torch.Tensor
    second: list


def test_to_host_moves_every_tensor_in_an_answer_to_the_cpu():
    meta = torch.empty(2, 3, device="meta")  # a non-CPU device every machine has
    answer = {"weights": {"a": meta}, "ranks": [(meta, 1), _Pair(meta, [meta, "x"])], "n": 3}
    moved = {}

    def record_cpu(tensor, *args, **kwargs):  # meta tensors cannot be copied: record the call
        moved[id(tensor)] = True
        return torch.zeros(tensor.shape)

    original = torch.Tensor.cpu
    torch.Tensor.cpu = record_cpu
    try:
        host = to_host(answer)
    finally:
        torch.Tensor.cpu = original
    assert host["n"] == 3 and host["ranks"][1].second[1] == "x" and isinstance(host["ranks"][1], _Pair)
    tensors = [host["weights"]["a"], host["ranks"][0][0], host["ranks"][1].first, host["ranks"][1].second[0]]
    assert all(t.device.type == "cpu" for t in tensors)
    cpu = torch.ones(2)
    assert to_host(cpu) is cpu  # already on the CPU: not copied


def test_the_rendezvous_is_configured_under_trainer_megatron(tmp_path):
    path = tmp_path / "megatron.toml"
    path.write_text('[trainer]\nbackend = "megatron"\nprecision = "bf16"\noptimizer_offload = true\n'
                    '[trainer.megatron]\nmaster_addr = "node0"\nmaster_port = 29500\n')
    config = load_config(path, environ={})
    assert (config.trainer.megatron.master_addr, config.trainer.megatron.master_port) == ("node0", 29500)
    assert config.trainer.precision == "bf16" and config.trainer.optimizer_offload
    path.write_text("[trainer.megatron]\nmaster_port = 70000\n")
    with pytest.raises(ConfigError, match="master_port"):
        load_config(path, environ={})
