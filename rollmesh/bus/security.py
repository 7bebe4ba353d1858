"""NATS credentials per role: generated for the embedded server, resolved from config for a
cluster, and turned into nats-py connect options at connect time.

Knows the file system, the environment, nkeys and the permission table; knows nothing of Ray.
What travels between processes (Ray actor arguments, mesh.json, logs) is a ``BusCredentials``:
file paths and variable names, never a secret. Secrets are read only in ``connect_options``, in
the process that connects. Generated files are 0600 in a 0700 directory.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollmesh.bus.errors import BusSecurityError
from rollmesh.bus.permissions import BROKER_ROLE_PREFIX, ROLES, ServerUser, broker_role, inbox_prefix, is_role
from rollmesh.config import NatsCredentialsConfig, SecurityConfig

CREDENTIALS_DIR = "security"


@dataclass(frozen=True)
class BusCredentials:
    """How one role's connections authenticate, and their reply-inbox prefix."""

    role: str
    namespace: str
    source: NatsCredentialsConfig

    @property
    def inbox_prefix(self) -> str:
        return inbox_prefix(self.role, self.namespace)

    def connect_options(self, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
        """nats-py ``connect`` keyword arguments; reads the secret files or variables now."""
        env = os.environ if environ is None else environ
        source = self.source
        options: dict[str, Any] = {"inbox_prefix": self.inbox_prefix}
        if source.creds_file:
            options["user_credentials"] = str(self._existing(source.creds_file))
        elif source.nkey_seed_file or source.nkey_seed_env:
            options["nkeys_seed_str"] = self._secret(source.nkey_seed_file, source.nkey_seed_env, env)
        elif source.user:
            options["user"] = source.user
            options["password"] = self._secret(source.password_file, source.password_env, env)
        return options

    def _existing(self, path: str) -> Path:
        found = Path(path).expanduser()
        if not found.is_file():
            raise BusSecurityError(f"credentials file {found} does not exist", role=self.role,
                                   path=str(found))
        return found

    def _secret(self, path: str, variable: str, env: Mapping[str, str]) -> str:
        if variable:
            value = env.get(variable, "").strip()
            if not value:
                raise BusSecurityError(f"environment variable {variable} is not set", role=self.role)
            return value
        found = self._existing(path)
        try:
            value = found.read_text().strip()
        except OSError as exc:
            raise BusSecurityError(f"cannot read {found}: {exc.strerror or type(exc).__name__}",
                                   role=self.role, path=str(found)) from exc
        if not value:
            raise BusSecurityError(f"{found} is empty", role=self.role, path=str(found))
        return value


def configured_credentials(security: SecurityConfig, namespace: str) -> dict[str, BusCredentials]:
    """Each role's credentials as the config names them (a cluster's NATS); every role must be
    named, so a mesh never starts with a role that cannot connect. Several sandbox brokers may
    each be given their own (``sandbox_broker_<id>``; the launcher then wants one for every broker
    it starts), or all share ``sandbox_broker``."""
    unknown = sorted(role for role in security.credentials if not is_role(role))
    if unknown:
        raise BusSecurityError(f"security.credentials names unknown roles {unknown}; "
                               f"roles: {', '.join(ROLES)}, and {BROKER_ROLE_PREFIX}<id> (0, 1, ...) "
                               "for each of several sandbox brokers")
    missing = [role for role in ROLES if role not in security.credentials]
    if missing:
        raise BusSecurityError(f"security.enabled with nats.url needs security.credentials for "
                               f"every role; missing: {', '.join(missing)}")
    return {role: BusCredentials(role, namespace, source)
            for role, source in security.credentials.items()}


@dataclass(frozen=True)
class GeneratedCredentials:
    """Per-role nkeys made for an embedded server: the server's users and each role's seed file."""

    users: list[ServerUser]
    credentials: dict[str, BusCredentials]


def role_seed_path(run_dir: str | Path, role: str) -> Path:
    """Where a run with generated credentials keeps ``role``'s nkey seed."""
    return Path(run_dir) / CREDENTIALS_DIR / f"{role}.nk"


def generate_role_nkeys(run_dir: Path, namespace: str, sandbox_brokers: Sequence[str] = ()) -> GeneratedCredentials:
    """A fresh user nkey per role, and one per sandbox broker id in ``sandbox_brokers`` (role
    ``sandbox_broker_<id>``: that broker's own subjects only), seeds written to
    ``<run_dir>/security/<role>.nk`` (0600). A restarted run gets new keys: the server config is
    written anew with them."""
    import nkeys  # the nats-py[nkeys] extra; only needed where keys are made or used

    directory = Path(run_dir) / CREDENTIALS_DIR
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(directory, 0o700)
    users, credentials = [], {}
    for role in [*ROLES, *(broker_role(broker) for broker in sandbox_brokers)]:
        seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)
        public_key = nkeys.from_seed(bytearray(seed)).public_key.decode()
        seed_path = role_seed_path(run_dir, role)
        write_secret_file(seed_path, seed.decode())
        users.append(ServerUser(role, nkey=public_key))
        credentials[role] = BusCredentials(
            role, namespace, NatsCredentialsConfig(nkey_seed_file=str(seed_path.resolve())))
    return GeneratedCredentials(users, credentials)


def write_secret_file(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` readable by its owner only (replacing an older file)."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text + "\n")
