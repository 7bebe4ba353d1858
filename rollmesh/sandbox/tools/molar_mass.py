"""Sandbox tool: the molar mass of a chemical formula, e.g. ``K2NaN2`` -> ``129.200``.

Runs inside a sandbox as ``python3 -I -S molar_mass.py FORMULA``, so it knows the standard library
only and must stay runnable on its own (no rollmesh, no site packages). Trusted code may also load
it with importlib to compute the same answer in-process (the task's verifier does).

A formula is element symbols, each followed by an optional count (``H2O``, ``CaCl2``, ``CH3COOH``);
no parentheses, hydrates or charges. Prints the mass with 3 decimals and exits 0; a malformed
formula or an unknown element prints one line to stderr and exits 2.
"""

from __future__ import annotations

import sys

# Standard atomic weights (conventional values), in thousandths of a g/mol: integers, so sums are
# exact and the third decimal never depends on binary rounding. No re or decimal: this script
# starts once per tool call, and those imports were half of its start.
ATOMIC_WEIGHTS_MILLI = {
    "H": 1008,
    "C": 12011,
    "N": 14007,
    "O": 15999,
    "Na": 22990,
    "Mg": 24305,
    "P": 30974,
    "S": 32060,
    "Cl": 35450,
    "K": 39098,
    "Ca": 40078,
    "Fe": 55845,
}
MAX_FORMULA_CHARS = 64
# A count has no leading zero and at most this many digits, so no input is absurdly large.
MAX_COUNT_DIGITS = 6
EXIT_BAD_FORMULA = 2


class FormulaError(ValueError):
    """The formula is malformed or names an element we have no weight for."""


def parse_formula(formula: str) -> dict[str, int]:
    """``"CH3COOH"`` -> ``{"C": 2, "H": 4, "O": 2}`` (repeated symbols add up).

    Each part is an element symbol (an ASCII capital, then an optional small letter) and an
    optional count (1-9, then up to five more digits)."""
    if not formula:
        raise FormulaError("empty formula")
    if len(formula) > MAX_FORMULA_CHARS:
        raise FormulaError(f"formula longer than {MAX_FORMULA_CHARS} characters")
    counts: dict[str, int] = {}
    position, size = 0, len(formula)
    while position < size:
        if not "A" <= formula[position] <= "Z":
            raise FormulaError(f"malformed formula {formula!r} at position {position}")
        symbol_end = position + 1
        if symbol_end < size and "a" <= formula[symbol_end] <= "z":
            symbol_end += 1
        count_end = symbol_end
        if count_end < size and "1" <= formula[count_end] <= "9":
            count_end += 1
            while (count_end < size and count_end - symbol_end < MAX_COUNT_DIGITS
                   and "0" <= formula[count_end] <= "9"):
                count_end += 1
        symbol = formula[position:symbol_end]
        if symbol not in ATOMIC_WEIGHTS_MILLI:
            raise FormulaError(f"unknown element {symbol!r}")
        counts[symbol] = counts.get(symbol, 0) + int(formula[symbol_end:count_end] or 1)
        position = count_end
    return counts


def molar_mass_milli(formula: str) -> int:
    """The exact molar mass in thousandths of a g/mol."""
    return sum(ATOMIC_WEIGHTS_MILLI[symbol] * count for symbol, count in parse_formula(formula).items())


def molar_mass(formula: str) -> float:
    return molar_mass_milli(formula) / 1000


def format_mass(formula: str) -> str:
    milli = molar_mass_milli(formula)
    return f"{milli // 1000}.{milli % 1000:03d}"


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
