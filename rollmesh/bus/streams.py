"""The JetStream layout of one namespace: which streams capture which subjects, and their setup.

Knows nats-py's JetStream API and the subject templates; knows nothing of actors or Ray.
``ensure_streams`` is idempotent and safe to call from every actor at once: creating a stream that
exists with the same config is a no-op on the server, and one whose config changed is updated.
Stream names cannot contain dots, so they are ``RL_<ns>_<WHAT>``.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import nats.errors
import nats.js.errors
from nats.js import JetStreamContext
from nats.js.api import (
    DiscardPolicy,
    KeyValueConfig,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)

from rollmesh.bus.errors import StreamSetupError
from rollmesh.messages import Subject, check_namespace
from rollmesh.messages.subjects import (
    CHECKPOINT_CONVERTED,
    CHECKPOINT_FAILED,
    CHECKPOINT_SAVED,
    DEAD_LETTERED,
    GPU_GRANTED,
    GPU_RELEASED,
    PREEMPTION_ACKNOWLEDGED,
    PREEMPTION_REQUESTED,
    ROLE_DEMAND,
    ROLLOUT_COMPLETED,
    ROLLOUT_FAILED,
    ROLLOUT_REQUESTED,
    RUN_REGISTERED,
    SIM_ENDED,
    SIM_STARTED,
    SIM_SUBMITTED,
    WEIGHTS_PUBLISHED,
)

# JetStream error code for "stream name already in use with a different configuration".
_STREAM_NAME_IN_USE = 10058


def rollout_requests_stream(namespace: str) -> str:
    return f"RL_{check_namespace(namespace)}_ROLLOUT_REQUESTS"


def rollout_results_stream(namespace: str) -> str:
    return f"RL_{check_namespace(namespace)}_ROLLOUT_RESULTS"


def weights_stream(namespace: str) -> str:
    return f"RL_{check_namespace(namespace)}_WEIGHTS"


def checkpoints_stream(namespace: str) -> str:
    return f"RL_{check_namespace(namespace)}_CHECKPOINTS"


def scheduling_stream(namespace: str) -> str:
    return f"RL_{check_namespace(namespace)}_SCHED"


def dead_letter_stream(namespace: str) -> str:
    return f"RL_{check_namespace(namespace)}_DLQ"


def rollout_state_bucket(namespace: str) -> str:
    """The KV bucket holding each rollout's resumable state (its stream is ``KV_<bucket>``)."""
    return f"RL_{check_namespace(namespace)}_ROLLOUT_STATE"


# Subject template -> the stream that captures it. Publishers use this to choose a JetStream
# publish (durable, acked) over a core publish, without asking the server each time.
_CAPTURED = {
    ROLLOUT_REQUESTED.template: rollout_requests_stream,
    ROLLOUT_COMPLETED.template: rollout_results_stream,
    ROLLOUT_FAILED.template: rollout_results_stream,
    WEIGHTS_PUBLISHED.template: weights_stream,
    CHECKPOINT_SAVED.template: checkpoints_stream,
    CHECKPOINT_CONVERTED.template: checkpoints_stream,
    CHECKPOINT_FAILED.template: checkpoints_stream,
    GPU_GRANTED.template: scheduling_stream,
    GPU_RELEASED.template: scheduling_stream,
    PREEMPTION_REQUESTED.template: scheduling_stream,
    PREEMPTION_ACKNOWLEDGED.template: scheduling_stream,
    SIM_SUBMITTED.template: scheduling_stream,
    SIM_STARTED.template: scheduling_stream,
    SIM_ENDED.template: scheduling_stream,
    ROLE_DEMAND.template: scheduling_stream,
    RUN_REGISTERED.template: scheduling_stream,
    DEAD_LETTERED.template: dead_letter_stream,
}


def stream_for(subject: Subject, namespace: str) -> str | None:
    """The stream capturing ``subject`` in ``namespace``, or None for core-NATS subjects."""
    name_of = _CAPTURED.get(subject.template)
    return name_of(namespace) if name_of else None


@dataclass(frozen=True)
class StreamLimits:
    """Retention knobs; the defaults suit a single-machine run."""

    weights_keep_last: int = 16
    dead_letters_keep_last: int = 100_000
    # Window in which a repeated Nats-Msg-Id is dropped by the server (publisher dedup).
    duplicate_window_s: float = 120.0
    # Copies of every stream and of the KV bucket (NatsConfig.replicas). 1 on a single server,
    # which refuses more; 3 on a 3-node cluster, so losing any one node loses nothing.
    replicas: int = 1


