"""The sandbox broker's config section: backends, named limit profiles with warm pools, maxima,
admission, transfers and snapshots (``[sandbox]``).

Knows msgspec only; part of the config tree ``rollmesh.config`` loads.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from rollmesh.config_types import ConfigSection, MiB, NonNegInt, PositiveFloat, PositiveInt

# An exec reply carries its output whole, so the largest output cap must leave room in one NATS
# message (the embedded server allows 8 MiB).
MAX_OUTPUT_CAP = 6 * MiB


class SandboxLimitsConfig(ConfigSection):
    """Limits of one sandbox. As a profile: what a lease gets; as ``maxima``: the most a lease
    may ask for. Defaults: the documented "default" profile."""

    memory_mb: Annotated[int, Meta(ge=16)] = 2048
    pids: Annotated[int, Meta(ge=8)] = 256
    workspace_mb: PositiveInt = 2048
    exec_timeout_s: PositiveFloat = 600.0  # default and maximum wall-clock time of one exec
    cpu_s: PositiveInt = 600  # CPU seconds of each exec'd process
    file_size_mb: PositiveInt = 1024
    max_output_bytes: Annotated[int, Meta(ge=1024, le=MAX_OUTPUT_CAP)] = MiB  # stdout + stderr


class SandboxPythonConfig(ConfigSection):
    """A profile's Python environment (``python = { packages = [...], requirements = FILE }``):
    a virtual environment built once per content hash with the root's own python3, its packages
    fetched by the host's pip, shown read-only at ``/.rollmesh/venv`` and first on PATH."""

    packages: list[str] = []  # pip requirement specifiers, e.g. "numpy==2.4.6"
    requirements: str | None = None  # a requirements file on the broker's host
    # Install exactly what is listed, not the listed packages' own dependencies (pip --no-deps):
    # for a package whose declared dependencies its tools never import.
    no_deps: bool = False

    def __post_init__(self) -> None:
        if not self.packages and self.requirements is None:
            raise ValueError("python needs packages or a requirements file")
        if any(not spec.strip() or spec.lstrip().startswith("-") for spec in self.packages):
            raise ValueError(f"python.packages holds a blank entry or a pip option: {self.packages!r}")


# root = "host" | "dir:PATH" | "oci:PATH" (see rollmesh/sandbox/images.py)
_ROOT_KINDS = ("host", "dir:", "oci:")
_HOST_PORT = re.compile(r"^(?P<host>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):(?P<port>[0-9]{1,5})$")


class SandboxProfileConfig(SandboxLimitsConfig):
    """A named limit set (``[sandbox.profiles.<name>]``) and its warm pool: between ``warm_min``
    and ``warm_max`` fresh sandboxes are kept ready, as many as the recent lease rate times the
    creation latency asks for. Its image: ``root`` (the root filesystem), ``python`` (a virtual
    environment) and ``network_allow`` (host:port pairs reachable through an egress forwarder
    outside the sandbox, which itself keeps no network)."""

    network: bool = False  # leases of this profile may ask for network
    warm_min: NonNegInt = 1
    warm_max: NonNegInt = 8
    root: str = "host"  # "host", "dir:PATH" (an unpacked root) or "oci:PATH" (layout dir or tarball)
    python: SandboxPythonConfig | None = None
    network_allow: list[str] = []  # e.g. ["licenses.example.org:27000", "10.0.0.5:5025"]

    def __post_init__(self) -> None:
        if self.warm_min > self.warm_max:
            raise ValueError(f"warm_min {self.warm_min} is above warm_max {self.warm_max}")
        if self.root != "host" and not (self.root.startswith(_ROOT_KINDS[1:]) and len(self.root) > 4):
            raise ValueError(f"root {self.root!r} is not \"host\", \"dir:PATH\" or \"oci:PATH\"")
        for target in self.network_allow:
            found = _HOST_PORT.match(target)
            if found is None or not 1 <= int(found["port"]) <= 65535:
                raise ValueError(f"network_allow entry {target!r} is not host:port (port 1-65535)")


class SandboxMaximaConfig(SandboxLimitsConfig):
    """The most any lease may ask for, profile or override alike (``[sandbox.maxima]``); a key
    left out keeps these defaults, not the default profile's."""

    memory_mb: Annotated[int, Meta(ge=16)] = 16384
    pids: Annotated[int, Meta(ge=8)] = 4096
    workspace_mb: PositiveInt = 65536
    exec_timeout_s: PositiveFloat = 24 * 3600.0
    cpu_s: PositiveInt = 24 * 3600
    file_size_mb: PositiveInt = 65536
    max_output_bytes: Annotated[int, Meta(ge=1024, le=MAX_OUTPUT_CAP)] = MAX_OUTPUT_CAP


def _default_profiles() -> dict[str, SandboxProfileConfig]:
    return {"default": SandboxProfileConfig()}


