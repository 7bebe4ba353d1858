"""Long trajectories: a TokenTrace travels inline up to a size, and through the object store above.

Knows the wire structs and the ``TrajectoryStore`` / ``RolloutStateStore`` ports; nothing of NATS.
The size is that of the trace's JSON (the encoding of ``RolloutCompleted`` on the wire), compared
with ``rollout.inline_trajectory_bytes``: at most that, inline; above it, stored and referenced.
A completed rollout's trace is stored (``<rollout>/completed``) before its message is published.
A saved state's trace is stored per turn (``<rollout>/state-turn-<n>``), so a KV value never
names a blob that a later turn overwrote; the previous turn's blob is deleted once the new state
is saved, and the last one when the state is deleted. ``InMemoryTrajectories`` serves
in-process runs and tests; the mesh uses ``rollmesh.bus.trajectory_store``.

A rollout split into several training samples (``history_rewrite = "split"``) travels the same
way, all inline or all stored: inline when the samples' JSON together fits, else one object per
sample (``<name>`` for the first, ``<name>-sample-<k>`` for sample k >= 1).
"""

from __future__ import annotations

import msgspec

from rollmesh.messages import RolloutState, TokenTrace
from rollmesh.ports import RolloutStateStore, StateStoreError, TrajectoryLostError, TrajectoryStore

COMPLETED_OBJECT = "completed"


def trace_bytes(trace: TokenTrace) -> int:
    """The size of ``trace`` on the wire (JSON, as in a RolloutCompleted)."""
    return len(msgspec.json.encode(trace))


def fits_inline(trace: TokenTrace, inline_bytes: int) -> bool:
    return trace_bytes(trace) <= inline_bytes


async def place_trace(rollout_id: str, name: str, trace: TokenTrace, *, inline_bytes: int,
                      store: TrajectoryStore | None) -> dict[str, object]:
    """The fields that carry ``trace`` in a message: ``trajectory`` inline when it fits (or when
    there is no store), else ``trajectory_ref`` to the object ``name``, stored first."""
    if store is None or fits_inline(trace, inline_bytes):
        return {"trajectory": trace, "trajectory_ref": ""}
    return {"trajectory": None, "trajectory_ref": await store.save(rollout_id, name, trace)}


async def load_trace(message: object, store: TrajectoryStore | None) -> TokenTrace:
    """The TokenTrace of a RolloutCompleted or RolloutState, fetched when it is stored."""
    ref: str = getattr(message, "trajectory_ref")
    if getattr(message, "trajectory") is None and ref:
        if store is None:
            raise TrajectoryLostError(ref, "no trajectory store to fetch a stored trajectory from")
        return await store.load(ref)
    return message.token_trace()  # type: ignore[attr-defined, no-any-return]


def sample_object(name: str, index: int) -> str:
    """The object name of sample ``index`` of a trace stored as ``name``."""
    return name if index == 0 else f"{name}-sample-{index}"


async def place_traces(rollout_id: str, name: str, traces: list[TokenTrace], *, inline_bytes: int,
                       store: TrajectoryStore | None) -> dict[str, object]:
    """The fields that carry a rollout's samples (``traces``, at least one) in a message: all
    inline when their JSON together fits (or there is no store), else each one stored first."""
    first, later = traces[0], traces[1:]
    if store is None or sum(trace_bytes(trace) for trace in traces) <= inline_bytes:
        return {"trajectory": first, "trajectory_ref": "", "split_samples": later, "split_sample_refs": []}
    refs = [await store.save(rollout_id, sample_object(name, index), trace) for index, trace in enumerate(traces)]
    return {"trajectory": None, "trajectory_ref": refs[0], "split_samples": [], "split_sample_refs": refs[1:]}


async def load_traces(message: object, store: TrajectoryStore | None) -> list[TokenTrace]:
    """Every sample of a RolloutCompleted or RolloutState, in order, fetched when stored."""
    first = await load_trace(message, store)
    refs: list[str] = getattr(message, "split_sample_refs")
    if refs and store is None:
        raise TrajectoryLostError(refs[0], "no trajectory store to fetch a stored trajectory from")
    later = [await store.load(ref) for ref in refs] if refs and store is not None else []
    return [first, *later, *getattr(message, "split_samples")]


class InMemoryTrajectories:
    """Stored traces in a dict, lost with the process: in-process runs and tests only."""

    bucket = "memory"

    def __init__(self) -> None:
        self.traces: dict[str, TokenTrace] = {}

    async def save(self, rollout_id: str, name: str, trace: TokenTrace) -> str:
        ref = f"{self.bucket}/{rollout_id}/{name}"
        self.traces[ref] = trace
        return ref

    async def load(self, ref: str) -> TokenTrace:
        if ref not in self.traces:
            raise TrajectoryLostError(ref)
        return self.traces[ref]

    async def delete(self, ref: str) -> None:
        self.traces.pop(ref, None)


class OffloadingRolloutStates:
    """A ``RolloutStateStore`` whose states keep a long trace in ``trajectories``, not in the KV
    value (a KV value is one NATS message: at most the server's max payload, 1 MiB by default)."""

    def __init__(self, states: RolloutStateStore, trajectories: TrajectoryStore, *, inline_bytes: int) -> None:
        self.states = states
        self.trajectories = trajectories
        self.inline_bytes = inline_bytes
        self._refs: dict[str, list[str]] = {}  # rollout id -> the blobs its saved state names

    async def load(self, rollout_id: str) -> RolloutState | None:
        state = await self.states.load(rollout_id)
        if state is None or not (state.trajectory_ref or state.split_sample_refs):
            return state
        self._refs[rollout_id] = _refs_of(state)
        try:
            traces = await load_traces(state, self.trajectories)
        except TrajectoryLostError as exc:  # as an unreadable KV value: the rollout starts again
            raise StateStoreError(f"the saved state of {rollout_id!r} lost its trajectory: {exc}") from exc
        return msgspec.structs.replace(state, trajectory=traces[0], trajectory_ref="",
                                       split_samples=traces[1:], split_sample_refs=[])

    async def save(self, state: RolloutState) -> None:
        if state.trajectory is not None and not state.split_sample_refs:
            traces = [state.trajectory, *state.split_samples]
            carried = await place_traces(state.rollout_id, f"state-turn-{state.turn}", traces,
                                         inline_bytes=self.inline_bytes, store=self.trajectories)
            state = msgspec.structs.replace(state, **carried)  # type: ignore[arg-type]
        await self.states.save(state)
        previous = self._refs.pop(state.rollout_id, [])
        current = _refs_of(state)
        if current:
            self._refs[state.rollout_id] = current
        for ref in previous:
            if ref not in current:
                await self._forget(ref)

    async def delete(self, rollout_id: str) -> None:
        await self.states.delete(rollout_id)
        for ref in self._refs.pop(rollout_id, []):
            await self._forget(ref)

    async def _forget(self, ref: str) -> None:
        try:
            await self.trajectories.delete(ref)
        except StateStoreError:
            pass  # no state names it any more; the bucket's TTL reclaims it


def _refs_of(state: RolloutState) -> list[str]:
    return [ref for ref in (state.trajectory_ref, *state.split_sample_refs) if ref]
