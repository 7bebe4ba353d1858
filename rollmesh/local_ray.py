"""A Ray that rollmesh starts itself, kept to this machine: its node IP on loopback and Ray's
token authentication on, with the token in a file of the run directory (mode 0600).

Knows Ray's environment variables and the two places Ray caches what they said (named below, with
why); knows no mesh. A joined cluster (``ray.address``) is not started here: its nodes' address and
token are its operator's (docs/security.md). What Ray 2.60 does, read from its source and measured
(tests/test_ray_loopback.py):

- Every Ray server (GCS, raylet and object manager, workers' gRPC servers, the dashboard, metrics
  and runtime-env agents) listens on loopback only when the node IP is a loopback address, and on
  all interfaces otherwise.
- ``ray.init(_node_ip_address="127.0.0.1")`` alone does not get there: Ray swaps a loopback node IP
  (and a loopback address to join) for the host's own address (``resolve_ip_for_localhost``)
  unless ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER`` is off, a flag Ray reads once, when it is imported.
- ``RAY_AUTH_MODE=token`` with ``RAY_AUTH_TOKEN_PATH`` makes the GCS, raylets, agents and workers
  (which inherit the environment) require the token, and ``ray.init`` present it. Ray caches the
  mode and the token per process, so both are refreshed after the variables change.
"""

from __future__ import annotations

import ipaddress
import os
import secrets
from collections.abc import Mapping, MutableMapping
from pathlib import Path
from typing import Any

# In the run directory; mesh.json names it (ray_auth_token_file).
RAY_AUTH_TOKEN_FILE = "ray_auth_token"
# Ray's own token is 32 random bytes in hex; ours is made the same way.
_TOKEN_BYTES = 32
# Ray's switch for "a loopback node IP stays loopback" (ray._private.ray_constants).
_LOOPBACK_SWITCH = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
_AUTH_VARIABLES = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH", "RAY_AUTH_TOKEN")


def write_ray_auth_token(directory: str | Path) -> Path:
    """A new random token in ``directory/ray_auth_token``, readable by this user only (0600);
    a token left by an earlier start (``up --resume``) is replaced."""
    path = Path(directory) / RAY_AUTH_TOKEN_FILE
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)  # an existing file keeps its mode through O_CREAT: set it
        os.write(fd, secrets.token_hex(_TOKEN_BYTES).encode())
    finally:
        os.close(fd)
    return path


def is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return address == "localhost"


class LocalRayEnvironment:
    """What this process's environment must say while it starts, joins or runs a Ray kept to this
    machine, and ``restore`` to put back what it said before (a test process outlives its mesh)."""

    def __init__(self, *, token_file: str | Path, node_ip_address: str) -> None:
        self.token_file = Path(token_file)
        self.node_ip_address = node_ip_address
        self._saved: dict[str, str | None] | None = None
        self._saved_switch = True

    def apply(self) -> None:
        import ray._private.ray_constants as ray_constants

        keys = (*_AUTH_VARIABLES, _LOOPBACK_SWITCH)
        self._saved = {key: os.environ.get(key) for key in keys}
        self._saved_switch = ray_constants.ENABLE_RAY_CLUSTER
        _update(os.environ, self._variables())  # for Ray's processes, which import Ray afresh
        if is_loopback(self.node_ip_address):
            ray_constants.ENABLE_RAY_CLUSTER = False  # this process imported Ray already
        _refresh_ray_auth()

    def subprocess_env(self, environ: Mapping[str, str] | None = None) -> dict[str, str]:
        """The environment for another process that starts or joins this Ray (``ray start
        --head --node-ip-address=...``, a driver calling ``ray.init(address=...)``, ``ray
        stop``): a copy of ``environ`` (this process's by default) with what ``apply`` sets.
        Neither ``environ`` nor this process's Ray is changed."""
        env = dict(os.environ if environ is None else environ)
        _update(env, self._variables())
        return env

    def restore(self) -> None:
        if self._saved is None:
            return
        import ray._private.ray_constants as ray_constants

        for key, value in self._saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        ray_constants.ENABLE_RAY_CLUSTER = self._saved_switch
        self._saved = None
        _refresh_ray_auth()

    def _variables(self) -> dict[str, str | None]:
        """What the environment must say (None: must not say at all)."""
        # Forced, whatever the environment said: a Ray that rollmesh starts is never open. Only
        # tests disable auth, on Rays of their own (tests/conftest.py).
        variables: dict[str, str | None] = {
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN_PATH": str(self.token_file.resolve()),
            "RAY_AUTH_TOKEN": None,  # it would win over the file
        }
        if is_loopback(self.node_ip_address):
            variables[_LOOPBACK_SWITCH] = "0"
        return variables

    def init_options(self) -> dict[str, Any]:
        """``ray.init`` keyword arguments that start the local Ray on ``node_ip_address``."""
        return {"_node_ip_address": self.node_ip_address} if self.node_ip_address else {}


def _update(environ: MutableMapping[str, str], variables: Mapping[str, str | None]) -> None:
    for key, value in variables.items():
        if value is None:
            environ.pop(key, None)
        else:
            environ[key] = value


def _refresh_ray_auth() -> None:
    """Ray reads RAY_AUTH_MODE into its config and the token into a loader, once per process;
    read them again (as Ray's own ``_enable_token_auth`` does)."""
    from ray._raylet import AuthenticationTokenLoader, Config

    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()
