"""The demo as a training job: the built-in run file (``deploy_defaults/demo.toml``), its sizes
from the CLI, and the demonstrations its warm start trains on.

Knows the config, the molar-mass task plugin and the chat message shapes; nothing of the mesh.
``rollmesh demo`` is ``rollmesh train`` on this run file: an ``sft`` stage (the warm start), an
``rl`` stage and an ``[[eval]]`` of held-out formulas.
"""

from __future__ import annotations

import json
import random
import tomllib
from pathlib import Path
from typing import Any

import msgspec

from rollmesh.config import RollmeshConfig
from rollmesh.rollout.molar_mass import MolarMassTask

DEMO_RUN_FILE = Path(__file__).resolve().parent.parent / "deploy_defaults" / "demo.toml"
DEMONSTRATIONS_FILE = "demo_sft.jsonl"
# Share of demonstrations whose answer is exactly right (the rest answer almost right: they round
# the tool's result), so RL starts low and has something to learn.
EXACT_FRACTION = 0.3
# Demonstrations a warm-start step trains on (the run file's batch_tokens is about this many).
DEMONSTRATIONS_PER_STEP = 64


def demo_job_config(config: RollmeshConfig, run_dir: Path, *, rl_steps: int | None = None,
                    sft_steps: int | None = None, eval_every: int | None = None,
                    eval_size: int | None = None) -> RollmeshConfig:
    """``config`` (the mesh's) with the demo's stages and evaluation, sized by the CLI's options;
    ``sft_steps`` 0 leaves the warm start out. The warm start's demonstrations are written into
    ``run_dir``."""
    run_file = tomllib.loads(DEMO_RUN_FILE.read_text())
    warm, rl = run_file["stages"]
    (held_out,) = run_file["eval"]
    for table, key, value in ((rl, "steps", rl_steps), (warm, "steps", sft_steps),
                              (held_out, "eval_every", eval_every), (held_out, "size", eval_size)):
        if value is not None:
            table[key] = value
    for table in (warm, rl, held_out):
        table["seed"] = table.get("seed", 0) + config.demo.seed
    stages = [rl]
    if warm["steps"]:
        data = Path(run_dir) / DEMONSTRATIONS_FILE
        write_demonstrations(data, warm["steps"] * DEMONSTRATIONS_PER_STEP, seed=config.demo.seed)
        warm["data"] = str(data)
        stages.insert(0, warm)
    raw = msgspec.to_builtins(config)
    raw["stages"], raw["eval"] = stages, [held_out]
    return msgspec.convert(raw, RollmeshConfig)


def write_demonstrations(path: Path, count: int, *, seed: int) -> Path:
    """``count`` demonstrated episodes of the molar-mass task as chat rows (``messages`` with the
    tool call and its result, and the task's ``tools``), EXACT_FRACTION of them exactly right."""
    task, rng = MolarMassTask(), random.Random(seed)
    tools = task.tools()
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as out:
        for task_input in task.sample_task_inputs(rng, count, held_out=False):
            follow = task.demonstration(task_input, exact=rng.random() < EXACT_FRACTION, rng=rng)
            messages = [*task.messages(task_input), *(_openai(message) for message in follow)]
            out.write(json.dumps({"messages": messages, "tools": tools}) + "\n")
    return path


def _openai(message: dict[str, Any]) -> dict[str, Any]:
    """A demonstration's message as a dataset row holds it: tool calls in OpenAI's shape."""
    calls = message.get("tool_calls") or []
    shaped = {key: value for key, value in message.items() if key != "tool_calls"}
    if calls:
        shaped["tool_calls"] = [call.to_openai() if hasattr(call, "to_openai") else call for call in calls]
    return shaped
