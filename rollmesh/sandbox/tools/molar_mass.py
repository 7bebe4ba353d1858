"""Sandbox tool: the molar mass of a chemical formula, e.g. ``K2NaN2`` -> ``129.200``.

Runs inside a sandbox as ``python3 -I -S molar_mass.py FORMULA``, so it knows the standard library
only and must stay runnable on its own (no rollmesh, no site packages). Trusted code may also load
it with importlib to compute the same answer in-process (the task's verifier does).

A formula is element symbols, each followed by an optional count (``H2O``, ``CaCl2``, ``CH3COOH``);
no parentheses, hydrates or charges. Prints the mass with 3 decimals and exits 0; a malformed
formula or an unknown element prints one line to stderr and exits 2.
"""

from __future__ import annotations

import re
import sys
from decimal import Decimal

# Standard atomic weights (conventional values, g/mol). Strings, so sums are exact decimals and
# the third decimal never depends on binary rounding.
ATOMIC_WEIGHTS = {
    "H": Decimal("1.008"),
    "C": Decimal("12.011"),
    "N": Decimal("14.007"),
    "O": Decimal("15.999"),
    "Na": Decimal("22.990"),
    "Mg": Decimal("24.305"),
    "P": Decimal("30.974"),
    "S": Decimal("32.06"),
    "Cl": Decimal("35.45"),
    "K": Decimal("39.098"),
    "Ca": Decimal("40.078"),
    "Fe": Decimal("55.845"),
}
MAX_FORMULA_CHARS = 64
# An element symbol, then a count without leading zeros; bounded so no input is absurdly large.
_PART = re.compile(r"([A-Z][a-z]?)([1-9][0-9]{0,5})?")
EXIT_BAD_FORMULA = 2


class FormulaError(ValueError):
    """The formula is malformed or names an element we have no weight for."""


def parse_formula(formula: str) -> dict[str, int]:
    """``"CH3COOH"`` -> ``{"C": 2, "H": 4, "O": 2}`` (repeated symbols add up)."""
    if not formula:
        raise FormulaError("empty formula")
    if len(formula) > MAX_FORMULA_CHARS:
        raise FormulaError(f"formula longer than {MAX_FORMULA_CHARS} characters")
    counts: dict[str, int] = {}
    position = 0
    while position < len(formula):
        match = _PART.match(formula, position)
        if match is None:
            raise FormulaError(f"malformed formula {formula!r} at position {position}")
        symbol, count = match.group(1), match.group(2)
        if symbol not in ATOMIC_WEIGHTS:
            raise FormulaError(f"unknown element {symbol!r}")
        counts[symbol] = counts.get(symbol, 0) + int(count or 1)
        position = match.end()
    return counts


def molar_mass_exact(formula: str) -> Decimal:
    return sum((ATOMIC_WEIGHTS[symbol] * count for symbol, count in parse_formula(formula).items()), Decimal(0))


def molar_mass(formula: str) -> float:
    return float(molar_mass_exact(formula))


def format_mass(formula: str) -> str:
    return f"{molar_mass_exact(formula):.3f}"


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: molar_mass.py FORMULA", file=sys.stderr)
        return EXIT_BAD_FORMULA
    try:
        print(format_mass(argv[0]))
    except FormulaError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_FORMULA
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
