"""The wire contract: every subject carries one message type in one encoding, client-facing
subjects are plain JSON, and old and new actors read each other's messages."""

from __future__ import annotations

import json

import msgspec
import pytest

from rollmesh.messages import (
    ALL_SUBJECTS,
    CheckpointConversionFailed,
    CheckpointConverted,
    CheckpointSaved,
    DeadLettered,
    ForkedLease,
    MetricPoint,
    MetricSeries,
    MetricsReported,
    GpuGranted,
    GpuReleased,
    PreemptionAcknowledged,
    PreemptionRequested,
    RoleDemandChanged,
    RolloutCompleted,
    RolloutFailed,
    RolloutProgressed,
    RolloutRequested,
    SamplingParams,
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
    SandboxLimitsSpec,
    SandboxLoadReported,
    SandboxOutputProduced,
    SandboxReleaseReply,
    SandboxReleaseRequest,
    SandboxSnapshotReply,
    SandboxSnapshotRequest,
    SandboxUploadReply,
    SandboxUploadRequest,
    TokenTrace,
    RunRegistered,
    SchedulerStatus,
    SchedulerStatusRequest,
    SimJobEnded,
    SimJobStarted,
    SimJobSubmitted,
    Subject,
    TrainerStepped,
    GroupDropped,
    WeightsActivated,
    WeightsPublished,
    WireMessage,
    check_namespace,
)
from rollmesh.messages.subjects import (
    ROLLOUT_COMPLETED,
    ROLLOUT_FAILED,
    ROLLOUT_PROGRESSED,
    ROLLOUT_REQUESTED,
    SANDBOX_EXEC,
    TRAINER_STEPPED,
    WEIGHTS_ACTIVATED,
    WEIGHTS_PUBLISHED,
)

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

COMPLETED = RolloutCompleted(
    rollout_id="r-1", task="molar_mass", group_id="g", purpose="train", reward=1.0, turns=2,
    tool_calls=1, prompt_len=2, text="AB", num_tokens=3, weight_version=3,
    trajectory=TokenTrace(ids=[256, 65, 66], loss_mask=[0, 0, 1], logprobs=[0.0, 0.0, -0.5], versions=[-1, -1, 3]),
)

