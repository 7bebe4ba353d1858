"""Names a package loads on first use, and deprecated aliases for names that moved to another
module: the old module's ``__getattr__`` finds each one at its new home and warns
(DeprecationWarning) that the old path goes away.

An alias is kept for one release after the move, then its module is deleted. Imports nothing of
ours, so any layer may use it, the bus included.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable, Mapping
from typing import Any


def forward_moved_names(old_module: str, moved: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``old_module``: ``moved`` maps each moved name to the module
    that holds it now, or to ``"module:new_name"`` where it was renamed as it moved; any other
    name is an AttributeError, as for a module without it. A package ``__getattr__`` that
    delegates here passes ``stacklevel=3`` (one frame more to the importer)."""

    def __getattr__(name: str, stacklevel: int = 2) -> Any:
        target = moved.get(name)
        if target is None:
            raise AttributeError(f"module {old_module!r} has no attribute {name!r}")
        new_module, _, new_name = target.partition(":")
        new_name = new_name or name
        # The warning points at the line importing the old path, not at this one.
        warnings.warn(f"{old_module}.{name} moved to {new_module}.{new_name}; the old path will be "
                      "removed in the next release", DeprecationWarning, stacklevel=stacklevel)
        return getattr(importlib.import_module(new_module), new_name)

    return __getattr__


def lazy_exports(package: str, exports: Mapping[str, str], *, moved: Mapping[str, str] | None = None,
                 cache: dict[str, Any] | None = None) -> Callable[[str], Any]:
    """A package ``__getattr__`` that imports each of ``exports`` (name -> the module holding it)
    from its module on first use, so that importing the package imports none of them (a role's
    process starts without torch); ``moved`` names go to ``forward_moved_names``, with its
    warning. A name found is stored in ``cache`` (the package's ``globals()``) when given, so it
    is looked up once."""
    forward = forward_moved_names(package, moved or {})

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            return forward(name, stacklevel=3)  # warns for a moved name, else AttributeError
        value = getattr(importlib.import_module(module), name)
        if cache is not None:
            cache[name] = value
        return value

    return __getattr__
