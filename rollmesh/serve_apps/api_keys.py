"""The HTTP API's bearer key: where it comes from, when it is required, and how a request is checked.

Knows the environment and files at the entry point (``resolve_api_key``, ``required_api_key``)
and plain strings in the replica (``check_authorization``); not Ray, not FastAPI. The key is
never logged or put in an error message. A key is required whenever the API is bound beyond
loopback or security is enabled; on loopback with security off (local use) none is needed, and
with none configured every request is let through.
"""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Mapping
from pathlib import Path

from rollmesh.serve_apps.errors import ApiKeyRequiredError, AuthenticationError, InvalidApiKeyFileError

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


def is_loopback(host: str) -> bool:
    """True for addresses only this machine can reach ("localhost", 127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name or a wildcard: reachable from elsewhere, as far as we know


def required_api_key(api_key_file: str, environ: Mapping[str, str], *, host: str,
                     security_enabled: bool) -> str:
    """``resolve_api_key``, refusing to start without a key where one is required (bound beyond
    loopback, or ``security.enabled``)."""
    key = resolve_api_key(api_key_file, environ)
    if not key and (security_enabled or not is_loopback(host)):
        why = "security.enabled is set" if security_enabled else f"it is bound to {host}, beyond loopback"
        raise ApiKeyRequiredError(
            f"the HTTP API needs an API key because {why}: set {API_KEY_ENV} or serve.api_key_file")
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
