"""TLS to NATS: the client's SSL context and the embedded server's ``tls { }`` block (and a server
context from the same material, for the sandbox broker's bulk stream).

Knows the standard library's ssl module and nats-server's config syntax; knows nothing of
nats-py or Ray. Paths are checked up front, so a missing file is a clear error at startup rather
than a handshake that fails somewhere inside a reconnect loop.
"""

from __future__ import annotations

import json
import ssl
from pathlib import Path

from rollmesh.bus.errors import BusSecurityError
from rollmesh.config import NatsTlsConfig


def client_tls_context(tls: NatsTlsConfig) -> ssl.SSLContext | None:
    """The context a client connects with (None: plaintext). It verifies the server against
    ``ca_file`` (the system store without one) and presents ``cert_file`` for mutual TLS."""
    if not tls.enabled:
        return None
    try:
        context = ssl.create_default_context(
            ssl.Purpose.SERVER_AUTH, cafile=str(_existing(tls.ca_file)) if tls.ca_file else None)
        if tls.cert_file:
            context.load_cert_chain(str(_existing(tls.cert_file)), str(_existing(tls.key_file)))
    except ssl.SSLError as exc:
        raise BusSecurityError(f"unusable TLS material: {exc.reason or exc}") from exc
    return context


def server_tls_context(tls: NatsTlsConfig) -> ssl.SSLContext | None:
    """A server's context from the NATS TLS material, for the sandbox broker's bulk stream: it
    serves ``server_cert_file`` (else ``cert_file``) and, with ``verify``, requires a client
    certificate signed by ``ca_file``. None when TLS is off or there is no certificate to serve."""
    cert, key = (tls.server_cert_file, tls.server_key_file) if tls.server_cert_file else (tls.cert_file, tls.key_file)
    if not tls.enabled or not cert:
        return None
    try:
        context = ssl.create_default_context(
            ssl.Purpose.CLIENT_AUTH, cafile=str(_existing(tls.ca_file)) if tls.ca_file else None)
        context.load_cert_chain(str(_existing(cert)), str(_existing(key)))
    except ssl.SSLError as exc:
        raise BusSecurityError(f"unusable TLS material: {exc.reason or exc}") from exc
    if tls.verify:
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def server_tls_block(tls: NatsTlsConfig) -> str:
    """The embedded server's ``tls { }`` config ("" when TLS is off). With ``verify`` every
    client must present a certificate signed by ``ca_file`` (mutual TLS)."""
    if not tls.enabled:
        return ""
    if not tls.server_cert_file:
        raise BusSecurityError("security.nats_tls.enabled with the embedded server needs "
                               "server_cert_file and server_key_file")
    fields = {"cert_file": str(_existing(tls.server_cert_file)),
              "key_file": str(_existing(tls.server_key_file))}
    if tls.ca_file:
        fields["ca_file"] = str(_existing(tls.ca_file))
    lines = [f"  {key}: {json.dumps(value)}" for key, value in fields.items()]
    if tls.verify:
        lines.append("  verify: true")
    return "tls {\n" + "\n".join(lines) + "\n}\n"


def _existing(path: str) -> Path:
    found = Path(path).expanduser()
    if not found.is_file():
        raise BusSecurityError(f"TLS file {found} does not exist", path=str(found))
    return found.resolve()
