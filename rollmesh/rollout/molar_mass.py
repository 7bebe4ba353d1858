"""The demo task: compute a molar mass with the sandboxed calculator tool, answer exactly.

Knows the task plugin Protocol and the sandbox tool's script path; nothing of Ray, NATS or torch.
An episode reads::

    Q: molar mass of K2NaN2?          (prompt, loss mask 0)
    <calc>K2NaN2</calc>               (model; generation stops at </calc>)
    <result>129.200</result>          (tool output from the sandbox, loss mask 0)
    A: 129.200<eos>                   (model)

Reward is 1.0 only when the tool was called with the prompt's exact formula and the answer is
exactly the true molar mass; otherwise 0.0 (no partial credit).
"""

from __future__ import annotations

import importlib.util
import random
import zlib
from functools import cache
from typing import Any

from rollmesh.rollout.tasks import TaskInputError, ToolCall, Transcript
from rollmesh.rollout.tool_syntax import format_tool_output
from rollmesh.sandbox.tool_paths import python_for_sandbox, tool_script_path

ELEMENTS = ("H", "C", "N", "O", "S", "Na", "Cl", "K", "Ca", "Fe", "Mg", "P")
MAX_COUNT = 4
# Share of formulas with 1, 2 and 3 distinct elements. One-element formulas are few and easy to
# memorise, so they are kept rare: the policy should learn to copy the tool's result instead.
ELEMENT_COUNT_WEIGHTS = (1, 3, 3)
HELD_OUT_MODULUS = 8


@cache
def _calculator():
    """The sandbox tool's own module, loaded in-process for the verifier (trusted code)."""
    spec = importlib.util.spec_from_file_location("rollmesh_molar_mass_tool", tool_script_path("molar_mass"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def true_molar_mass(formula: str) -> str:
    return f"{_calculator().molar_mass(formula):.3f}"


def is_held_out(formula: str) -> bool:
    """Held-out formulas are never trained on; the split is a stable hash of the formula."""
    return zlib.crc32(formula.encode()) % HELD_OUT_MODULUS == 0


def random_formula(rng: random.Random) -> str:
    distinct = rng.choices((1, 2, 3), weights=ELEMENT_COUNT_WEIGHTS)[0]
    parts = []
    for element in rng.sample(ELEMENTS, distinct):
        count = rng.randint(1, MAX_COUNT)
        parts.append(element if count == 1 else f"{element}{count}")
    return "".join(parts)


def sample_formulas(rng: random.Random, count: int, *, held_out: bool) -> list[str]:
    found: list[str] = []
    while len(found) < count:
        formula = random_formula(rng)
        if is_held_out(formula) == held_out:
            found.append(formula)
    return found


class MolarMassTask:
    name = "molar_mass"
    tools = frozenset({"calc"})

    def build_prompt(self, task_input: dict[str, Any]) -> str:
        return f"Q: molar mass of {self._formula(task_input)}?\n"

    def tool_argv(self, call: ToolCall, task_input: dict[str, Any]) -> list[str]:
        return [python_for_sandbox(), "-I", "-S", str(tool_script_path("molar_mass")), call.argument]

    def reward(self, task_input: dict[str, Any], transcript: Transcript) -> float:
        formula = self._formula(task_input)
        called_correctly = any(call.name == "calc" and call.argument == formula for call in transcript.tool_calls)
        answered = transcript.finished_with_eos and transcript.final_text == f"A: {true_molar_mass(formula)}"
        return 1.0 if called_correctly and answered else 0.0

    def sample_task_inputs(self, rng: random.Random, count: int, *, held_out: bool) -> list[dict[str, Any]]:
        return [{"formula": formula} for formula in sample_formulas(rng, count, held_out=held_out)]

    def demonstration(self, task_input: dict[str, Any], *, uses_tool: bool,
                      rng: random.Random) -> list[tuple[str, bool]]:
        """An episode as (text, trained) segments for the supervised warm start (EOS follows).

        With ``uses_tool`` it is correct; without, the demonstrator skips the calculator and
        guesses a number near the answer, which is almost always wrong: RL has to discover
        that calling the tool pays.
        """
        formula = self._formula(task_input)
        prompt = (self.build_prompt(task_input), False)
        mass = true_molar_mass(formula)
        if not uses_tool:
            return [prompt, (f"A: {float(mass) * rng.uniform(0.7, 1.3):.3f}", True)]
        return [prompt, (f"<calc>{formula}</calc>", True), (format_tool_output(mass), False),
                (f"A: {mass}", True)]

    def _formula(self, task_input: dict[str, Any]) -> str:
        formula = task_input.get("formula")
        if not isinstance(formula, str) or not 0 < len(formula) <= 32:
            raise TaskInputError("task_input.formula must be a string of 1-32 characters", task=self.name)
        return formula