# One valid message per wire type; a new type without an example here fails the tests below.
EXAMPLES: dict[type, WireMessage] = {type(m): m for m in [
    RolloutRequested(rollout_id="r-1", task="molar_mass", task_input={"formula": "H2O"},
                     sampling=SamplingParams(temperature=0.5, stop=["</calc>"])),
    RolloutProgressed(rollout_id="r-1", turn=1, num_tokens=30, weight_version=2),
    COMPLETED,
    RolloutFailed(rollout_id="r-1", kind="sandbox_error", reason="broker down"),
    WeightsPublished(version=3, path="/run/weights/v000003.safetensors", sha256="ab" * 32, num_bytes=10),
    WeightsActivated(version=3, worker="decode-0", role="decode", in_flight=2),
    TrainerStepped(step=1, weight_version=1, loss=0.1, reward_mean=0.5, num_samples=4, num_groups=1,
                   groups=["rl/0/12"], dropped_groups=0),
    GroupDropped(group_id="rl/0/13", reward=1.0, step=1),
    CheckpointSaved(step=1, weight_version=1, path="/run/checkpoints/step_1", format="torch",
                    model_config={"d_model": 32}),
    CheckpointConverted(step=1, weight_version=1, source_path="/a", hf_path="/b", files=["m.safetensors"],
                        num_bytes=10),
    CheckpointConversionFailed(step=1, weight_version=1, source_path="/a", format="megatron_torch_dist",
                               error_type="CheckpointReadError", reason="cannot read checkpoint: ..."),
    SandboxLeaseRequest(holder="r-1", profile="default", limits=SandboxLimitsSpec(memory_mb=4096)),
    SandboxLeaseReply(lease_id="lease-1", backend="bwrap", isolated=True, warm=True,
                      limits=SandboxLimitsSpec(memory_mb=4096, pids=256)),
    SandboxExecRequest(lease_id="lease-1", argv=["python3", "-c", "print(1)"], stdin=b"\x00\xff"),
    SandboxExecReply(result="exit", exit_code=0, stdout=b"1\n"),
    SandboxOutputProduced(lease_id="lease-1", exec_id="e-1", stream="stdout", offset=0, data=b"1\n"),
    SandboxLoadReported(broker="1", leases=3, live_sandboxes=5, max_sandboxes=64, warm={"default": 2}),
    SandboxUploadRequest(lease_id="lease-1", path="f", data=b"\x00", size=1, sha256="ab" * 32),
    SandboxUploadReply(received=1, complete=True, size=1, sha256="ab" * 32),
    SandboxDownloadRequest(lease_id="lease-1", path="d", kind="tar"),
    SandboxDownloadReply(data=b"tar", size=3, sha256="cd" * 32, eof=True),
    SandboxSnapshotRequest(lease_id="lease-1"),
    SandboxSnapshotReply(snapshot_id="s-1", size=10),
    SandboxForkRequest(snapshot_id="s-1", holder="g-1", count=2),
    SandboxForkReply(leases=[ForkedLease(lease_id="lease-2", holder="g-1/0", expires_at=1.0)]),
    SandboxHeartbeatRequest(lease_id="lease-1"),
    SandboxHeartbeatReply(expires_at=2.0),
    SandboxReleaseRequest(lease_id="lease-1"),
    SandboxReleaseReply(released=True),
    GpuGranted(grant_id="g-1", holder="trainer", role="trainer", count=1.0, resource="GPU"),
    GpuReleased(grant_id="g-1", holder="trainer", count=1.0),
    PreemptionRequested(grant_id="g-1", holder="trainer", grace_s=5.0),
    PreemptionAcknowledged(grant_id="g-1", holder="trainer"),
    SimJobSubmitted(job_id="md-1", command=["python", "md.py"], accelerators=2, expected_duration_s=3600.0,
                    grace_s=30.0, checkpoint_interval_s=600.0, checkpoint_s=10.0),
    SimJobStarted(job_id="md-1", attempt=1, accelerators=2, started_at=1.0),
    SimJobEnded(job_id="md-1", attempt=1, outcome="preempted", exit_code=0, ended_at=2.0),
    RoleDemandChanged(role="trainer", accelerators=4),
    RunRegistered(run_id="run-b", guaranteed={"trainer": 2, "decode": 1}, weight=2.0),
    SchedulerStatusRequest(),
    SchedulerStatus(capacity=8, roles={"trainer": 4}, jobs={"md-1": "running"}, allocated_utilization=0.9,
                    busy_utilization=0.85, preemptions=1, kills=0, lost_accelerator_s=12.0, rl_queueing_s=0.0,
                    reported_at=3.0),
    DeadLettered(subject="rl.ns.rollout.requested", consumer="rollout_requested", reason="bad json"),
    MetricsReported(source="decode-0/41/ab12cd34", component="decode", actor="decode-0", reported_at=4.0,
                    metrics=[MetricSeries(name="rollmesh_generated_tokens", kind="counter",
                                          points=[MetricPoint(labels={"worker": "decode-0"}, value=12.0)])]),
]}
CLIENT_FACING = (ROLLOUT_REQUESTED, ROLLOUT_PROGRESSED, ROLLOUT_COMPLETED, ROLLOUT_FAILED)


def subject_id(subject: Subject) -> str:
    return subject.template.removeprefix("rl.{ns}.")


def other_example(excluded: type) -> WireMessage:
    return next(message for kind, message in EXAMPLES.items() if kind is not excluded)


def test_each_subject_binds_its_own_message_type():
    types = [subject.type for subject in ALL_SUBJECTS]
    assert len(set(types)) == len(types)
    assert len({subject.template for subject in ALL_SUBJECTS}) == len(ALL_SUBJECTS)


@pytest.mark.parametrize("subject", ALL_SUBJECTS, ids=subject_id)
def test_a_message_round_trips_through_its_subject(subject):
    message = EXAMPLES[subject.type]
    assert subject.decode(subject.encode(message)) == message
    if subject.reply_type is not None:
        reply = EXAMPLES[subject.reply_type]
        assert subject.decode_reply(subject.encode_reply(reply)) == reply


@pytest.mark.parametrize("subject", ALL_SUBJECTS, ids=subject_id)
def test_encode_refuses_a_message_of_another_type(subject):
    with pytest.raises(TypeError, match=subject.type.__name__):
        subject.encode(other_example(subject.type))


@pytest.mark.parametrize("subject", ALL_SUBJECTS, ids=subject_id)
def test_decode_refuses_bytes_of_another_message_type(subject):
    wrong = other_example(subject.type)
    encoder = msgspec.json if subject.encoding == "json" else msgspec.msgpack
    with pytest.raises(msgspec.ValidationError):
        subject.decode(encoder.encode(wrong))


def test_reply_encoding_refuses_the_wrong_type_and_non_request_subjects():
    with pytest.raises(TypeError):
        SANDBOX_EXEC.encode_reply(SandboxLeaseReply(lease_id="x"))
    with pytest.raises(TypeError):
        WEIGHTS_PUBLISHED.encode_reply(EXAMPLES[WeightsPublished])
    with pytest.raises(TypeError):
        WEIGHTS_PUBLISHED.decode_reply(b"")


