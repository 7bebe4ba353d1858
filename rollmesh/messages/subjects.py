"""Every subject of the mesh, each bound to exactly one message type and one encoding.

Knows msgspec and the message modules only. Publisher and subscriber both go through a ``Subject``
so they cannot disagree on the type or the bytes. Client-facing subjects (rollout requests,
progress, completions, failures) are JSON so any plain NATS client can use them; internal ones are
msgpack. Subjects are ``rl.<ns>.<domain>.<event>``.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field
from typing import Generic, Literal, TypeVar

import msgspec

from rollmesh.messages.base import WireMessage
from rollmesh.messages.checkpoint import CheckpointConversionFailed, CheckpointConverted, CheckpointSaved
from rollmesh.messages.dead_letter import DeadLettered
from rollmesh.messages.metrics import MetricsReported
from rollmesh.messages.rollout import (
    RolloutCompleted,
    RolloutFailed,
    RolloutProgressed,
    RolloutRequested,
)
from rollmesh.messages.sandbox import (
    SandboxDownloadReply,
    SandboxDownloadRequest,
    SandboxExecReply,
    SandboxExecRequest,
    SandboxForkReply,
    SandboxForkRequest,
    SandboxHeartbeatReply,
    SandboxHeartbeatRequest,
    SandboxLeaseReply,
    SandboxLeaseRequest,
    SandboxLoadReported,
    SandboxOutputProduced,
    SandboxReleaseReply,
    SandboxReleaseRequest,
    SandboxSnapshotReply,
    SandboxSnapshotRequest,
    SandboxUploadReply,
    SandboxUploadRequest,
)
from rollmesh.messages.scheduling import (
    GpuGranted,
    GpuReleased,
    PreemptionAcknowledged,
    PreemptionRequested,
)
from rollmesh.messages.sim_jobs import (
    RoleDemandChanged,
    RunRegistered,
    SchedulerStatus,
    SchedulerStatusRequest,
    SimJobEnded,
    SimJobStarted,
    SimJobSubmitted,
)
from rollmesh.messages.trainer import GroupDropped, TrainerStepped
from rollmesh.messages.weights import WeightsActivated, WeightsPublished

M = TypeVar("M", bound=WireMessage)
Encoding = Literal["json", "msgpack"]

_NAMESPACE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")

_json_encoder = msgspec.json.Encoder()
_msgpack_encoder = msgspec.msgpack.Encoder()


def check_namespace(namespace: str) -> str:
    """Return ``namespace`` if it is a valid single NATS token, else raise ValueError."""
    if not _NAMESPACE.match(namespace):
        raise ValueError(f"invalid namespace {namespace!r}: use 1-64 of [A-Za-z0-9_-]")
    return namespace


@dataclass(frozen=True)
class Subject(Generic[M]):
    """A subject template bound to its message type (and reply type, for request/reply)."""

    template: str
    type: type[M]
    encoding: Encoding = "msgpack"
    reply_type: type[WireMessage] | None = None
    _decoder: object = field(init=False, repr=False, compare=False)
    _reply_decoder: object = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        module = msgspec.json if self.encoding == "json" else msgspec.msgpack
        object.__setattr__(self, "_decoder", module.Decoder(self.type))
        reply = module.Decoder(self.reply_type) if self.reply_type else None
        object.__setattr__(self, "_reply_decoder", reply)

    def format(self, namespace: str) -> str:
        return self.template.format(ns=check_namespace(namespace))

    def encode(self, message: M) -> bytes:
        if not isinstance(message, self.type):
            raise TypeError(f"{self.template} carries {self.type.__name__}, not {type(message).__name__}")
        return self._encode(message)

    def decode(self, data: bytes) -> M:
        """Decode and validate; raises msgspec.DecodeError / msgspec.ValidationError."""
        return self._decoder.decode(data)  # type: ignore[attr-defined]

    def encode_reply(self, message: WireMessage) -> bytes:
        if self.reply_type is None or not isinstance(message, self.reply_type):
            raise TypeError(f"{self.template} has no reply type {type(message).__name__}")
        return self._encode(message)

    def decode_reply(self, data: bytes) -> WireMessage:
        if self._reply_decoder is None:
            raise TypeError(f"{self.template} is not a request/reply subject")
        return self._reply_decoder.decode(data)  # type: ignore[attr-defined]

    def _encode(self, message: WireMessage) -> bytes:
        encoder = _json_encoder if self.encoding == "json" else _msgpack_encoder
        return encoder.encode(message)


# Client-facing (JSON).
ROLLOUT_REQUESTED = Subject("rl.{ns}.rollout.requested", RolloutRequested, "json")
ROLLOUT_PROGRESSED = Subject("rl.{ns}.rollout.progressed", RolloutProgressed, "json")
ROLLOUT_COMPLETED = Subject("rl.{ns}.rollout.completed", RolloutCompleted, "json")
ROLLOUT_FAILED = Subject("rl.{ns}.rollout.failed", RolloutFailed, "json")

# Internal (msgpack).
WEIGHTS_PUBLISHED = Subject("rl.{ns}.weights.published", WeightsPublished)
WEIGHTS_ACTIVATED = Subject("rl.{ns}.weights.activated", WeightsActivated)
TRAINER_STEPPED = Subject("rl.{ns}.trainer.stepped", TrainerStepped, "json")
# Core NATS, like TRAINER_STEPPED: a restarted trainer re-admits the group's redelivered members
# and sends it again, and the next durable step lists the group.
GROUP_DROPPED = Subject("rl.{ns}.trainer.group_dropped", GroupDropped, "json")
CHECKPOINT_SAVED = Subject("rl.{ns}.ckpt.saved", CheckpointSaved)
CHECKPOINT_CONVERTED = Subject("rl.{ns}.ckpt.converted", CheckpointConverted)
CHECKPOINT_FAILED = Subject("rl.{ns}.ckpt.failed", CheckpointConversionFailed)
# The sandbox broker's request/reply subjects, and the (core NATS) stream of exec output chunks.
# One subject for all output: a chunk names its lease_id and exec_id, and only execs that asked
# for streaming publish any.
SANDBOX_LEASE = Subject("rl.{ns}.sandbox.lease", SandboxLeaseRequest, reply_type=SandboxLeaseReply)
SANDBOX_EXEC = Subject("rl.{ns}.sandbox.exec", SandboxExecRequest, reply_type=SandboxExecReply)
SANDBOX_OUTPUT = Subject("rl.{ns}.sandbox.output", SandboxOutputProduced)
SANDBOX_UPLOAD = Subject("rl.{ns}.sandbox.upload", SandboxUploadRequest, reply_type=SandboxUploadReply)
SANDBOX_DOWNLOAD = Subject(
    "rl.{ns}.sandbox.download", SandboxDownloadRequest, reply_type=SandboxDownloadReply
)
SANDBOX_SNAPSHOT = Subject(
    "rl.{ns}.sandbox.snapshot", SandboxSnapshotRequest, reply_type=SandboxSnapshotReply
)
SANDBOX_FORK = Subject("rl.{ns}.sandbox.fork", SandboxForkRequest, reply_type=SandboxForkReply)
SANDBOX_HEARTBEAT = Subject(
    "rl.{ns}.sandbox.heartbeat", SandboxHeartbeatRequest, reply_type=SandboxHeartbeatReply
)
SANDBOX_RELEASE = Subject(
    "rl.{ns}.sandbox.release", SandboxReleaseRequest, reply_type=SandboxReleaseReply
)
# Every broker's load, which the brokers read to place leases (core NATS, every pool interval).
SANDBOX_LOAD = Subject("rl.{ns}.sandbox.load", SandboxLoadReported)
# In a permission, every broker's subjects at once.
ANY_BROKER = "*"


@functools.cache
def broker_subject(subject: Subject, broker: str) -> Subject:
    """One broker's own subject for a sandbox request: ``rl.{ns}.sandbox.b.<broker>.exec`` for
    ``SANDBOX_EXEC``, bound to the same types. A lease's requests go to its broker's subjects;
    the shared ``rl.{ns}.sandbox.lease`` stays the entry point every broker answers."""
    if not subject.template.startswith("rl.{ns}.sandbox.") or subject.reply_type is None:
        raise ValueError(f"{subject.template} is not a sandbox request subject")
    if broker != ANY_BROKER and not _NAMESPACE.match(broker):
        raise ValueError(f"invalid sandbox broker id {broker!r}: use 1-64 of [A-Za-z0-9_-]")
    template = subject.template.replace("rl.{ns}.sandbox.", f"rl.{{ns}}.sandbox.b.{broker}.", 1)
    return Subject(template, subject.type, subject.encoding, subject.reply_type)

GPU_GRANTED = Subject("rl.{ns}.sched.gpu_granted", GpuGranted)
GPU_RELEASED = Subject("rl.{ns}.sched.gpu_released", GpuReleased)
PREEMPTION_REQUESTED = Subject("rl.{ns}.sched.preemption_requested", PreemptionRequested)
PREEMPTION_ACKNOWLEDGED = Subject("rl.{ns}.sched.preemption_acknowledged", PreemptionAcknowledged)
# Simulation jobs on lent accelerators: JSON, as users submit and follow them from any language.
SIM_SUBMITTED = Subject("rl.{ns}.sched.sim_submitted", SimJobSubmitted, "json")
SIM_STARTED = Subject("rl.{ns}.sched.sim_started", SimJobStarted, "json")
SIM_ENDED = Subject("rl.{ns}.sched.sim_ended", SimJobEnded, "json")
ROLE_DEMAND = Subject("rl.{ns}.sched.demand", RoleDemandChanged)
RUN_REGISTERED = Subject("rl.{ns}.sched.run_registered", RunRegistered)
SCHED_STATUS = Subject("rl.{ns}.sched.status", SchedulerStatusRequest, "json", reply_type=SchedulerStatus)
# The scheduler's accounting, every scheduler.report_every_s (core NATS: the latest one matters).
SCHED_UTILIZATION = Subject("rl.{ns}.sched.utilization", SchedulerStatus, "json")
DEAD_LETTERED = Subject("rl.{ns}.dlq", DeadLettered, "json")
# Every process's metric snapshot, every telemetry.metrics_report_s, to the hub in `rollmesh up`
# (core NATS: the next snapshot makes good a lost one).
METRICS_REPORTED = Subject("rl.{ns}.metrics.reported", MetricsReported)

ALL_SUBJECTS: tuple[Subject, ...] = (
    ROLLOUT_REQUESTED,
    ROLLOUT_PROGRESSED,
    ROLLOUT_COMPLETED,
    ROLLOUT_FAILED,
    WEIGHTS_PUBLISHED,
    WEIGHTS_ACTIVATED,
    TRAINER_STEPPED,
    GROUP_DROPPED,
    CHECKPOINT_SAVED,
    CHECKPOINT_CONVERTED,
    CHECKPOINT_FAILED,
    SANDBOX_LEASE,
    SANDBOX_EXEC,
    SANDBOX_OUTPUT,
    SANDBOX_UPLOAD,
    SANDBOX_DOWNLOAD,
    SANDBOX_SNAPSHOT,
    SANDBOX_FORK,
    SANDBOX_HEARTBEAT,
    SANDBOX_RELEASE,
    SANDBOX_LOAD,
    GPU_GRANTED,
    GPU_RELEASED,
    PREEMPTION_REQUESTED,
    PREEMPTION_ACKNOWLEDGED,
    SIM_SUBMITTED,
    SIM_STARTED,
    SIM_ENDED,
    ROLE_DEMAND,
    RUN_REGISTERED,
    SCHED_STATUS,
    SCHED_UTILIZATION,
    DEAD_LETTERED,
    METRICS_REPORTED,
)
