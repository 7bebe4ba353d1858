"""The typed config tree, decoded once from TOML at the entry point.

Knows msgspec and the standard library only. Config Structs forbid unknown fields (a typo is an
error, not a silent default). Environment overrides (``ROLLMESH_<SECTION>__<FIELD>``) are applied
here, in ``load_config``, and nowhere else. Each actor receives only its slice; nothing mutates
config (the Structs are frozen).
"""

from __future__ import annotations

import ipaddress
import os
import tomllib
import warnings
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from rollmesh.config_keys import drop_deprecated_keys, refuse_retired_keys, rename_keys
from rollmesh.config_paths import resolve_config_paths
from rollmesh.config_types import ConfigSection, NonNegFloat, NonNegInt, PositiveFloat, PositiveInt
from rollmesh.inference_config import SGLangConfig
from rollmesh.run_config import EvalConfig, StageConfig, TrackingConfig, stage_names, stage_trainer_config
from rollmesh.observability_config import (
    TRACE_EXPORTER_KINDS,
    TRACE_EXPORTERS_PATTERN,
    DashboardConfig,
    TelemetryConfig,
)
from rollmesh.sandbox_config import (
    MAX_OUTPUT_CAP,
    SandboxConfig,
    SandboxLimitsConfig,
    SandboxMaximaConfig,
    SandboxProfileConfig,
)
from rollmesh.security_config import NatsCredentialsConfig, NatsTlsConfig, SecurityConfig
from rollmesh.trainer_config import MegatronConfig, TrainerConfig

# Sections that live in their own modules, named here too: ``rollmesh.config`` is where every
# part of the config tree is imported from.
__all__ = [
    "MAX_OUTPUT_CAP", "TRACE_EXPORTER_KINDS", "TRACE_EXPORTERS_PATTERN", "DashboardConfig", "MegatronConfig",
    "NatsCredentialsConfig", "NatsTlsConfig", "SandboxConfig", "SandboxLimitsConfig", "SandboxMaximaConfig",
    "SandboxProfileConfig", "SecurityConfig", "SGLangConfig", "TelemetryConfig", "TrainerConfig",
]


class NatsConfig(ConfigSection):
    # None: start an embedded nats-server (loopback, JetStream in the run directory).
    url: str | None = None
    connect_timeout_s: PositiveFloat = 5.0
    # How long JetStream waits for an ack before redelivering a rollout request.
    rollout_ack_wait_s: PositiveFloat = 60.0
    max_deliver: PositiveInt = 5
    # JetStream replicas of every stream and KV bucket: 1 on one server, 3 on a 3-node cluster.
    replicas: PositiveInt = 1


class RayConfig(ConfigSection):
    # None: start a local Ray in this process.
    address: str | None = None
    num_cpus: PositiveInt | None = None
    namespace_prefix: str = "rollmesh"
    # How often the mesh checks for role actors that crashed, and starts them again once Ray
    # re-created them.
    supervise_interval_s: PositiveFloat = 2.0
    # Custom Ray resources each actor of a role needs, on top of its accelerator grant: a cluster's
    # nodes say which roles they host by declaring these (``ray start --resources``, KubeRay's
    # rayStartParams), e.g. rollout = {rollmesh_rollout = 1}. Roles: ``PLACED_ROLES``. A role left
    # out is placed anywhere (one machine: every role, so the defaults set none).
    role_resources: dict[str, dict[str, PositiveFloat]] = {}
    # The node IP of a local Ray that rollmesh starts (not of a joined cluster, whose nodes have
    # their own). On loopback every Ray port (GCS, raylet, object manager, agents, workers) listens
    # on 127.0.0.1 only; with any other address Ray listens on all interfaces, guarded by its token
    # alone. "": Ray picks the host's address. Token auth is on either way (docs/security.md).
    node_ip_address: str = "127.0.0.1"

    def __post_init__(self) -> None:
        if self.node_ip_address:
            try:
                ipaddress.ip_address(self.node_ip_address)
            except ValueError:
                raise ValueError(f"ray.node_ip_address: {self.node_ip_address!r} is not an IP address "
                                 "(127.0.0.1 keeps a local Ray on loopback)") from None
        unknown = sorted(set(self.role_resources) - set(PLACED_ROLES))
        if unknown:
            raise ValueError(f"ray.role_resources: unknown roles {unknown}; roles are {list(PLACED_ROLES)}")
        for role, resources in self.role_resources.items():
            # Ray takes these as keyword arguments (num_cpus, num_gpus, memory), never in resources.
            builtin = sorted(set(resources) & RAY_BUILTIN_RESOURCES)
            if builtin:
                raise ValueError(f"ray.role_resources.{role}: {builtin} are Ray's own resources; "
                                 "name custom ones (accelerators are granted by [scheduler])")


