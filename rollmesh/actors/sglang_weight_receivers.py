"""The SGLang servers a trainer pushes weight versions into, asked of the SGLang worker actors.

Knows Ray (actors by name, this node's address); not NATS, not torch. The launcher hands the
trainer the SGLang workers' names (``inference.backend = "sglang"``); each answers
``weight_sync_target`` with its servers' admin URLs, their GPUs and its pause mode. The trainer's
node address is the rendezvous the servers join (it must be reachable from their nodes).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class WeightReceivers:
    urls: list[str]
    gpus_per_server: int
    pause_mode: str
    master_address: str


async def find_weight_receivers(workers: Sequence[str]) -> WeightReceivers:
    import ray

    actors = [ray.get_actor(name) for name in workers]
    targets = await asyncio.gather(*(actor.weight_sync_target.remote() for actor in actors))
    gpus = {target["gpus_per_server"] for target in targets}
    if len(gpus) != 1:  # one config for every worker: a mix would be a launcher bug
        raise ValueError(f"SGLang workers report different GPUs per server: {sorted(gpus)}")
    return WeightReceivers(urls=[url for target in targets for url in target["urls"]], gpus_per_server=gpus.pop(),
                           pause_mode=targets[0]["pause_mode"], master_address=ray.util.get_node_ip_address())
