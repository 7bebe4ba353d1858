"""Least-privilege NATS: what each role may publish and subscribe to, and the server config for it.

Knows the subject templates, the stream and bucket names and nats-server's config syntax; knows
nothing of nats-py, Ray or where credentials come from (``rollmesh.bus.security``). This table is
the one source for the embedded server (``security.enabled``) and for cluster manifests
(``deploy/nats/``), so a role's rights are written down once.

A role reads a JetStream stream through a durable pull consumer (``consume``): consumer info and
create, fetch (``MSG.NEXT``) and acks (``$JS.ACK``). Each role's request/reply inbox is its own
(``_INBOX.<ns>.<role>.>``, set with nats-py's ``inbox_prefix``), so no role reads another's
replies; responders (sandbox broker, scheduler) answer through ``allow_responses``, which lets
them publish only to the reply subject of a request they received. Only ``mesh`` (the launcher
and operator tools) may create or change streams.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from rollmesh.bus.streams import (
    checkpoints_stream,
    rollout_requests_stream,
    rollout_results_stream,
    rollout_state_bucket,
    scheduling_stream,
    weights_stream,
)
from rollmesh.messages import Subject, check_namespace
from rollmesh.messages.subjects import (
    CHECKPOINT_CONVERTED,
    CHECKPOINT_FAILED,
    CHECKPOINT_SAVED,
    DEAD_LETTERED,
    GPU_GRANTED,
    GPU_RELEASED,
    METRICS_REPORTED,
    PREEMPTION_ACKNOWLEDGED,
    PREEMPTION_REQUESTED,
    ROLE_DEMAND,
    ROLLOUT_COMPLETED,
    ROLLOUT_FAILED,
    ROLLOUT_PROGRESSED,
    ROLLOUT_REQUESTED,
    RUN_REGISTERED,
    SANDBOX_DOWNLOAD,
    SANDBOX_EXEC,
    SANDBOX_FORK,
    SANDBOX_HEARTBEAT,
    SANDBOX_LEASE,
    SANDBOX_LOAD,
    SANDBOX_OUTPUT,
    SANDBOX_RELEASE,
    SANDBOX_SNAPSHOT,
    SANDBOX_UPLOAD,
    SCHED_STATUS,
    SCHED_UTILIZATION,
    SIM_ENDED,
    SIM_STARTED,
    SIM_SUBMITTED,
    TRAINER_STEPPED,
    GROUP_DROPPED,
    WEIGHTS_ACTIVATED,
    WEIGHTS_PUBLISHED,
    ANY_BROKER,
    broker_subject,
)

# "mesh": the launcher and operator tools (stream setup, `rollmesh sched`, `rollmesh sandbox`).
# "dashboard": the Serve app's follower of the mesh (its live dashboard, its decode loans), which
# only watches.
ROLES = ("mesh", "rollout_worker", "trainer", "inference", "sandbox_broker", "scheduler",
         "resharder", "client", "dashboard")

# An actor's ``RoleActor.role`` -> the permission role it connects as.
ACTOR_ROLES = {
    "rollout_worker": "rollout_worker",
    "trainer": "trainer",
    "prefill": "inference",
    "decode": "inference",
    "sandbox_broker": "sandbox_broker",
    "gpu_scheduler": "scheduler",
    "resharder": "resharder",
}

SANDBOX_REQUESTS = (SANDBOX_LEASE, SANDBOX_EXEC, SANDBOX_UPLOAD, SANDBOX_DOWNLOAD, SANDBOX_SNAPSHOT,
                    SANDBOX_FORK, SANDBOX_HEARTBEAT, SANDBOX_RELEASE)


# Broker <id> of several (``sandbox.brokers`` > 1) connects as its own user, role
# "sandbox_broker_<id>" (ids "0", "1", ...), with the rights of ``sandbox_broker`` narrowed to its
# own subjects and lease-table keys. A single broker keeps the ``sandbox_broker`` role.
BROKER_ROLE_PREFIX = "sandbox_broker_"
_BROKER_ROLE = re.compile(r"^sandbox_broker_(0|[1-9][0-9]{0,5})$")


def broker_role(broker_id: str) -> str:
    """The NATS role of broker ``broker_id`` ("0", "1", ...) of several."""
    role = BROKER_ROLE_PREFIX + broker_id
    if not _BROKER_ROLE.match(role):
        raise ValueError(f"sandbox broker id {broker_id!r} has no role of its own: ids are 0, 1, 2, ...")
    return role


def is_role(role: str) -> bool:
    """A fixed role of ``ROLES`` or one broker's own (``broker_role``)."""
    return role in _ROLE_BUILDERS or bool(_BROKER_ROLE.match(role))