# The roles ``ray.role_resources`` may place, named as the launcher spawns them.
PLACED_ROLES = ("scheduler", "sandbox", "prefill", "decode", "trainer", "resharder", "rollout")
RAY_BUILTIN_RESOURCES = frozenset({"CPU", "GPU", "memory", "object_store_memory"})


class ModelConfig(ConfigSection):
    """The model: a Hugging Face model directory (config.json, safetensors, the tokenizer files and
    a chat template; generation_config.json when present) of a Llama, Qwen2, Qwen3-MoE or Mixtral
    model. Its own tokenizer and chat template are used on every text path (docs/models.md)."""

    # The model directory. "": the demo's model (rollmesh.demo.demo_model), built into the run
    # directory when the mesh starts, so the embedded defaults need no download.
    path: str = ""
    dtype: Literal["float32", "bfloat16"] = "float32"
    # How tool calls and reasoning are read out of a generated turn (rollmesh.chat.TOOL_PARSERS,
    # REASONING_PARSERS). "": detected from the chat template, and the choice is logged.
    tool_parser: str = ""
    reasoning_parser: str = ""
    # The chat template's own extra arguments, passed to every render (e.g. enable_thinking).
    chat_template_kwargs: dict[str, Any] = {}




class InferenceConfig(ConfigSection):
    # "local": the torch engine (prefill and decode actors, runs anywhere). "sglang": SGLang
    # servers on GPU nodes, launched or attached to as [inference.sglang] says, one per decode
    # worker; there are no prefill actors (SGLang prefills, or disaggregates itself with "pd").
    backend: Literal["local", "sglang"] = "local"
    num_prefill_workers: PositiveInt = 1
    # With backend "sglang": the servers launched (with inference.sglang.urls: one per URL instead).
    num_decode_workers: PositiveInt = 1
    # "disaggregated": prefill workers hand KV pages to decode workers through the object store.
    # "aggregated": decode workers also prefill (no prefill actors), for small deployments.
    mode: Literal["disaggregated", "aggregated"] = "disaggregated"
    # Sequences a decode worker batches at once (continuous batching).
    max_batch: PositiveInt = 256
    torch_threads: PositiveInt = 1
    # Paged KV: tokens per block, and blocks per decode worker (0: enough for max_batch full
    # contexts). Parked sessions live in the same pool and are evicted when it runs short.
    kv_block_size: PositiveInt = 16
    kv_blocks: NonNegInt = 0

    # The SGLang servers (backend = "sglang"; docs/inference.md).
    sglang: SGLangConfig = SGLangConfig()

    @property
    def prefill_worker_count(self) -> int:
        """Prefill actors to spawn: none in the aggregated mode, nor with SGLang."""
        if self.backend == "sglang":
            return 0
        return self.num_prefill_workers if self.mode == "disaggregated" else 0

    @property
    def decode_worker_count(self) -> int:
        """Decode actors to spawn: one per attached SGLang URL when there are any."""
        if self.backend == "sglang" and self.sglang.urls:
            return len(self.sglang.urls)
        return self.num_decode_workers