def stream_configs(namespace: str, limits: StreamLimits = StreamLimits()) -> list[StreamConfig]:
    def subjects(*bound: Subject) -> list[str]:
        return [s.format(namespace) for s in bound]

    common = dict(storage=StorageType.FILE, duplicate_window=limits.duplicate_window_s,
                  num_replicas=limits.replicas)
    return [
        StreamConfig(
            name=rollout_requests_stream(namespace), subjects=subjects(ROLLOUT_REQUESTED),
            retention=RetentionPolicy.WORK_QUEUE,
            description="rollout requests; a message leaves when a worker acks it", **common,
        ),
        StreamConfig(
            name=rollout_results_stream(namespace),
            subjects=subjects(ROLLOUT_COMPLETED, ROLLOUT_FAILED),
            retention=RetentionPolicy.LIMITS, description="finished and failed rollouts",
            **common,
        ),
        StreamConfig(
            name=weights_stream(namespace), subjects=subjects(WEIGHTS_PUBLISHED),
            retention=RetentionPolicy.LIMITS, max_msgs=limits.weights_keep_last,
            discard=DiscardPolicy.OLD, description="weight-version log", **common,
        ),
        StreamConfig(
            # Saved checkpoints wait here for the resharder, even if it is down when they land.
            name=checkpoints_stream(namespace),
            subjects=subjects(CHECKPOINT_SAVED, CHECKPOINT_CONVERTED, CHECKPOINT_FAILED),
            retention=RetentionPolicy.LIMITS, description="checkpoint saved/converted/failed events",
            **common,
        ),
        StreamConfig(
            # Who holds which accelerator is state: a restarted scheduler or dashboard replays it.
            name=scheduling_stream(namespace),
            # Submitted jobs wait here for the scheduler's durable consumer, even while it restarts.
            subjects=subjects(GPU_GRANTED, GPU_RELEASED, PREEMPTION_REQUESTED, PREEMPTION_ACKNOWLEDGED,
                              SIM_SUBMITTED, SIM_STARTED, SIM_ENDED, ROLE_DEMAND, RUN_REGISTERED),
            retention=RetentionPolicy.LIMITS,
            description="accelerator grants, preemptions, simulation jobs and RL demand",
            **common,
        ),
        StreamConfig(
            name=dead_letter_stream(namespace), subjects=subjects(DEAD_LETTERED),
            retention=RetentionPolicy.LIMITS, max_msgs=limits.dead_letters_keep_last,
            discard=DiscardPolicy.OLD, description="undecodable or undeliverable messages",
            **common,
        ),
    ]


async def ensure_streams(js: JetStreamContext, namespace: str,
                         limits: StreamLimits = StreamLimits()) -> list[str]:
    """Create or update every stream and the rollout-state KV bucket; returns the stream names."""
    configs = stream_configs(namespace, limits)
    await asyncio.gather(*(_ensure_stream(js, config) for config in configs))
    await _ensure_rollout_state_bucket(js, namespace, limits.replicas)
    return [config.name for config in configs if config.name]


async def _ensure_stream(js: JetStreamContext, config: StreamConfig) -> None:
    name = config.name or ""
    try:
        await js.add_stream(config)
        return
    except nats.js.errors.BadRequestError as exc:
        if exc.err_code != _STREAM_NAME_IN_USE:
            raise StreamSetupError(f"cannot create: {exc.description}", stream=name) from exc
    except nats.errors.Error as exc:
        raise StreamSetupError(f"cannot create: {exc}", stream=name) from exc
    try:
        await js.update_stream(config)
    except nats.errors.Error as exc:
        raise StreamSetupError(f"cannot update: {exc}", stream=name) from exc


async def _ensure_rollout_state_bucket(js: JetStreamContext, namespace: str,
                                       replicas: int) -> None:
    bucket = rollout_state_bucket(namespace)
    try:
        await js.create_key_value(KeyValueConfig(
            bucket=bucket, history=1, storage=StorageType.FILE, replicas=replicas,
            description="resumable rollout state, one key per rollout",
        ))
    except nats.js.errors.BadRequestError as exc:
        # Exists with another config (older deployment): keep it rather than fight over it.
        if exc.err_code != _STREAM_NAME_IN_USE:
            raise StreamSetupError(f"cannot create KV: {exc.description}", stream=bucket) from exc
    except nats.errors.Error as exc:
        raise StreamSetupError(f"cannot create KV: {exc}", stream=bucket) from exc