def _any_broker(ns: str, *requests: Subject) -> list[str]:
    """Every broker's own subjects for ``requests`` (rl.<ns>.sandbox.b.*.exec, ...): a client may
    hold leases on any broker, and the shared ``sandbox_broker`` role serves any."""
    return [broker_subject(subject, ANY_BROKER).format(ns) for subject in requests]


def routed_experts_bucket(namespace: str) -> str:
    # Mirrors rollmesh.bus.routed_experts_store (which imports numpy; this table must not).
    return f"RL_{check_namespace(namespace)}_ROUTED_EXPERTS"


def trajectories_bucket(namespace: str) -> str:
    # Mirrors rollmesh.bus.trajectory_store, like routed_experts_bucket.
    return f"RL_{check_namespace(namespace)}_TRAJECTORIES"


def sandbox_snapshots_bucket(namespace: str) -> str:
    # Mirrors rollmesh.bus.sandbox_snapshots, like routed_experts_bucket.
    return f"RL_{check_namespace(namespace)}_SANDBOX_SNAPSHOTS"


@dataclass(frozen=True)
class RolePermissions:
    """One role's allow lists (concrete subjects, wildcards allowed) for one namespace."""

    role: str
    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    # Publish to the reply subject of a request it received (request/reply responders).
    allow_responses: bool = False

    def as_server_block(self) -> dict[str, object]:
        """The ``permissions`` value of a nats-server user entry."""
        block: dict[str, object] = {"publish": {"allow": list(self.publish)},
                                    "subscribe": {"allow": list(self.subscribe)}}
        if self.allow_responses:
            block["allow_responses"] = True
        return block

    def as_jwt_permissions(self) -> dict[str, object]:
        """The same rights as the ``nats`` claims of a user JWT, for a server in operator (JWT)
        mode whose users connect with ``.creds`` files (nsc: ``--allow-pub``/``--allow-sub``)."""
        claims: dict[str, object] = {"pub": {"allow": list(self.publish)},
                                     "sub": {"allow": list(self.subscribe)}}
        if self.allow_responses:
            claims["resp"] = {"max": 1, "ttl": 0}  # one reply per request, the server's default window
        return claims


def inbox_prefix(role: str, namespace: str) -> str:
    """The reply-inbox prefix a role's connections use (nats-py ``inbox_prefix``)."""
    return f"_INBOX.{check_namespace(namespace)}.{_check_role(role)}"


def role_permissions(role: str, namespace: str) -> RolePermissions:
    """What ``role`` may publish and subscribe to in ``namespace``."""
    ns = check_namespace(namespace)
    builder = _builder(role)
    publish, subscribe, responds = builder(ns)
    subscribe = [*subscribe, f"{inbox_prefix(role, ns)}.>"]
    return RolePermissions(role, _unique(publish), _unique(subscribe), responds)


@dataclass(frozen=True)
class ServerUser:
    """One user entry of the server config: a role and how it authenticates (an nkey public key,
    or a user name and password). Passwords may be bcrypt hashes ("$2a$...")."""

    role: str
    nkey: str = ""
    user: str = ""
    password: str = ""

    def __post_init__(self) -> None:
        if bool(self.nkey) == bool(self.user):
            raise ValueError(f"user of role {self.role!r}: give either an nkey or a user name")


def render_authorization(users: Sequence[ServerUser], namespace: str) -> str:
    """A nats-server ``authorization { users = [...] }`` block giving each user its role's rights
    (users of the global account, where JetStream is enabled by ``-js``)."""
    return "authorization {\n  users = [\n" + "".join(
        f"    {_user_entry(user, namespace)}\n" for user in users) + "  ]\n}\n"


def _user_entry(user: ServerUser, namespace: str) -> str:
    entry: dict[str, object] = {"nkey": user.nkey} if user.nkey else {
        "user": user.user, "password": user.password}
    entry["permissions"] = role_permissions(user.role, namespace).as_server_block()
    # JSON is valid nats-server config, and quoting keeps "$JS..." from reading as a variable.
    return json.dumps(entry)


# -- the table -------------------------------------------------------------------------------

_Lists = tuple[list[str], list[str], bool]


def _subjects(ns: str, *bound: Subject) -> list[str]:
    return [s.format(ns) for s in bound]


def _consume(stream: str) -> list[str]:
    """Publish rights to read ``stream`` through durable pull consumers (create, fetch, ack)."""
    return [f"$JS.API.CONSUMER.INFO.{stream}.>", f"$JS.API.CONSUMER.CREATE.{stream}.>",
            f"$JS.API.CONSUMER.DURABLE.CREATE.{stream}.>", f"$JS.API.CONSUMER.MSG.NEXT.{stream}.>",
            f"$JS.ACK.{stream}.>"]


