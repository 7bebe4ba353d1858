"""The HTTP API's optional bearer key: where it comes from and how a request is checked.

Knows the environment and files at the entry point (``resolve_api_key``) and plain strings in
the replica (``check_authorization``); not Ray, not FastAPI. The key is never logged or put in an
error message. With no key configured (the default, on loopback) every request is let through.
"""

from __future__ import annotations

import hmac
from collections.abc import Mapping
from pathlib import Path

from rollmesh.serve_apps.errors import AuthenticationError, InvalidApiKeyFileError

API_KEY_ENV = "ROLLMESH_API_KEY"


def resolve_api_key(api_key_file: str, environ: Mapping[str, str]) -> str:
    """``ROLLMESH_API_KEY`` when set, else the stripped contents of ``api_key_file``, else ""."""
    from_env = environ.get(API_KEY_ENV, "").strip()
    if from_env:
        return from_env
    if not api_key_file:
        return ""
    try:
        key = Path(api_key_file).expanduser().read_text().strip()
    except OSError as exc:
        raise InvalidApiKeyFileError(f"cannot read the API key file {api_key_file}: "
                                     f"{exc.strerror or type(exc).__name__}") from exc
    if not key:
        raise InvalidApiKeyFileError(f"the API key file {api_key_file} is empty")
    return key


def check_authorization(authorization: str | None, api_key: str) -> None:
    """Raise AuthenticationError unless ``authorization`` is ``Bearer <api_key>``; with no key
    configured anything passes."""
    if not api_key:
        return
    scheme, _, presented = (authorization or "").strip().partition(" ")
    if scheme.lower() != "bearer" or not presented.strip():
        raise AuthenticationError(
            "missing API key: send the header 'Authorization: Bearer <key>'")
    # Constant time, so response timing says nothing about how much of a guess was right.
    if not hmac.compare_digest(presented.strip().encode(), api_key.encode()):
        raise AuthenticationError("incorrect API key")
