"""The wire contract: message Structs and the subjects they travel on. Imports nothing of ours."""

from rollmesh.messages.base import SamplingParams, WireMessage
from rollmesh.messages.checkpoint import CheckpointConverted, CheckpointFormat, CheckpointSaved
from rollmesh.messages.dead_letter import DeadLettered
from rollmesh.messages.rollout import (
    FailureKind,
    RolloutCompleted,
    RolloutFailed,
    RolloutProgressed,
    RolloutRequested,
)
from rollmesh.messages.sandbox import (
    SandboxErrorKind,
    SandboxExecReply,
    SandboxExecRequest,
    SandboxLeaseReply,
    SandboxLeaseRequest,
    SandboxReleaseReply,
    SandboxReleaseRequest,
)
from rollmesh.messages.scheduling import (
    GpuGranted,
    GpuReleased,
    PreemptionAcknowledged,
    PreemptionRequested,
)
from rollmesh.messages.subjects import ALL_SUBJECTS, Subject, check_namespace
from rollmesh.messages.trainer import TrainerStepped
from rollmesh.messages.weights import WeightsActivated, WeightsPublished

__all__ = [
    "ALL_SUBJECTS",
    "CheckpointConverted",
    "CheckpointFormat",
    "CheckpointSaved",
    "DeadLettered",
    "FailureKind",
    "GpuGranted",
    "GpuReleased",
    "PreemptionAcknowledged",
    "PreemptionRequested",
    "RolloutCompleted",
    "RolloutFailed",
    "RolloutProgressed",
    "RolloutRequested",
    "SamplingParams",
    "SandboxErrorKind",
    "SandboxExecReply",
    "SandboxExecRequest",
    "SandboxLeaseReply",
    "SandboxLeaseRequest",
    "SandboxReleaseReply",
    "SandboxReleaseRequest",
    "Subject",
    "TrainerStepped",
    "WeightsActivated",
    "WeightsPublished",
    "WireMessage",
    "check_namespace",
]