def _read_stream(stream: str) -> list[str]:
    """Publish rights to look a stream up and get single messages from it."""
    return [f"$JS.API.STREAM.INFO.{stream}", f"$JS.API.STREAM.MSG.GET.{stream}",
            f"$JS.API.DIRECT.GET.{stream}", f"$JS.API.DIRECT.GET.{stream}.>"]


def _rollout_state(ns: str) -> list[str]:
    bucket = rollout_state_bucket(ns)
    return [*_read_stream(f"KV_{bucket}"), f"$KV.{bucket}.>"]


def _sandbox_leases(ns: str) -> list[str]:
    # Mirrors rollmesh.bus.sandbox_leases: the brokers' durable lease table, made by its first
    # broker, listed (an ordered consumer) by a broker re-adopting its leases at start.
    stream = f"KV_RL_{check_namespace(ns)}_SANDBOX_LEASES"
    # nats-py's KV watch asks for its consumer's info once it is made.
    return [*_read_stream(stream), f"$JS.API.STREAM.CREATE.{stream}", f"$JS.API.CONSUMER.CREATE.{stream}",
            f"$JS.API.CONSUMER.CREATE.{stream}.>", f"$JS.API.CONSUMER.INFO.{stream}.>", f"$JS.API.CONSUMER.DELETE.{stream}.>", f"$JS.FC.{stream}.>",
            f"$KV.RL_{check_namespace(ns)}_SANDBOX_LEASES.>"]


def _object_bucket(bucket: str, *, write: bool) -> list[str]:
    stream = f"OBJ_{bucket}"
    # An object is read through an ordered push consumer (flow-control replies go to $JS.FC);
    # nats-py finds that consumer's stream by its subject first ($JS.API.STREAM.NAMES).
    rights = [*_read_stream(stream), "$JS.API.STREAM.NAMES", f"$JS.API.CONSUMER.CREATE.{stream}.>",
              f"$JS.API.CONSUMER.CREATE.{stream}", f"$JS.FC.{stream}.>"]
    if write:
        # The bucket is made by its first writer; a put replaces chunks (purge) under $O.
        rights += [f"$JS.API.STREAM.CREATE.{stream}", f"$JS.API.STREAM.PURGE.{stream}",
                   f"$O.{bucket}.>"]
    return rights


def _shell(ns: str) -> list[str]:
    """What every actor's shell publishes: dead letters and its metric snapshots."""
    return _subjects(ns, DEAD_LETTERED, METRICS_REPORTED)


def _mesh(ns: str) -> _Lists:
    # Stream setup and operator tools: everything in the namespace and the whole JetStream API.
    return [f"rl.{ns}.>", "$JS.API.>", "$JS.ACK.>", "$JS.FC.>", "$KV.>", "$O.>"], \
        [f"rl.{ns}.>"], True


def _rollout_worker(ns: str) -> _Lists:
    publish = [
        *_subjects(ns, ROLLOUT_COMPLETED, ROLLOUT_FAILED, ROLLOUT_PROGRESSED, SCHED_STATUS,
                   *SANDBOX_REQUESTS), *_any_broker(ns, *SANDBOX_REQUESTS),
        *_shell(ns), *_consume(rollout_requests_stream(ns)), *_rollout_state(ns),
        *_object_bucket(routed_experts_bucket(ns), write=True),
        *_object_bucket(trajectories_bucket(ns), write=True),
    ]
    subscribe = _subjects(ns, GPU_GRANTED, GPU_RELEASED, SANDBOX_OUTPUT)
    return publish, subscribe, False


def _trainer(ns: str) -> _Lists:
    publish = [
        *_subjects(ns, WEIGHTS_PUBLISHED, TRAINER_STEPPED, GROUP_DROPPED, CHECKPOINT_SAVED),
        *_shell(ns), *_consume(rollout_results_stream(ns)),
        *_object_bucket(routed_experts_bucket(ns), write=False),
        *_object_bucket(trajectories_bucket(ns), write=False),
    ]
    return publish, [], False


def _inference(ns: str) -> _Lists:
    publish = [*_subjects(ns, WEIGHTS_ACTIVATED), *_shell(ns),
               *_read_stream(weights_stream(ns))]
    return publish, _subjects(ns, WEIGHTS_PUBLISHED), False


def _sandbox_broker(ns: str) -> _Lists:
    # Brokers hear each other's load, and a broker may hand a lease on to another's own subject.
    # Any broker reads any broker's snapshots (a lost broker's rollouts fork theirs elsewhere).
    return [*_subjects(ns, SANDBOX_OUTPUT, SANDBOX_LOAD), *_any_broker(ns, SANDBOX_LEASE), *_shell(ns),
            *_sandbox_leases(ns), *_object_bucket(sandbox_snapshots_bucket(ns), write=True)], \
        [*_subjects(ns, *SANDBOX_REQUESTS, SANDBOX_LOAD), *_any_broker(ns, *SANDBOX_REQUESTS)], True