@pytest.mark.parametrize("subject", CLIENT_FACING, ids=subject_id)
def test_client_facing_subjects_are_json_objects_tagged_with_their_type(subject):
    assert subject.encoding == "json"
    document = json.loads(subject.encode(EXAMPLES[subject.type]))
    assert document["type"] == subject.type.__struct_config__.tag


def test_internal_subjects_are_msgpack():
    assert WEIGHTS_PUBLISHED.encoding == WEIGHTS_ACTIVATED.encoding == SANDBOX_EXEC.encoding == "msgpack"
    document = msgspec.msgpack.decode(WEIGHTS_PUBLISHED.encode(EXAMPLES[WeightsPublished]))
    assert document["type"] == "weights.published" and document["version"] == 3


def test_a_plain_json_request_without_the_type_tag_decodes():
    request = ROLLOUT_REQUESTED.decode(json.dumps({"rollout_id": "c-1", "task": "molar_mass",
                                                   "task_input": {"formula": "NaCl"}}).encode())
    assert request == RolloutRequested(rollout_id="c-1", task="molar_mass", task_input={"formula": "NaCl"})


def test_a_json_request_with_another_type_tag_is_refused():
    with pytest.raises(msgspec.ValidationError):
        ROLLOUT_REQUESTED.decode(b'{"type": "rollout.failed", "rollout_id": "c-1", "task": "t"}')


@pytest.mark.parametrize("fields", [
    {"rollout_id": "", "task": "t"},
    {"rollout_id": "r", "task": "t", "max_turns": 0},
    {"rollout_id": "r", "task": "t", "purpose": "fun"},
    {"rollout_id": "r", "task": "t", "sampling": {"top_p": 0.0}},
    {"task": "t"},
])
def test_a_request_breaking_the_constraints_in_its_type_is_refused(fields):
    with pytest.raises(msgspec.ValidationError):
        ROLLOUT_REQUESTED.decode(json.dumps(fields).encode())


def test_wire_messages_are_frozen():
    with pytest.raises(AttributeError):
        COMPLETED.reward = 0.0  # type: ignore[misc]


@pytest.mark.parametrize("namespace", ["", "a.b", "a b", "*", ">", "x" * 65])
def test_a_namespace_that_is_not_one_nats_token_is_refused(namespace):
    with pytest.raises(ValueError):
        ROLLOUT_REQUESTED.format(namespace)


def test_subjects_are_formatted_in_their_namespace():
    assert ROLLOUT_REQUESTED.format("exp-1") == "rl.exp-1.rollout.requested"
    assert check_namespace("exp_1") == "exp_1"


# --- schema evolution --------------------------------------------------------------------------
# A "newer" version of a message is what a later release would ship: the same tag and fields, and
# a new field with a default at the end (docs: new fields get defaults and go last).

class NewerRolloutRequested(RolloutRequested, frozen=True, tag="rollout.requested"):
    priority: int = 0


class NewerRolloutCompleted(RolloutCompleted, frozen=True, tag="rollout.completed"):
    reward_breakdown: dict[str, float] = {}


class NewerWeightsPublished(WeightsPublished, frozen=True, tag="weights.published"):
    dtype: str = "float32"


NEWER = [
    pytest.param(ROLLOUT_REQUESTED, NewerRolloutRequested(rollout_id="r-9", task="molar_mass", priority=5),
                 id="json-rollout.requested"),
    pytest.param(ROLLOUT_COMPLETED, NewerRolloutCompleted(**msgspec.structs.asdict(COMPLETED),
                                                          reward_breakdown={"format": 1.0}),
                 id="json-rollout.completed"),
    pytest.param(WEIGHTS_PUBLISHED, NewerWeightsPublished(**msgspec.structs.asdict(EXAMPLES[WeightsPublished]),
                                                          dtype="bfloat16"),
                 id="msgpack-weights.published"),
]


def encode_as(subject: Subject, message: WireMessage) -> bytes:
    """What a newer actor's Subject would put on the wire."""
    return (msgspec.json if subject.encoding == "json" else msgspec.msgpack).encode(message)


@pytest.mark.parametrize(("subject", "newer"), NEWER)
def test_an_older_reader_decodes_a_newer_message_ignoring_the_new_field(subject, newer):
    decoded = subject.decode(encode_as(subject, newer))
    assert type(decoded) is subject.type
    older_fields = {name: getattr(newer, name) for name in subject.type.__struct_fields__}
    assert msgspec.structs.asdict(decoded) == older_fields


