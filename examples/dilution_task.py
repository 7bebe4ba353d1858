"""A task plugin of your own: a lab-dilution question with two tools (docs/task-plugins.md).

Register it by import path (this directory on ``PYTHONPATH``)::

    [rollout]
    tasks = ["rollmesh.rollout.molar_mass:MolarMassTask", "dilution_task:DilutionTask"]

The model is asked how much stock solution makes a dilution (C1 V1 = C2 V2). It may call
``python`` (any code, run in the rollout's sandbox) or ``dilute`` (the formula, computed by this
trusted task code in the worker, no sandbox needed). It is rewarded for answering exactly the
volume in mL with three decimals. tests/test_examples.py runs a rollout of it.
"""

from __future__ import annotations

import random
from typing import Any

from rollmesh.chat import ToolCall
from rollmesh.rollout.tasks import PythonTool, RewardInput, SandboxCommand, TaskInputError
from rollmesh.sandbox.tool_paths import python_for_sandbox

SYSTEM = "You are a lab assistant. Answer with the volume in mL only, with three decimals."
QUESTION = "How many mL of a {stock} M stock solution make {volume} mL of a {target} M solution?"


def stock_volume_ml(stock: float, target: float, volume: float) -> str:
    return f"{target * volume / stock:.3f}"


class DilutionTask:
    name = "dilution"

    def messages(self, task_input: dict[str, Any]) -> list[dict[str, Any]]:
        return [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": QUESTION.format(**self._read(task_input))}]

    def tools(self) -> list[dict[str, Any]]:
        return [
            {"type": "function", "function": {
                "name": "python", "description": "Run Python code; its standard output is returned.",
                "parameters": {"type": "object", "properties": {"code": {"type": "string"}},
                               "required": ["code"]}}},
            {"type": "function", "function": {
                "name": "dilute", "description": "The stock volume in mL for a dilution (C1 V1 = C2 V2).",
                "parameters": {"type": "object", "properties": {
                    "stock_molar": {"type": "number", "exclusiveMinimum": 0},
                    "target_molar": {"type": "number", "minimum": 0},
                    "volume_ml": {"type": "number", "minimum": 0}},
                    "required": ["stock_molar", "target_molar", "volume_ml"]}}},
        ]

    def tool_action(self, call: ToolCall, task_input: dict[str, Any]) -> SandboxCommand | PythonTool:
        # The arguments already match the tool's schema (a call that does not never gets here).
        if call.name == "python":
            return SandboxCommand([python_for_sandbox(), "-I", "-c", call.arguments["code"]])
        args = call.arguments
        return PythonTool(lambda: stock_volume_ml(args["stock_molar"], args["target_molar"], args["volume_ml"]))

    def reward(self, sample: RewardInput) -> float:
        expected = stock_volume_ml(**self._read(sample.row))  # row: the request's task_input
        return 1.0 if sample.finish_reason == "stop" and sample.final_text.strip() == expected else 0.0

    def sample_task_inputs(self, rng: random.Random, count: int, *, held_out: bool) -> list[dict[str, Any]]:
        """Random dilutions (``rollmesh submit --task dilution``); held-out ones use odd stock molarities."""
        inputs = []
        while len(inputs) < count:
            stock = rng.randint(2, 20)
            if (stock % 2 == 1) == held_out:
                inputs.append({"stock": float(stock), "target": round(rng.uniform(0.1, 1.0), 2),
                               "volume": float(rng.choice((50, 100, 250, 500)))})
        return inputs

    def demonstration(self, task_input: dict[str, Any], *, exact: bool,
                      rng: random.Random) -> list[dict[str, Any]]:
        """A demonstrated episode after ``messages()``: assistant turns carry ``ToolCall`` objects."""
        values = self._read(task_input)
        answer = stock_volume_ml(**values)
        if not exact:
            return [{"role": "assistant", "content": f"{float(answer) * rng.uniform(0.8, 1.2):.3f}", "tool_calls": []}]
        call = ToolCall(id="call_0", name="dilute", arguments={
            "stock_molar": values["stock"], "target_molar": values["target"], "volume_ml": values["volume"]})
        return [{"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": call.id, "content": answer},
                {"role": "assistant", "content": answer, "tool_calls": []}]

    def _read(self, task_input: dict[str, Any]) -> dict[str, float]:
        try:
            values = {key: float(task_input[key]) for key in ("stock", "target", "volume")}
        except (KeyError, TypeError, ValueError) as exc:
            raise TaskInputError("task_input needs numbers stock, target and volume", task=self.name) from exc
        if values["stock"] <= 0:
            raise TaskInputError("stock must be above 0 M", task=self.name)
        return values
