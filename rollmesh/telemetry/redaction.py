"""Secret redaction for logs and anything else that prints URLs or config.

Knows the standard library only. Values under keys that look secret (token, password, secret,
api_key, authorization, nkey, private_key) are replaced, ``user:pass@`` in URLs becomes
``[REDACTED]@``, and NATS nkey seeds ("SU..." and kin) are replaced wherever they appear.
"""

from __future__ import annotations

import re
from typing import Any

REDACTED = "[REDACTED]"
_SECRET_KEY = re.compile(r"token|password|passwd|secret|api_?key|authorization|nkey|private_?key",
                         re.IGNORECASE)
# An nkey seed: "S", the key type (User, Operator, Account, Cluster, Node), 56 base32 characters.
_NKEY_SEED = re.compile(r"\bS[UOACN][A-Z2-7]{56}\b")
# scheme://user:pass@host or scheme://token@host: everything between // and @ is a credential.
_URL_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)[^/@\s]+@")
_MAX_DEPTH = 4


def redact_url(url: str) -> str:
    """``nats://alice:s3cret@host:4222`` -> ``nats://[REDACTED]@host:4222``."""
    return _URL_USERINFO.sub(lambda m: f"{m.group('scheme')}{REDACTED}@", url)


def is_secret_key(key: str) -> bool:
    return bool(_SECRET_KEY.search(key))


def redact_value(value: Any, depth: int = 0) -> Any:
    """Redact secrets inside strings, dicts, lists and tuples (bounded depth, new objects)."""
    if isinstance(value, str):
        value = _NKEY_SEED.sub(REDACTED, value) if "S" in value else value
        return redact_url(value) if "@" in value else value
    if depth >= _MAX_DEPTH:
        return value
    if isinstance(value, dict):
        return {
            k: (REDACTED if isinstance(k, str) and is_secret_key(k) else redact_value(v, depth + 1))
            for k, v in value.items()
        }
    if isinstance(value, (list, tuple)):
        return type(value)(redact_value(v, depth + 1) for v in value)
    return value