class RolloutConfig(ConfigSection):
    num_workers: PositiveInt = 1
    # Rollouts one worker runs concurrently (each mostly waits on inference or a tool).
    max_concurrent: PositiveInt = 256
    # Registered task plugins, by import path "module:Class". "dataset" (DatasetTask) is the
    # built-in one that RL stages on a dataset use (docs/task-plugins.md).
    tasks: list[str] = msgspec.field(
        default_factory=lambda: ["rollmesh.rollout.molar_mass:MolarMassTask",
                                 "rollmesh.rollout.dataset_task:DatasetTask"]
    )
    # The reward functions ("package.module:function") a request to the "dataset" task may name:
    # a request is data, so only these are imported. `rollmesh train` fills it from its stages.
    reward_functions: list[str] = []
    tool_timeout_s: PositiveFloat = 10.0
    progress_events: bool = True
    # One sandbox lease per rollout: its profile, its TTL, and how often a running rollout
    # heartbeats it (well inside the TTL, so an hour-long rollout never loses its sandbox and a
    # dead worker's sandbox is reaped within a TTL).
    sandbox_profile: str = "default"
    sandbox_lease_ttl_s: PositiveFloat = 120.0
    sandbox_heartbeat_s: PositiveFloat = 30.0
    # How long a lease request waits for its sandbox before the attempt counts as an
    # infrastructure failure. Generous: with the warm pool empty on a loaded host, leases queue
    # behind slow creations for minutes; a request given up sooner only queues again, and the
    # broker makes no sandbox for a request whose wait (sent as its deadline) is over.
    sandbox_lease_wait_s: PositiveFloat = 300.0
    # A lease or exec refused for capacity is retried this many times before the rollout fails.
    sandbox_capacity_retries: NonNegInt = 5
    # An infrastructure failure (sandbox died or lost, broker or inference unreachable) is retried
    # this many times, from the last saved turn, after a pause that doubles each time (from
    # infra_retry_delay_s); then the rollout fails, typed.
    infra_retries: NonNegInt = 2
    infra_retry_delay_s: NonNegFloat = 1.0
    # A turn's generation not back after this long is cancelled (the decode worker aborts the
    # request and frees its slot) and is an infrastructure failure (inference_error) like those
    # above, retried from the last saved turn: a lost call never hangs its rollout and its group.
    # Generous: a long turn queued behind a full batch on a busy worker may take many minutes.
    generate_timeout_s: PositiveFloat = 1800.0
    # Snapshot the workspace after every tool call, so a rollout whose sandbox was lost resumes
    # with its files. Off by default: the demo's tools keep no state in the workspace.
    snapshot_workspace: bool = False
    # A rollout's TokenTrace travels inline in RolloutCompleted (and in its saved state) up to
    # this many bytes of JSON; above, it goes to the JetStream object store and the message
    # carries trajectory_ref (docs/long-trajectories.md). 256 KiB: about 11K tokens inline.
    inline_trajectory_bytes: PositiveInt = 262_144
    # Stored trajectories older than this are removed by the object store (the trainer must have
    # admitted them by then; a RolloutCompleted whose trajectory expired is counted as lost).
    trajectory_ttl_s: PositiveFloat = 7 * 24 * 3600.0
    # After each rollout its tokens are checked against a whole render of its conversation;
    # differences are counted (RolloutCompleted.tokenization_mismatches). True: a difference in text
    # the model did not generate (a bug in appending) fails the rollout as tokenization_error; a
    # history rewrite the model family's rules document (Qwen3 dropping earlier <think> blocks,
    # what check-template calls "expected") is counted as history_rewrite and fails nothing.
    strict_tokenization: bool = False
    # Templates that rewrite history (Qwen3 drops earlier reasoning; docs/multi-turn-tokens.md).
    # "keep_sampled": one training sample per rollout, the model's real context: the tokens it saw
    # and generated, logprobs that match; its later turns see history a deployed model would not.
    # "split": a new training sample starts where the template's whole render stops extending the
    # current one (as prime-rl does); each sample is a prefix the template would render, trained
    # with the rollout's reward and advantage; more prompt tokens are recomputed (each split
    # re-prefills the rewritten history), and no sample trains on stale history.
    history_rewrite: Literal["keep_sampled", "split"] = "keep_sampled"

    def __post_init__(self) -> None:
        if self.sandbox_heartbeat_s * 2 > self.sandbox_lease_ttl_s:
            raise ValueError("sandbox_heartbeat_s must be at most half of sandbox_lease_ttl_s")


