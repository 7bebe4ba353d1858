"""The demo task: compute a molar mass with the sandboxed calculator tool, answer exactly.

Knows the task plugin Protocol and the sandbox tool's script path; nothing of Ray, NATS or torch.
An episode, as chat messages (the model's own template and tool-call format write them)::

    user:       molar mass of K2NaN2?
    assistant:  tool call calc({})          (no formula: the question's compound)
    tool:       129.200                     (the sandboxed calculator's output)
    assistant:  129.200                     (the final answer: exactly the mass)

``calc`` takes an optional ``formula``; without one it weighs the compound the question is about,
as a lab tool works on the sample in front of it. The demonstrations call it without one: a
2-layer model with rotary positions only (the demo's Llama) did not learn, within the demo's
warm start, to copy a formula from the question into the call's arguments (held-out exact copies:
0-1 of 100 after 300 supervised steps over the shapes tried, 0-48 after 600), while it copies the
tool's result into its answer (69-100 of 100; docs/task-plugins.md has the measurements). Real models copy arguments; the tiny one
learns when calling pays and what to do with the result.

Reward is 1.0 only when calc was called for the question's compound (no formula, or exactly the
question's), the final answer is exactly the true molar mass and the last turn ended by itself
(finish reason "stop"); otherwise 0.0 (no partial credit).
"""

from __future__ import annotations

import importlib.util
import random
import zlib
from functools import cache
from typing import Any

from rollmesh.chat import ToolCall, make_call_id
from rollmesh.rollout.tasks import RewardInput, SandboxCommand, TaskInputError
from rollmesh.sandbox.tool_paths import python_for_sandbox, tool_script_path

ELEMENTS = ("H", "C", "N", "O", "S", "Na", "Cl", "K", "Ca", "Fe", "Mg", "P")
MAX_COUNT = 4
# Share of formulas with 1, 2 and 3 distinct elements. One-element formulas are few and easy to
# memorise, so they are kept rare: the policy should learn to copy the tool's result instead.
ELEMENT_COUNT_WEIGHTS = (1, 3, 3)
HELD_OUT_MODULUS = 8
# Formulas are drawn so that their molar mass is in [100, 1000) g/mol: every answer then has seven
# characters ("129.200"), and the answer stands at the same distance after the tool's result in
# every episode. A 2-layer rotary-only model copies at a fixed distance within the demo's warm
# start (100 of 100 held-out answers exact after 300 steps); over answers of 5 to 7 characters it
# did not (0 of 100).
MASS_RANGE = (100.0, 1000.0)
# The user's question; the only text the model reads besides the template's (kept in one place to
# tune for the tiny demo model).
USER_PROMPT = "molar mass of {formula}?"
CALC_TOOL: dict[str, Any] = {"type": "function", "function": {
    "name": "calc",
    "description": "The molar mass in g/mol, with three decimals, of formula (by default, of the "
                   "compound the question is about).",
    "parameters": {"type": "object", "properties": {"formula": {"type": "string"}},
                   "additionalProperties": False},
}}


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
    low, high = MASS_RANGE
    found: list[str] = []
    while len(found) < count:
        formula = random_formula(rng)
        if is_held_out(formula) == held_out and low <= _calculator().molar_mass(formula) < high:
            found.append(formula)
    return found


class MolarMassTask:
    name = "molar_mass"

    def messages(self, task_input: dict[str, Any]) -> list[dict[str, Any]]:
        return [{"role": "user", "content": USER_PROMPT.format(formula=self._formula(task_input))}]

    def tools(self) -> list[dict[str, Any]]:
        return [CALC_TOOL]

    def tool_action(self, call: ToolCall, task_input: dict[str, Any]) -> SandboxCommand:
        # The schema has made sure "formula", if given, is a string; the script rejects what is not
        # a formula.
        return SandboxCommand([python_for_sandbox(), "-I", "-S", str(tool_script_path("molar_mass")),
                               self.formula_of(call, task_input)])

    def formula_of(self, call: ToolCall, task_input: dict[str, Any]) -> str:
        """The formula a calc call is about: its own, or the question's when it gives none."""
        return call.arguments.get("formula", self._formula(task_input))

    def reward(self, sample: RewardInput) -> float:
        formula = self._formula(sample.row)
        called_correctly = any(call.name == "calc" and call.arguments.get("formula", formula) == formula
                               for call in sample.tool_calls)
        answered = sample.finish_reason == "stop" and sample.final_text == true_molar_mass(formula)
        return 1.0 if called_correctly and answered else 0.0

    def sample_task_inputs(self, rng: random.Random, count: int, *, held_out: bool) -> list[dict[str, Any]]:
        return [{"formula": formula} for formula in sample_formulas(rng, count, held_out=held_out)]

    def demonstration(self, task_input: dict[str, Any], *, exact: bool,
                      rng: random.Random) -> list[dict[str, Any]]:
        """The messages after ``messages()`` of a demonstrated episode (shapes: ``DemonstrableTask``).

        Every demonstration calls the calculator. With ``exact`` the answer is the tool's result;
        without, the demonstrator rounds it to one decimal ("129.2"), which the reward does not
        accept: RL has to discover that the tool's full precision pays. (Guessing without the tool,
        as the byte-level demo model's demonstrations did, taught the 2-layer rotary model to
        guess after a tool result too: 0 of 100 answers copied, against 100 of 100 when every
        demonstration copies it; a rounded copy keeps the copying and differs in one choice, where
        to stop.)
        """
        mass = true_molar_mass(self._formula(task_input))
        answer = mass if exact else f"{float(mass):.1f}"
        call = ToolCall(id=make_call_id("openai", 0, name="calc"), name="calc", arguments={})
        return [{"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": call.id, "content": mass},
                {"role": "assistant", "content": answer, "tool_calls": []}]

    def _formula(self, task_input: dict[str, Any]) -> str:
        formula = task_input.get("formula")
        if not isinstance(formula, str) or not 0 < len(formula) <= 32:
            raise TaskInputError("task_input.formula must be a string of 1-32 characters", task=self.name)
        return formula
