"""The prefill engine and the decode loop as ``StagesWeights``, the face a ``WeightFollower`` and
``update_weights_from_file`` stage weight versions through.

Knows the engine's PrefillEngine and DecodeLoop; not Ray, not NATS (the worker actors in
``rollmesh.actors.inference_workers`` wrap their engine in one of these).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # named in annotations only: the worker modules import this before torch is needed
    from rollmesh.engine.batch_loop import DecodeLoop
    from rollmesh.engine.prefill import PrefillEngine


class PrefillWeights:
    """Adapts PrefillEngine to the follower: prefill calls never overlap on the actor's event
    loop, so between two calls is always a boundary and staged weights apply at once."""

    def __init__(self, engine: PrefillEngine) -> None:
        self.engine = engine

    @property
    def current_version(self) -> int:
        return self.engine.current_version

    def stage_weights(self, state_dict, version: int) -> bool:
        return self.engine.stage_weights(state_dict, version)

    async def wait_weights_activated(self, version: int) -> int:
        self.engine.apply_staged_weights()
        return self.engine.current_version

    @property
    def last_swap_seconds(self) -> float:
        return self.engine.weights.last_swap_seconds

    def num_active(self) -> int:
        return 0


class DecodeWeights:
    """Adapts DecodeLoop to the follower: staged weights activate at the loop's next step
    boundary, so ``wait_weights_activated`` waits for the loop."""

    def __init__(self, loop: DecodeLoop) -> None:
        self.loop = loop

    @property
    def current_version(self) -> int:
        return self.loop.engine.current_version

    def stage_weights(self, state_dict, version: int) -> bool:
        return self.loop.stage_weights(state_dict, version)

    async def wait_weights_activated(self, version: int) -> int:
        return await self.loop.wait_weights_activated(version)

    @property
    def last_swap_seconds(self) -> float:
        return self.loop.engine.weights.last_swap_seconds

    def num_active(self) -> int:
        return self.loop.engine.num_active()
