"""Operator-mode NATS for tests: an operator, one account and user JWTs with ``.creds`` files,
minted as ``nsc`` would (ed25519 nkeys, ``alg: ed25519-nkey``). Test code only; deployments
make theirs with ``nsc``."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import nkeys


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _new_seed(prefix: int) -> bytes:
    return nkeys.encode_seed(os.urandom(32), prefix)


def _public(seed: bytes) -> str:
    return nkeys.from_seed(bytearray(seed)).public_key.decode()


def _jwt(nats_claims: dict, subject: str, name: str, signer: bytes) -> str:
    claims = {"jti": "", "iat": int(time.time()), "iss": _public(signer), "name": name, "sub": subject,
              "nats": {**nats_claims, "version": 2}}
    body = json.dumps(claims, separators=(",", ":")).encode()
    claims["jti"] = base64.b32encode(hashlib.sha256(body).digest()).decode().rstrip("=")
    signed = _b64(b'{"typ":"JWT","alg":"ed25519-nkey"}') + "." + _b64(json.dumps(claims, separators=(",", ":")).encode())
    return signed + "." + _b64(nkeys.from_seed(bytearray(signer)).sign(signed.encode()))


@dataclass
class OperatorMode:
    """One operator trusting one account (resolved from memory); users are minted on demand."""

    operator: bytes = field(default_factory=lambda: _new_seed(nkeys.PREFIX_BYTE_OPERATOR))
    account: bytes = field(default_factory=lambda: _new_seed(nkeys.PREFIX_BYTE_ACCOUNT))
    # JetStream (the embedded server runs -js) needs a system account in operator mode.
    system: bytes = field(default_factory=lambda: _new_seed(nkeys.PREFIX_BYTE_ACCOUNT))

    def server_config(self) -> str:
        """The nats-server config block (for ``EmbeddedNatsServer(auth_config=...)``)."""
        system = _public(self.system)
        operator_jwt = _jwt({"type": "operator", "system_account": system}, _public(self.operator),
                            "rollmesh-test", self.operator)
        limits = {"subs": -1, "data": -1, "payload": -1, "imports": -1, "exports": -1, "wildcards": True,
                  "conn": -1, "leaf": -1, "mem_storage": -1, "disk_storage": -1, "streams": -1, "consumer": -1}
        account_jwt = _jwt({"type": "account", "limits": limits}, _public(self.account), "ROLLMESH", self.operator)
        system_jwt = _jwt({"type": "account"}, system, "SYS", self.operator)
        return (f'operator: "{operator_jwt}"\nsystem_account: {system}\nresolver: MEMORY\n'
                f'resolver_preload: {{ {_public(self.account)}: "{account_jwt}", {system}: "{system_jwt}" }}\n')

    def write_creds(self, path: Path, name: str, permissions: dict) -> Path:
        """A ``.creds`` file (user JWT and seed) for a user with these JWT permission claims."""
        user = _new_seed(nkeys.PREFIX_BYTE_USER)
        token = _jwt({"type": "user", "subs": -1, "data": -1, "payload": -1, **permissions},
                     _public(user), name, self.account)
        path.write_text(f"-----BEGIN NATS USER JWT-----\n{token}\n------END NATS USER JWT------\n\n"
                        f"-----BEGIN USER NKEY SEED-----\n{user.decode()}\n------END USER NKEY SEED------\n")
        path.chmod(0o600)
        return path
