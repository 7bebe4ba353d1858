"""What the Serve app's unit tests share: the demo model as the app serves it, a tool and a question.

Knows the Serve app's ``ServedModel`` and ``rollmesh.chat``; test data only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rollmesh.chat import ChatModel
from rollmesh.config import ModelConfig
from rollmesh.serve_apps import ServedModel

CALC = {"type": "function", "function": {
    "name": "calc", "description": "molar mass of a formula",
    "parameters": {"type": "object", "properties": {"formula": {"type": "string"}},
                   "required": ["formula"]}}}
QUESTION = {"role": "user", "content": "molar mass of H2O?"}


def demo_served_model(demo_model_dir: Path) -> ServedModel:
    """The demo model directory as a Serve replica holds it (its context: 256 positions)."""
    chat = ChatModel.from_config(ModelConfig(path=str(demo_model_dir)))
    return ServedModel(name="demo", max_seq_len=256, vocab_size=chat.vocab_size, chat=chat)


def start_inference_workers(namespace: str, mesh: Any, model: ModelConfig, inference: Any) -> tuple[Any, Any]:
    """One prefill and one decode worker actor, named as the Serve app finds them
    (``prefill-<ns>``, ``decode-<ns>``), started; the caller stops them (``stop_and_kill``)."""
    import ray

    from rollmesh.actors.inference_workers import DecodeWorkerActor, PrefillWorkerActor

    prefill = ray.remote(PrefillWorkerActor).options(
        name=f"prefill-{namespace}", namespace=namespace, num_cpus=0
    ).remote(f"prefill-{namespace}", mesh, model, inference)
    decode = ray.remote(DecodeWorkerActor).options(
        name=f"decode-{namespace}", namespace=namespace, num_cpus=0
    ).remote(f"decode-{namespace}", mesh, model, inference)
    try:
        ray.get([prefill.start.remote(), decode.start.remote()], timeout=60)
    except BaseException:
        from support.ray_actors import stop_and_kill

        stop_and_kill(decode, prefill)
        raise
    return prefill, decode
