"""Task plugins used only by the integration tests (loaded by the rollout worker by import path).

``GatedMolarMassTask`` is the demo task whose calculator first waits for a gate file to exist,
so a test can act (publish new weights) while a rollout is parked between two turns. The gate
(``task_input["gate"]``, a path under the test run directory) is shown read-only inside
sandboxes through ``sandbox.readonly_paths``, wherever the repository lives.
"""

from __future__ import annotations

from rollmesh.chat import ToolCall
from rollmesh.rollout.molar_mass import MolarMassTask
from rollmesh.rollout.tasks import SandboxCommand
from rollmesh.sandbox.tool_paths import python_for_sandbox, tool_script_path


class GatedMolarMassTask(MolarMassTask):
    name = "gated_molar_mass"

    def tool_action(self, call: ToolCall, task_input: dict) -> SandboxCommand:
        gate = task_input["gate"]
        script = (f'while [ ! -e "{gate}" ]; do sleep 0.02; done; '
                  f'exec {python_for_sandbox()} -I -S {tool_script_path("molar_mass")} "$1"')
        return SandboxCommand(["/bin/sh", "-c", script, "sh", self.formula_of(call, task_input)])


class SlowToolMolarMassTask(MolarMassTask):
    """The demo task whose calculator first sleeps ``task_input["tool_sleep_s"]`` seconds, so a
    fault-injection test can kill an actor while rollouts are in flight."""

    name = "slow_molar_mass"

    def tool_action(self, call: ToolCall, task_input: dict) -> SandboxCommand:
        delay = float(task_input.get("tool_sleep_s", 1.0))
        script = f'sleep {delay}; exec {python_for_sandbox()} -I -S {tool_script_path("molar_mass")} "$1"'
        return SandboxCommand(["/bin/sh", "-c", script, "sh", self.formula_of(call, task_input)])