class ResharderConfig(ConfigSection):
    max_shard_bytes: PositiveInt = 1 << 20
    # Megatron checkpoints: shards converted at once, and the memory they may hold together.
    convert_workers: PositiveInt = 2
    convert_memory_budget_bytes: PositiveInt = 4 << 30
    # "threads" in the resharder's process, or "ray" tasks anywhere in the cluster (the
    # checkpoint and export directories must then be on a file system every node sees).
    convert_backend: Literal["threads", "ray"] = "threads"


class SchedulerConfig(ConfigSection):
    # Declared accelerators, so grants work with zero real GPUs.
    total_gpus: NonNegInt = 0
    # Ray resource the grants are expressed in ("GPU" on a GPU cluster).
    resource: str = "rollmesh_gpu"
    # Role -> accelerators granted at start.
    grants: dict[str, float] = {}
    # Lending idle accelerators to simulation jobs: a job whose preemption grace period is longer
    # than this may only run on accelerators no RL role is guaranteed, since RL announces its
    # demand about this far ahead and must not wait for a slow leaver.
    max_loan_grace_s: NonNegFloat = 300.0
    # Jobs leave some time before their preemption deadline (a margin for saving); a deadline may
    # run past RL's announced reservation by as much as they were seen to, so they leave as RL
    # starts. This share of the run's time bounds that slack in all: what RL waits if every job
    # used its whole grace (0: deadlines never pass a reservation).
    rl_wait_budget: Annotated[float, Meta(ge=0.0, le=1.0)] = 0.02
    # The live scheduler's timers: how often it checks deadlines and planned reclaims at least,
    # and how often it publishes its accounting on rl.<ns>.sched.utilization.
    tick_s: PositiveFloat = 1.0
    report_every_s: PositiveFloat = 10.0
    # Decode loans: up to this many idle accelerators are lent to decode as extra decode workers
    # (the rollout workers route new sessions to them), taken back first when RL or a job needs
    # them; a worker gets decode_loan_drain_s between being announced gone and being stopped.
    # (Were elastic_decode and elastic_drain_s: config_keys.RENAMED_KEYS.)
    decode_loans: NonNegInt = 0
    decode_loan_drain_s: NonNegFloat = 2.0
    # Lend the mesh's own inference roles' accelerators (their start grants) while a role is
    # idle: its workers release their weights and KV to host memory, a simulation job runs
    # there, and when the role's demand returns (RoleDemandChanged) the job is preempted and the
    # memory resumed. Refused at start while the trainer, the resharder or SGLang workers hold
    # accelerators (docs/scheduler.md says why). Off: roles keep their start grants for life
    # and only free accelerators are lent.
    lend_role_accelerators: bool = False

    @property
    def elastic_decode(self) -> int:
        """Deprecated: ``decode_loans``."""
        warnings.warn("SchedulerConfig.elastic_decode is now decode_loans; the old name will be removed in the "
                      "next release", DeprecationWarning, stacklevel=2)
        return self.decode_loans

    @property
    def elastic_drain_s(self) -> float:
        """Deprecated: ``decode_loan_drain_s``."""
        warnings.warn("SchedulerConfig.elastic_drain_s is now decode_loan_drain_s; the old name will be removed "
                      "in the next release", DeprecationWarning, stacklevel=2)
        return self.decode_loan_drain_s


