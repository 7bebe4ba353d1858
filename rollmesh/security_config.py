"""The security config section: NATS credentials per role and TLS (``[security]``).

Knows msgspec only; part of the config tree ``rollmesh.config`` loads. Holds paths and variable
names, never a secret. A relative path in a config file is relative to that file's directory; the
loader makes every one absolute (rollmesh/config_paths.py).
"""

from __future__ import annotations

from rollmesh.config_types import ConfigSection

class NatsCredentialsConfig(ConfigSection):
    """Where one role's NATS credentials come from: a ``.creds`` file (JWT + nkey), an nkey seed
    (file or environment variable), or a user name with a password (file or environment
    variable). Paths and variable names only: secrets never sit in config or on a command line."""

    creds_file: str = ""
    nkey_seed_file: str = ""
    nkey_seed_env: str = ""
    user: str = ""
    password_file: str = ""
    password_env: str = ""

    def __post_init__(self) -> None:
        kinds = [bool(self.creds_file), bool(self.nkey_seed_file or self.nkey_seed_env), bool(self.user)]
        if sum(kinds) > 1:
            raise ValueError("give one of creds_file, an nkey seed, or user + password")
        if self.nkey_seed_file and self.nkey_seed_env:
            raise ValueError("nkey_seed_file and nkey_seed_env are alternatives")
        if self.user and bool(self.password_file) == bool(self.password_env):
            raise ValueError("a user needs exactly one of password_file and password_env")
        if not self.user and (self.password_file or self.password_env):
            raise ValueError("a password needs its user")


class NatsTlsConfig(ConfigSection):
    """TLS to NATS. Clients verify the server against ``ca_file`` and present ``cert_file`` /
    ``key_file`` for mutual TLS. The embedded server uses ``server_cert_file`` /
    ``server_key_file`` and, with ``verify``, requires client certificates signed by ``ca_file``."""

    enabled: bool = False
    ca_file: str = ""
    cert_file: str = ""
    key_file: str = ""
    verify: bool = False
    server_cert_file: str = ""
    server_key_file: str = ""

    def __post_init__(self) -> None:
        if bool(self.cert_file) != bool(self.key_file):
            raise ValueError("security.nats_tls.cert_file and key_file go together")
        if bool(self.server_cert_file) != bool(self.server_key_file):
            raise ValueError("security.nats_tls.server_cert_file and server_key_file go together")
        if self.verify and not self.ca_file:
            raise ValueError("security.nats_tls.verify (mutual TLS) needs ca_file")


class SecurityConfig(ConfigSection):
    """Least-privilege NATS (one user per role, rollmesh/bus/permissions.py), TLS, API keys.
    With the embedded server, per-role nkeys are generated into the run directory; with
    ``nats.url``, ``credentials`` names each role's (roles: mesh, rollout_worker, trainer,
    inference, sandbox_broker, scheduler, resharder, client, dashboard). Several sandbox brokers
    (``sandbox.brokers``) each get their own (``sandbox_broker_0``, ``sandbox_broker_1``, ...:
    generated for the embedded server; named here for a cluster, or all share ``sandbox_broker``)."""

    enabled: bool = False
    credentials: dict[str, NatsCredentialsConfig] = {}
    nats_tls: NatsTlsConfig = NatsTlsConfig()