class SandboxConfig(ConfigSection):
    # "auto": bubblewrap when available, else the process backend (which isolates nothing).
    # "runsc": gVisor, where installed. A named backend never falls back.
    backend: Literal["auto", "bwrap", "runsc", "process"] = "auto"
    # Where brokers run: "per_node" puts one on every Ray node offering the resources named in
    # ray.role_resources.sandbox (every node when none are named); a number starts that many,
    # placed by Ray. Leases are placed across them by load and profile (docs/sandbox.md).
    brokers: Literal["per_node"] | PositiveInt = 1
    # "per_node" starts at most this many brokers (more offering nodes: an error at start). Under
    # security each broker connects with its own NATS credentials, which the embedded server
    # makes for this many before Ray lists the nodes.
    max_brokers: Annotated[int, Meta(ge=1, le=4096)] = 64
    # Named limit sets; "default" (2 GiB memory, 2 GiB workspace, 256 pids, 10 min per exec)
    # exists even when a config file names only others.
    profiles: dict[str, SandboxProfileConfig] = msgspec.field(default_factory=_default_profiles)
    maxima: SandboxMaximaConfig = SandboxMaximaConfig()
    # Admission: live sandboxes (leased, warm and being created) and execs running at once.
    max_sandboxes: PositiveInt = 1024
    max_concurrent_execs: PositiveInt = 256
    max_concurrent_creates: PositiveInt = 4
    # How long a new sandbox's guest may take to say it is ready, every backend alike. Generous:
    # on a loaded host a start (namespaces, a fresh Python) can take seconds; past it the start
    # fails with what the guest wrote on stderr.
    start_timeout_s: PositiveFloat = 60.0
    capacity_retry_after_s: PositiveFloat = 1.0  # the retry hint of a "capacity" refusal
    default_lease_ttl_s: PositiveFloat = 600.0
    max_lease_ttl_s: PositiveFloat = 7 * 24 * 3600.0
    # Timers: expired leases are reaped, and warm pools resized, this often.
    reap_interval_s: PositiveFloat = 5.0
    pool_interval_s: PositiveFloat = 1.0
    demand_window_s: PositiveFloat = 60.0  # the lease rate that sizes warm pools is over this
    # Transfers: the largest file (or tar) moved, and the largest download chunk.
    max_transfer_bytes: PositiveInt = 1024 * MiB
    transfer_chunk_bytes: Annotated[int, Meta(ge=1024, le=6 * MiB)] = 4 * MiB
    # The bulk data path: a file above this moves over a direct stream to its lease's broker
    # (a Unix socket on the broker's node, else TCP on bulk_bind_host; TLS with the
    # security.nats_tls certificates under security), opened with a one-time token the broker
    # issues over NATS, which carries only control. A token not used in bulk_token_ttl_s lapses.
    bulk_threshold_bytes: NonNegInt = 64 * 1024
    bulk_bind_host: str = "127.0.0.1"  # "0.0.0.0": reachable from other nodes
    bulk_token_ttl_s: PositiveFloat = 30.0
    # Snapshots each broker takes (tars of workspaces; on the bus also in the JetStream object
    # store, where every broker can fork them): the least recently used go first, and one
    # unused for snapshot_ttl_s expires (in the object store: snapshot_ttl_s after it was taken).
    max_snapshots: PositiveInt = 64
    max_snapshot_bytes: PositiveInt = 4096 * MiB
    snapshot_ttl_s: PositiveFloat = 3600.0
    # Sandboxes outlive their broker (docs/sandbox.md): a per-node supervisor process holds
    # them, the lease table is in JetStream KV, and a restarted broker re-adopts both. The
    # supervisor exits once it holds no sandbox and no broker was connected for
    # supervisor_idle_exit_s; an exec's result is kept exec_result_keep_s after it ended, for a
    # request retried with the same exec_id. False: sandboxes are the broker's children.
    supervisor: bool = True
    supervisor_idle_exit_s: PositiveFloat = 60.0
    exec_result_keep_s: PositiveFloat = 600.0
    # Host paths shown read-only inside sandboxes even where the sandbox's own mounts (its
    # private /tmp) would hide them: datasets, a task's files. rollmesh's tools are always shown.
    readonly_paths: list[str] = []
    # Where unpacked image roots and profile Python environments are cached, by content hash
    # (None: "sandbox-images" under the run directory). Shared across runs when set.
    image_cache_dir: str | None = None

    def __post_init__(self) -> None:
        for name, profile in self.profiles.items():
            over = [field for field in SandboxLimitsConfig.__struct_fields__
                    if getattr(profile, field) > getattr(self.maxima, field)]
            if over:
                raise ValueError(f"profile {name!r} asks for more than sandbox.maxima: {', '.join(over)}")

    def profile(self, name: str) -> SandboxProfileConfig | None:
        """The named profile; "default" always exists."""
        found = self.profiles.get(name)
        if found is None and name == "default":
            return SandboxProfileConfig()
        return found

    def profile_names(self) -> list[str]:
        return sorted({"default", *self.profiles})