def _broker_actor_name(broker_id: str) -> str:
    # Mirrors rollmesh.sandbox_brokers.broker_name: a broker's lease-table keys begin with its
    # actor's name (rollmesh.bus.sandbox_leases), "sandbox-broker" for broker 0.
    return "sandbox-broker" if broker_id == "0" else f"sandbox-broker-{broker_id}"


def _one_broker(ns: str, broker_id: str) -> _Lists:
    """Broker ``broker_id`` of several: ``sandbox_broker``'s rights less every broker's own
    subjects, the shared per-lease subjects (its leases are named and reach it on its own) and
    writes to the whole lease table; plus its own subjects, the shared lease subject (the entry
    point every broker answers as a queue group), forwarding a lease to another's lease subject,
    and writes to its own lease keys. Reading the lease table stays bucket-wide (a KV watch
    asks for its consumer without naming its filter in the API subject)."""
    publish, subscribe, responds = _sandbox_broker(ns)
    leases = f"$KV.RL_{ns}_SANDBOX_LEASES"
    narrowed = {*_any_broker(ns, *SANDBOX_REQUESTS), *_subjects(ns, *SANDBOX_REQUESTS), f"{leases}.>"}
    own = [broker_subject(subject, broker_id).format(ns) for subject in SANDBOX_REQUESTS]
    return [*(s for s in publish if s not in narrowed), *_any_broker(ns, SANDBOX_LEASE),
            f"{leases}.{_broker_actor_name(broker_id)}.>"], \
        [*(s for s in subscribe if s not in narrowed), *_subjects(ns, SANDBOX_LEASE), *own], responds


def _scheduler(ns: str) -> _Lists:
    publish = [
        *_subjects(ns, GPU_GRANTED, GPU_RELEASED, PREEMPTION_REQUESTED, PREEMPTION_ACKNOWLEDGED,
                   SIM_STARTED, SIM_ENDED, SCHED_UTILIZATION),
        *_shell(ns), *_consume(scheduling_stream(ns)),
    ]
    # Metric snapshots too: how long the RL roles' workers compute is the busy time it accounts.
    subscribe = _subjects(ns, SCHED_STATUS, SIM_SUBMITTED, ROLE_DEMAND, RUN_REGISTERED, METRICS_REPORTED)
    return publish, subscribe, True


def _resharder(ns: str) -> _Lists:
    publish = [*_subjects(ns, CHECKPOINT_CONVERTED, CHECKPOINT_FAILED), *_shell(ns),
               *_consume(checkpoints_stream(ns))]
    return publish, [], False


def _client(ns: str) -> _Lists:
    # Publish rollout requests, read progress and results (trainer steps are training progress),
    # with the stored trajectories of long results; what its watcher cannot read it dead-letters.
    return [*_subjects(ns, ROLLOUT_REQUESTED, DEAD_LETTERED),
            *_object_bucket(trajectories_bucket(ns), write=False)], \
        _subjects(ns, ROLLOUT_PROGRESSED, ROLLOUT_COMPLETED, ROLLOUT_FAILED, TRAINER_STEPPED,
                  GROUP_DROPPED), False


def _dashboard(ns: str) -> _Lists:
    # The Serve replica's follower of the mesh: watches with core subscriptions (never a queue's
    # consumer; the decode loans its router uses among them), dead-letters what it cannot read,
    # and asks the scheduler its status.
    watched = _subjects(ns, ROLLOUT_REQUESTED, ROLLOUT_PROGRESSED, ROLLOUT_COMPLETED, ROLLOUT_FAILED,
                        TRAINER_STEPPED, WEIGHTS_ACTIVATED, WEIGHTS_PUBLISHED, SCHED_UTILIZATION,
                        GPU_GRANTED, GPU_RELEASED)
    return _subjects(ns, SCHED_STATUS, DEAD_LETTERED), watched, False


_ROLE_BUILDERS = {
    "mesh": _mesh, "rollout_worker": _rollout_worker, "trainer": _trainer, "inference": _inference,
    "sandbox_broker": _sandbox_broker, "scheduler": _scheduler, "resharder": _resharder,
    "client": _client, "dashboard": _dashboard,
}


def _check_role(role: str) -> str:
    if not is_role(role):
        raise ValueError(f"unknown NATS role {role!r}; roles: {', '.join(ROLES)}, "
                         f"and {BROKER_ROLE_PREFIX}<id> for broker <id> of several")
    return role


def _builder(role: str):
    if role in _ROLE_BUILDERS:
        return _ROLE_BUILDERS[role]
    broker_id = _check_role(role)[len(BROKER_ROLE_PREFIX):]
    return lambda ns: _one_broker(ns, broker_id)


def _unique(items: Iterable[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(items))

