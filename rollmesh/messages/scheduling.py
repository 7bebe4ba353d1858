"""GPU scheduler events. Knows msgspec only."""

from __future__ import annotations

from rollmesh.messages.base import WireMessage


class GpuGranted(WireMessage, frozen=True, tag="sched.gpu_granted"):
    grant_id: str
    holder: str
    role: str
    count: float
    # The Ray resource the grant is expressed in ("GPU", or a custom resource on CPU-only clusters).
    resource: str
    granted_at: float = 0.0


class GpuReleased(WireMessage, frozen=True, tag="sched.gpu_released"):
    grant_id: str
    holder: str
    count: float
    released_at: float = 0.0


class PreemptionRequested(WireMessage, frozen=True, tag="sched.preemption_requested"):
    grant_id: str
    holder: str
    grace_s: float
    reason: str = ""
    # Scheduler clock time by which the holder must have released (sent PreemptionAcknowledged);
    # after it, the holder is killed. 0: not stated (older schedulers), count grace_s from receipt.
    deadline: float = 0.0


class PreemptionAcknowledged(WireMessage, frozen=True, tag="sched.preemption_acknowledged"):
    grant_id: str
    holder: str
