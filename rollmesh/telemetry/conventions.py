"""Tracing conventions: service names, span names and attribute keys, defined once.

Knows nothing but strings (no OpenTelemetry import), so any layer may use it; docs/tracing.md
explains each name. Our own keys carry the ``rl.`` prefix; ``messaging.*`` and ``gen_ai.*`` keys
follow the OpenTelemetry semantic conventions. Ids always go in attributes, never in span names.
"""

from __future__ import annotations

# -- service.name: "<prefix>.<component>"; the prefix is OTEL_SERVICE_NAME, else "rollmesh" ------
DEFAULT_SERVICE_PREFIX = "rollmesh"
SERVICE_COMPONENTS = (
    "prefill", "decode", "rollout", "trainer", "resharder", "sandbox", "scheduler", "serve", "cli",
)
# Actor roles (``RoleActor.role``) whose component name differs from the role.
_ROLE_COMPONENTS = {
    "rollout_worker": "rollout",
    "sandbox_broker": "sandbox",
    "gpu_scheduler": "scheduler",
}


def component_of(role: str) -> str:
    """The service component for an actor role ("rollout_worker" -> "rollout")."""
    return _ROLE_COMPONENTS.get(role, role)


# Resource attribute naming the actor ("decode-0"); service.instance.id stays the SDK's uuid.
RESOURCE_ACTOR = "rollmesh.actor"

# -- span names (subject templates go after "publish"/"process"/"request", never subjects) -------
SPAN_ROLLOUT = "rollout"
SPAN_TURN = "turn"
SPAN_GENERATE = "generate"
SPAN_TOOL = "tool"
SPAN_TRAIN_STEP = "train_step"
SPAN_SUBMIT = "submit"  # the CLI publishing one rollout request
SPAN_SANDBOX_EXEC = "sandbox.exec"  # the broker running one exec in a leased sandbox
SPAN_SANDBOX_RUN = "sandbox run"  # `rollmesh sandbox run`: its lease, exec and release

# -- rl.* attributes -------------------------------------------------------------------------------
RL_ROLLOUT_ID = "rl.rollout_id"
RL_TURN_INDEX = "rl.turn.index"
RL_WEIGHT_VERSION = "rl.weight_version"              # the version a message or checkpoint carries
RL_WEIGHT_VERSION_FIRST = "rl.weight_version.first"  # first generated token's version (generate)
RL_WEIGHT_VERSION_LAST = "rl.weight_version.last"    # last generated token's version (generate)
RL_SANDBOX_LEASE_ID = "rl.sandbox.lease_id"
RL_SANDBOX_EXEC_ID = "rl.sandbox.exec_id"
RL_SANDBOX_RESULT = "rl.sandbox.result"    # exit, timeout, oom, sandbox_died... (typed)
RL_SANDBOX_EXIT_CODE = "rl.sandbox.exit_code"
RL_TOOL_NAME = "rl.tool.name"
RL_TRAJECTORY_ID = "rl.trajectory_id"
RL_TRAINER_STEP = "rl.trainer.step"
RL_TASK = "rl.task"

# -- messaging.* (OpenTelemetry messaging conventions) ---------------------------------------------
MESSAGING_SYSTEM = "messaging.system"
MESSAGING_SYSTEM_NATS = "nats"
MESSAGING_DESTINATION_NAME = "messaging.destination.name"
MESSAGING_DESTINATION_TEMPLATE = "messaging.destination.template"
MESSAGING_OPERATION_TYPE = "messaging.operation.type"
MESSAGING_OPERATION_NAME = "messaging.operation.name"
MESSAGING_MESSAGE_BODY_SIZE = "messaging.message.body.size"

# -- gen_ai.* (OpenTelemetry GenAI conventions) ----------------------------------------------------
GEN_AI_OPERATION_NAME = "gen_ai.operation.name"
GEN_AI_REQUEST_MODEL = "gen_ai.request.model"
GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
GEN_AI_REQUEST_TEMPERATURE = "gen_ai.request.temperature"
GEN_AI_USAGE_INPUT_TOKENS = "gen_ai.usage.input_tokens"
GEN_AI_USAGE_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
GEN_AI_RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"


def message_attributes(rollout_id: str | None, weight_version: int | None) -> dict[str, object]:
    """The ``rl.*`` attributes for a message's ids (absent ids are left out)."""
    attributes: dict[str, object] = {}
    if rollout_id is not None:
        attributes[RL_ROLLOUT_ID] = rollout_id
    if weight_version is not None:
        attributes[RL_WEIGHT_VERSION] = weight_version
    return attributes