class ServeConfig(ConfigSection):
    enabled: bool = True
    host: str = "127.0.0.1"
    port: Annotated[int, Meta(ge=0, le=65535)] = 8000
    # A file holding the API key (``ROLLMESH_API_KEY`` wins when set). Required (startup fails
    # without one) when host is not loopback or security.enabled; on loopback without security
    # no key is needed unless one is configured.
    api_key_file: str = ""
    # HTTPS: a PEM certificate (chain) and its private key; both or neither.
    tls_cert_file: str = ""
    tls_key_file: str = ""
    # Chat sessions (/v1/chat/completions with a session_id; rollmesh.serve_apps.chat_sessions):
    # one untouched this long is forgotten, and at most this many are kept (a new one evicts the
    # least recently used idle one).
    session_ttl_s: PositiveFloat = 3600.0
    max_sessions: PositiveInt = 1024

    def __post_init__(self) -> None:
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ValueError("serve.tls_cert_file and serve.tls_key_file go together")


class DemoConfig(ConfigSection):
    """The demo's model: its random weights' seed. The demo itself is a run file
    (rollmesh/deploy_defaults/demo.toml) that `rollmesh demo` sizes from its options."""

    seed: int = 0


class RollmeshConfig(ConfigSection):
    namespace: str = "default"
    run_root: str = ".rollmesh/runs"
    nats: NatsConfig = NatsConfig()
    ray: RayConfig = RayConfig()
    telemetry: TelemetryConfig = TelemetryConfig()
    model: ModelConfig = ModelConfig()
    inference: InferenceConfig = InferenceConfig()
    rollout: RolloutConfig = RolloutConfig()
    sandbox: SandboxConfig = SandboxConfig()
    trainer: TrainerConfig = TrainerConfig()
    resharder: ResharderConfig = ResharderConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    serve: ServeConfig = ServeConfig()
    demo: DemoConfig = DemoConfig()
    dashboard: DashboardConfig = DashboardConfig()
    security: SecurityConfig = SecurityConfig()
    # A training job's stages, run in order by `rollmesh train`, its held-out evaluations and the
    # trackers it reports to (rollmesh/run_config.py, docs/training.md).
    stages: list[StageConfig] = []
    eval: list[EvalConfig] = []
    tracking: TrackingConfig = TrackingConfig()

    def __post_init__(self) -> None:
        for name, stage in zip(stage_names(self.stages), self.stages):
            try:
                stage_trainer_config(self.trainer, stage)
            except (msgspec.ValidationError, TypeError, ValueError) as exc:
                raise ValueError(f"stage {name!r}: trainer settings: {exc}") from exc
        if self.inference.backend == "sglang" and self.scheduler.decode_loans:
            # Lent decode workers run the torch engine; they would serve other weights and tokens.
            raise ValueError("scheduler.decode_loans needs inference.backend = 'local'")


class ConfigError(ValueError):
    """The config file or an override is invalid; ``path`` names the offending field."""

    def __init__(self, message: str, *, source: str, path: str = "") -> None:
        super().__init__(f"{source}: {message}")
        self.source = source
        self.path = path


ENV_PREFIX = "ROLLMESH_"
DEFAULT_CONFIG_PATH = Path(__file__).parent / "deploy_defaults" / "local.toml"