@pytest.mark.parametrize(("subject", "newer"), NEWER)
def test_a_newer_reader_decodes_an_older_message_with_the_new_field_defaulted(subject, newer):
    newer_subject = Subject(subject.template, type(newer), subject.encoding)
    older = subject.type(**{name: getattr(newer, name) for name in subject.type.__struct_fields__})
    decoded = newer_subject.decode(subject.encode(older))
    default = type(newer)(**msgspec.structs.asdict(older))
    assert decoded == default
    (new_field,) = set(type(newer).__struct_fields__) - set(subject.type.__struct_fields__)
    assert getattr(decoded, new_field) == getattr(default, new_field)


# TrainerStepped's generation-lag fields were named version lag (max_version_lag, version_lag_p50,
# _p90, _histogram) for what is the generation lag; for one release both names travel.

class LastReleaseTrainerStepped(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", tag="trainer.stepped"):
    """What a reader of the last release decodes (the fields it reads of the lag)."""

    step: int
    weight_version: int
    max_version_lag: int = 0
    version_lag_p50: int = 0
    version_lag_p90: int = 0
    version_lag_histogram: dict[int, int] = {}


def test_a_trainer_stepped_from_the_last_release_is_read_under_the_generation_lag_names():
    older = (b'{"type":"trainer.stepped","step":3,"weight_version":3,"loss":0.5,"reward_mean":1.0,'
             b'"num_samples":4,"num_groups":2,"max_version_lag":2,"version_lag_p50":1,'
             b'"version_lag_p90":2,"version_lag_histogram":{"1":3,"2":1}}')
    decoded = TRAINER_STEPPED.decode(older)
    assert (decoded.max_generation_lag, decoded.generation_lag_p50, decoded.generation_lag_p90,
            decoded.generation_lag_histogram) == (2, 1, 2, {1: 3, 2: 1})


def test_a_trainer_stepped_sent_with_the_new_names_still_carries_what_last_release_readers_read():
    stepped = TrainerStepped(step=3, weight_version=3, loss=0.5, reward_mean=1.0, num_samples=4, num_groups=2,
                             max_generation_lag=2, generation_lag_p50=1, generation_lag_p90=2,
                             generation_lag_histogram={1: 3, 2: 1})
    older = msgspec.json.decode(TRAINER_STEPPED.encode(stepped), type=LastReleaseTrainerStepped)
    assert (older.max_version_lag, older.version_lag_p50, older.version_lag_p90,
            older.version_lag_histogram) == (2, 1, 2, {1: 3, 2: 1})
    assert TRAINER_STEPPED.decode(TRAINER_STEPPED.encode(stepped)) == stepped


def test_a_trainer_stepped_without_lag_keeps_both_names_at_zero():
    stepped = TRAINER_STEPPED.decode(TRAINER_STEPPED.encode(
        TrainerStepped(step=1, weight_version=1, loss=0.0, reward_mean=0.0, num_samples=0, num_groups=0)))
    assert (stepped.max_generation_lag, stepped.max_version_lag, stepped.generation_lag_histogram) == (0, 0, {})


def test_a_scheduler_status_names_its_decode_loans_under_both_names_for_one_release():
    from rollmesh.messages.sim_jobs import SchedulerStatus

    base = dict(capacity=4, roles={}, jobs={}, allocated_utilization=0.0, busy_utilization=0.0, preemptions=0,
                kills=0, lost_accelerator_s=0.0, rl_queueing_s=0.0, reported_at=0.0)
    older = msgspec.json.encode({"type": "sched.status", **base, "elastic_workers": ["w-1"]})
    assert msgspec.json.decode(older, type=SchedulerStatus).decode_loan_workers == ["w-1"]  # an older scheduler
    newer = msgspec.json.decode(msgspec.json.encode(SchedulerStatus(**base, decode_loan_workers=["w-2"])))
    assert newer["elastic_workers"] == ["w-2"]  # what a last-release rollout worker reads


def test_sandbox_bytes_travel_as_msgpack_bin_not_text():
    request = SandboxExecRequest(lease_id="l", argv=["cat"], stdin=b"\x00\xff binary")
    raw = msgspec.msgpack.decode(SANDBOX_EXEC.encode(request))
    assert raw["stdin"] == b"\x00\xff binary"  # bin decodes to bytes; str would decode to str
    reply = SANDBOX_EXEC.decode_reply(SANDBOX_EXEC.encode_reply(SandboxExecReply(result="exit", stdout=b"\xff")))
    assert reply.stdout == b"\xff"
