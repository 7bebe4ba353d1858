"""The molar_mass sandbox tool (loaded from its file, as the task's verifier does) and tool paths."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
from decimal import Decimal
from types import ModuleType

import pytest
from hypothesis import given
from hypothesis import strategies as st

from support.sandbox_helpers import usable_bwrap
from rollmesh.sandbox import ToolNotFoundError, python_for_sandbox, tool_script_path
from rollmesh.sandbox.sandbox_protocol import SandboxLimits

pytestmark = [pytest.mark.timeout(60)]


def load_tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location("molar_mass_tool_under_test", tool_script_path("molar_mass"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


molar_mass = load_tool()


@pytest.mark.parametrize(
    ("formula", "expected"),
    [
        # 2 x 39.098 + 22.990 + 2 x 14.007. (The demo notes say 142.296; that number is wrong.)
        ("K2NaN2", "129.200"),
        ("H2O", "18.015"),
        ("CaCl2", "110.978"),
        ("NaCl", "58.440"),
        ("Fe", "55.845"),
        ("MgSO4", "120.361"),
        ("H3PO4", "97.994"),
        ("CH3COOH", "60.052"),
    ],
)
@pytest.mark.unit
def test_molar_mass_of_known_formulas(formula: str, expected: str) -> None:
    assert f"{molar_mass.molar_mass(formula):.3f}" == expected
    assert molar_mass.format_mass(formula) == expected


@pytest.mark.unit
def test_repeated_symbols_add_up() -> None:
    assert molar_mass.parse_formula("CH3COOH") == {"C": 2, "H": 4, "O": 2}


@pytest.mark.parametrize(
    "formula",
    ["", "h2o", "H0", "H02", "2H", "H2O)", "(OH)2", "H2 O", "Xx", "Co", "H1234567", "Na+", "H" * 65],
)
@pytest.mark.unit
def test_malformed_or_unknown_formulas_raise(formula: str) -> None:
    with pytest.raises(molar_mass.FormulaError):
        molar_mass.parse_formula(formula)


@given(st.lists(st.tuples(st.sampled_from(sorted(molar_mass.ATOMIC_WEIGHTS_MILLI)), st.integers(1, 4)), min_size=1, max_size=3))
@pytest.mark.unit
def test_mass_is_the_weighted_sum_of_the_parts(parts: list[tuple[str, int]]) -> None:
    formula = "".join(symbol if count == 1 else f"{symbol}{count}" for symbol, count in parts)
    expected = sum((Decimal(molar_mass.ATOMIC_WEIGHTS_MILLI[s]) / 1000 * c for s, c in parts), Decimal(0))
    assert molar_mass.format_mass(formula) == f"{expected:.3f}"


@pytest.mark.unit
def test_main_prints_three_decimals_and_exits_zero(capsys: pytest.CaptureFixture[str]) -> None:
    assert molar_mass.main(["H2O"]) == 0
    assert capsys.readouterr().out == "18.015\n"


@pytest.mark.unit
def test_main_exits_two_with_a_message_on_bad_input(capsys: pytest.CaptureFixture[str]) -> None:
    assert molar_mass.main(["Xy2"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "unknown element" in captured.err


@pytest.mark.unit
def test_the_script_runs_alone_without_site_packages() -> None:
    argv = [python_for_sandbox(), "-I", "-S", str(tool_script_path("molar_mass"))]
    ok = subprocess.run([*argv, "CaCl2"], capture_output=True, text=True, env={}, timeout=20, check=False)
    assert (ok.returncode, ok.stdout, ok.stderr) == (0, "110.978\n", "")
    bad = subprocess.run([*argv, "H2O)"], capture_output=True, text=True, env={}, timeout=20, check=False)
    assert (bad.returncode, bad.stdout) == (2, "")
    assert bad.stderr.startswith("error: malformed formula")


@pytest.mark.parametrize("name", ["no_such_tool", "../molar_mass", "molar_mass.py", "", "/etc/passwd"])
@pytest.mark.unit
def test_tool_script_path_refuses_unknown_names_and_paths(name: str) -> None:
    with pytest.raises(ToolNotFoundError) as info:
        tool_script_path(name)
    assert info.value.tool == name


@pytest.mark.unit
def test_python_for_sandbox_is_an_executable() -> None:
    assert os.access(python_for_sandbox(), os.X_OK)


@pytest.mark.integration
@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed")
async def test_molar_mass_runs_inside_a_bubblewrap_sandbox() -> None:
    """The tool scripts are shown read-only at their host path, so a rollout's tool call is the
    same argv inside a sandbox as outside."""
    backend = usable_bwrap()
    sandbox = await backend.create("tools", SandboxLimits(memory_mb=128, pids=32, workspace_mb=8))
    try:
        argv = [python_for_sandbox(), "-I", "-S", str(tool_script_path("molar_mass"))]
        ok = await sandbox.exec([*argv, "K2NaN2"])
        assert (ok.result, ok.exit_code, ok.stdout, ok.stderr) == ("exit", 0, b"129.200\n", b"")
        bad = await sandbox.exec([*argv, "Xx"])
        assert (bad.result, bad.exit_code, bad.stdout) == ("exit", 2, b"")
        before = tool_script_path("molar_mass").read_bytes()
        scribble = await sandbox.exec(["/bin/sh", "-c", f"echo x >> {tool_script_path('molar_mass')}"])
        assert scribble.exit_code != 0 and tool_script_path("molar_mass").read_bytes() == before
    finally:
        await sandbox.destroy()