def load_config(
    path: str | Path | None = None,
    *,
    environ: dict[str, str] | None = None,
    overrides: dict[str, Any] | None = None,
) -> RollmeshConfig:
    """Read TOML (the embedded defaults when ``path`` is None), apply env overrides, validate.
    Security file paths come out absolute: the file's relative to its directory, the env's and
    ``overrides``' relative to the working directory (rollmesh/config_paths.py)."""
    source = Path(path) if path else DEFAULT_CONFIG_PATH
    try:
        raw = tomllib.loads(source.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(str(exc), source=str(source)) from exc
    resolve_config_paths(raw, source.absolute().parent)
    env = _env_overrides(os.environ if environ is None else environ)
    for dotted, (variable, value) in env.items():
        _set_dotted(raw, dotted, value, source=variable)
    for dotted, value in (overrides or {}).items():
        _set_dotted(raw, dotted, value, source="overrides")
    resolve_config_paths(raw, Path.cwd())
    refuse_retired_keys(raw, source=str(source), env=env)
    drop_deprecated_keys(raw, source=str(source))
    rename_keys(raw, source=str(source), env=env)
    try:
        return msgspec.convert(raw, RollmeshConfig, strict=False)
    except msgspec.ValidationError as exc:
        path = _error_path(str(exc))
        variable = next((name for dotted, (name, _) in env.items() if dotted == path), None)
        raise ConfigError(str(exc), source=variable or str(source), path=path) from exc


RUN_CONFIG_FILE = "config.json"


def save_run_config(run_dir: str | Path, config: RollmeshConfig) -> Path:
    """Write the run's whole config into its run directory, so ``up --resume`` runs it again."""
    path = Path(run_dir) / RUN_CONFIG_FILE
    staging = path.with_suffix(".json.tmp")
    staging.write_bytes(msgspec.json.format(msgspec.json.encode(config)))
    staging.replace(path)
    return path


def load_run_config(run_dir: str | Path, *, overrides: dict[str, Any] | None = None,
                    file_name: str = RUN_CONFIG_FILE) -> RollmeshConfig:
    """The config a run was started with (``save_run_config``), with ``overrides`` on top."""
    source = Path(run_dir) / file_name
    try:
        raw = msgspec.json.decode(source.read_bytes())
    except (OSError, msgspec.DecodeError) as exc:
        raise ConfigError(f"no config of an earlier run here: {exc}", source=str(source)) from exc
    for dotted, value in (overrides or {}).items():
        _set_dotted(raw, dotted, value, source="overrides")
    resolve_config_paths(raw, Path.cwd())  # the saved ones are absolute already
    refuse_retired_keys(raw, source=str(source))
    drop_deprecated_keys(raw, source=str(source))
    rename_keys(raw, source=str(source))  # a run saved by the last release
    try:
        return msgspec.convert(raw, RollmeshConfig, strict=False)
    except msgspec.ValidationError as exc:
        raise ConfigError(str(exc), source=str(source), path=_error_path(str(exc))) from exc


_TOP_LEVEL_VALUES = frozenset({"namespace", "run_root"})


def _error_path(message: str) -> str:
    """msgspec says "... - at `$.trainer.lr`"; return "trainer.lr" ("" when it names none)."""
    _, found, path = message.rpartition("at `$.")
    return path.rstrip("`").split("[")[0] if found else ""


def _env_overrides(environ: dict[str, str]) -> dict[str, tuple[str, Any]]:
    """``ROLLMESH_TRAINER__LR=1e-3`` -> ``{"trainer.lr": ("ROLLMESH_TRAINER__LR", 1e-3)}``;
    values parse as TOML scalars."""
    found: dict[str, tuple[str, Any]] = {}
    for key, text in environ.items():
        if not key.startswith(ENV_PREFIX):
            continue
        dotted = key[len(ENV_PREFIX):].lower().replace("__", ".")
        # A key without a section must name a top-level value (ROLLMESH_NAMESPACE), so other
        # ROLLMESH_* variables (secrets among them) are never mistaken for config.
        if "." not in dotted and dotted not in _TOP_LEVEL_VALUES:
            continue
        try:
            found[dotted] = (key, tomllib.loads(f"v = {text}")["v"])
        except tomllib.TOMLDecodeError:
            found[dotted] = (key, text)
    return found


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any, *, source: str) -> None:
    *parents, leaf = dotted.split(".")
    node = tree
    for depth, name in enumerate(parents):
        node = node.setdefault(name, {})
        if not isinstance(node, dict):
            where = ".".join(parents[: depth + 1])
            raise ConfigError(f"{where} is a value, not a section; cannot set {dotted}",
                              source=source, path=dotted)
    node[leaf] = value
