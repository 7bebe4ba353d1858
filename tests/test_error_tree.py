"""Errors are a small drawn tree per package (STYLE.md 8, 9): every exception class defined in
rollmesh is named ``...Error``, and each package's errors derive from one root defined in that
package's ``errors`` module, so ``except <Package>Error`` catches everything the package raises.

Old names kept for one release (``MegatronRanksFailed``) are module ``__getattr__`` aliases of the
renamed class, not classes of their own, so they do not show up here.

Modules that run as plain files inside a sandbox (the guest agent, the supervisor's wire, the
code-tests runner) import nothing of rollmesh at module level and cannot derive from a package
root: they are held to the naming rule only.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import warnings
from pathlib import Path

import pytest

import rollmesh

pytestmark = pytest.mark.unit

ROOT = Path(rollmesh.__file__).parent


def _module_names() -> list[str]:
    return sorted(info.name for info in pkgutil.walk_packages(rollmesh.__path__, "rollmesh.")
                  if not info.name.endswith(".__main__"))  # __main__ runs the CLI on import


# How a module that runs inside a sandbox as a plain file says so in its docstring.
_STANDALONE_PHRASES = ("no rollmesh imports", "nothing of rollmesh", "no imports of rollmesh")


def _standalone(module_name: str) -> bool:
    doc = importlib.import_module(module_name).__doc__ or ""
    return any(phrase in doc for phrase in _STANDALONE_PHRASES)


def _imports_rollmesh_at_module_level(module_name: str) -> bool:
    """An import of rollmesh outside a ``try`` (a standalone file's fallback imports its sibling)."""
    source = Path(importlib.import_module(module_name).__file__ or "").read_text()
    for node in ast.parse(source).body:
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "rollmesh":
            return True
        if isinstance(node, ast.Import) and any(alias.name.split(".")[0] == "rollmesh" for alias in node.names):
            return True
    return False


def _exception_classes() -> dict[str, list[type[BaseException]]]:
    """The exception classes each module defines (not the ones it imports), by module name."""
    found: dict[str, list[type[BaseException]]] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # deprecated modules still load
        for name in _module_names():
            module = importlib.import_module(name)
            found[name] = [value for value in vars(module).values()
                           if inspect.isclass(value) and issubclass(value, BaseException)
                           and not issubclass(value, Warning) and value.__module__ == name]
    return found


EXCEPTIONS = _exception_classes()


def test_every_exception_class_in_rollmesh_is_named_error() -> None:
    misnamed = [f"{module}.{cls.__qualname__}" for module, classes in EXCEPTIONS.items()
                for cls in classes if not cls.__name__.endswith("Error")]
    assert not misnamed, f"exception classes not named ...Error: {misnamed}"


def _packages() -> list[str]:
    return sorted({module.split(".")[1] for module, classes in EXCEPTIONS.items()
                   if classes and module.count(".") >= 2})  # top-level modules have no package


@pytest.mark.parametrize("package", _packages())
def test_each_package_s_errors_derive_from_one_root_in_its_errors_module(package: str) -> None:
    prefix = f"rollmesh.{package}."
    classes = [cls for module, found in EXCEPTIONS.items() if module.startswith(prefix) and not _standalone(module)
               for cls in found]
    own = set(classes)
    roots = [cls for cls in classes if not any(base in own for base in cls.__mro__[1:])]
    assert len(roots) == 1, f"rollmesh.{package} has {len(roots)} error roots: {[c.__qualname__ for c in roots]}"
    root = roots[0]
    assert root.__module__ == f"rollmesh.{package}.errors", f"{root.__qualname__} is not in rollmesh.{package}.errors"
    assert root.__name__.endswith("Error")
    strays = [cls.__qualname__ for cls in classes if not issubclass(cls, root)]
    assert not strays  # (implied by a single root; kept to name them if the rule above changes)


def test_the_modules_exempt_from_the_roots_do_run_without_rollmesh() -> None:
    # The exemption must not swallow a package module by accident: a module whose docstring says
    # it runs without rollmesh imports none of it at module level.
    exempt = [module for module, classes in EXCEPTIONS.items() if classes and _standalone(module)]
    assert exempt  # the sandbox's own files define their errors
    assert not [module for module in exempt if _imports_rollmesh_at_module_level(module)]
