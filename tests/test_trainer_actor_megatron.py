"""The trainer actor with ``trainer.backend = "megatron"`` on the session's Ray and NATS: it
starts its TP=2 rank processes, warm-starts, publishes a weight version and saves a Megatron
checkpoint through them, and stopping the actor stops its ranks."""

from __future__ import annotations

import subprocess
import uuid
from pathlib import Path

import pytest
import ray
import torch

pytest.importorskip("megatron.core", reason="megatron-core builds the trained model")

from support.ray_actors import stop_and_kill  # noqa: E402
from rollmesh.mesh_address import MeshAddress  # noqa: E402
from rollmesh.actors.trainer import TrainerActor  # noqa: E402
from rollmesh.config import MegatronConfig, ModelConfig, TrainerConfig  # noqa: E402
from rollmesh.engine.models import read_safetensors  # noqa: E402
from rollmesh.engine.weight_buckets import load_published  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

RANK_MODULE = "rollmesh.training.megatron_ranks"


def rank_processes() -> list[str]:
    found = subprocess.run(["pgrep", "-f", RANK_MODULE], capture_output=True, text=True)
    return found.stdout.split()


def test_the_trainer_actor_trains_on_megatron_ranks_and_stops_them(ray_session, nats_server, tmp_path, demo_model_dir):
    # The demo model (a Qwen2 with its tokenizer): the warm start writes its demonstrations in the
    # model's own chat template and tool-call format.
    model_config = ModelConfig(path=str(demo_model_dir))
    initial = read_safetensors(demo_model_dir, dtype=torch.float32)["model.embed_tokens.weight"]
    config = TrainerConfig(lr=1e-3, backend="megatron",
                           megatron=MegatronConfig(tensor_parallel=2, start_timeout_s=120, call_timeout_s=120))
    namespace = "t" + uuid.uuid4().hex[:10]
    mesh = MeshAddress(namespace=namespace, nats_url=nats_server.url, run_dir=str(tmp_path / "run"))
    before = set(rank_processes())
    actor = ray.remote(TrainerActor).options(name=f"trainer-{namespace}", namespace=namespace, num_cpus=0).remote(
        f"trainer-{namespace}", mesh, config, model_config)
    try:
        ray.get(actor.start.remote(), timeout=180)
        assert len(set(rank_processes()) - before) == 2
        warm = ray.get(actor.warm_start.remote("rollmesh.rollout.molar_mass:MolarMassTask", steps=1, batch_size=2,
                                               lr=1e-3, exact_fraction=0.0, seed=0), timeout=120)
        assert warm["weight_version"] == 1 and warm["loss"] > 0
        published = sorted((tmp_path / "run" / "weights").glob("v*"))
        assert published, "a weight version was published"
        weights = load_published(published[-1] / "manifest.json")
        assert weights["model.embed_tokens.weight"].shape == initial.shape
        assert not torch.equal(weights["model.embed_tokens.weight"].float(), initial)
        checkpoint = ray.get(actor.save_checkpoint.remote(), timeout=120)
        # Step 0 (the warm start is no RL step), in megatron's torch_dist layout.
        assert checkpoint.endswith("iter_0000000") and (Path(checkpoint) / ".metadata").is_file()
        assert (tmp_path / "run" / "logs" / "megatron_rank1.log").is_file()
    finally:
        stop_and_kill(actor)
    assert not set(rank_processes()) - before, "stopping the trainer stops its rank processes"
