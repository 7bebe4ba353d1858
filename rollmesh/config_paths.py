"""Which config fields name files (security files, stages' datasets), and what a relative one is
relative to.

Knows the raw config tree (decoded TOML or JSON, before msgspec) and the standard library only.
A relative path in a config file is relative to the directory of that file, so a config and its
``pki/`` (or a run file and its datasets) travel together and work from any working directory; one set by an environment override
or on the command line is relative to the working directory. ``load_config`` makes them all
absolute (``~`` expanded), so the run's ``config.json`` holds absolute paths and a command that
reads it works from anywhere. Other paths (``run_root``, ``model.path``, ...) are left as given.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

# Dotted fields holding a path to a certificate, key, API key or credentials file.
SECURITY_PATH_FIELDS = (
    "security.nats_tls.ca_file",
    "security.nats_tls.cert_file",
    "security.nats_tls.key_file",
    "security.nats_tls.server_cert_file",
    "security.nats_tls.server_key_file",
    "serve.api_key_file",
    "serve.tls_cert_file",
    "serve.tls_key_file",
)
# The path fields of each role's ``[security.credentials.<role>]``.
CREDENTIALS_PATH_FIELDS = ("creds_file", "nkey_seed_file", "password_file")


def resolve_config_paths(tree: dict[str, Any], base: Path) -> None:
    """Make every relative security or dataset path in ``tree`` absolute against ``base``, in place (the
    raw tree, before it becomes frozen Structs). Values of the wrong type are left for the
    config's validation to refuse."""
    for dotted in SECURITY_PATH_FIELDS:
        *parents, leaf = dotted.split(".")
        section = _section(tree, parents)
        if section is not None:
            _resolve_field(section, leaf, base)
    credentials = _section(tree, ["security", "credentials"])
    for role in (credentials or {}).values():
        if isinstance(role, dict):
            for leaf in CREDENTIALS_PATH_FIELDS:
                _resolve_field(role, leaf, base)
    for table in ("stages", "eval"):
        entries = tree.get(table)
        for entry in entries if isinstance(entries, list) else []:
            if isinstance(entry, dict):
                _resolve_field(entry, "data", base)
                sources = entry.get("mixture")
                for source in sources if isinstance(sources, list) else []:
                    if isinstance(source, dict):
                        _resolve_field(source, "data", base)


def absolute_path(value: str, base: Path) -> str:
    """``value`` with ``~`` expanded, joined to ``base`` when still relative ("" stays "")."""
    if not value:
        return value
    path = Path(value).expanduser()
    return str(path if path.is_absolute() else Path(base).absolute() / path)


def _section(tree: dict[str, Any], names: list[str]) -> dict[str, Any] | None:
    node: Any = tree
    for name in names:
        node = node.get(name) if isinstance(node, dict) else None
    return node if isinstance(node, dict) else None


def _resolve_field(section: dict[str, Any], leaf: str, base: Path) -> None:
    value = section.get(leaf)
    if isinstance(value, str):
        section[leaf] = absolute_path(value, base)
