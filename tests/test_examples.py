"""The examples and deploy files the README points at work as it says.

examples/bare_nats_client.py runs as a subprocess against the session's nats-server; the test plays
the mesh's rollout worker (reads the stored request, publishes its completion). Its default, the
latest run's mesh.json, is also run against a real mesh in test_readme_commands.py.
examples/make_arithmetic_data.py runs as the README runs it, into a temporary folder, and the
examples' run files (train_midtrain, train_sft, train_rl, train_pipeline) are loaded and checked
there as `rollmesh train` checks a run file before anything starts (test_train_job.py runs
`rollmesh train` itself; benchmarks/README.md records the pipeline's measured run).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest

from rollmesh.bus.embedded_server import find_nats_server_binary
from rollmesh.bus.publisher import BusPublisher
from rollmesh.bus.streams import ensure_streams
from rollmesh.config import load_config
from rollmesh.messages import RolloutCompleted
from rollmesh.messages.subjects import ROLLOUT_COMPLETED, ROLLOUT_REQUESTED
from rollmesh.train.checks import RunFileError, check_stages

REPO_ROOT = Path(__file__).resolve().parent.parent
BARE_CLIENT = REPO_ROOT / "examples" / "bare_nats_client.py"
ARITHMETIC_DATA = REPO_ROOT / "examples" / "make_arithmetic_data.py"
# Each example run file and the kinds of its stages, in order.
RUN_FILES = {"train_midtrain.toml": ["midtrain"], "train_sft.toml": ["sft"], "train_rl.toml": ["rl"],
             "train_pipeline.toml": ["midtrain", "sft", "rl"]}


@pytest.mark.unit
def test_example_requests_are_valid_for_the_schema_and_the_subject():
    schema = json.loads((REPO_ROOT / "docs" / "schemas" / "rollout.requested.json").read_text())
    lines = (REPO_ROOT / "examples" / "requests.jsonl").read_text().splitlines()
    assert len(lines) >= 3
    ids = []
    for line in lines:
        jsonschema.validate(json.loads(line), schema)
        request = ROLLOUT_REQUESTED.decode(line.encode())
        assert request.task == "molar_mass" and request.task_input["formula"]
        ids.append(request.rollout_id)
    assert len(set(ids)) == len(ids)


@pytest.mark.unit
def test_the_single_machine_config_is_only_the_packaged_one():
    """deploy/local.toml was a commented copy of the packaged defaults that a test kept equal; the
    packaged file now carries the comments, and nothing may point at the removed copy."""
    assert not (REPO_ROOT / "deploy" / "local.toml").exists()
    files = [REPO_ROOT / "README.md", REPO_ROOT / "Makefile", REPO_ROOT / "pyproject.toml"] + [
        path for top in ("deploy", "docs", "examples", "rollmesh", "scripts", "benchmarks", "tests")
        for path in (REPO_ROOT / top).rglob("*")
        if path.is_file() and "__pycache__" not in path.parts and path.name != "test_examples.py"
        and path.suffix in {".md", ".py", ".toml", ".yaml", ".yml", ".sh", ".sbatch", ".conf", ".txt"}]
    pointing = [str(path.relative_to(REPO_ROOT)) for path in files if "deploy/local.toml" in path.read_text()]
    assert pointing == []


@pytest.mark.unit
@pytest.mark.timeout(30)
def test_nats_cluster_example_is_a_valid_nats_server_config():
    checked = subprocess.run([str(find_nats_server_binary()), "-t", "-c", str(REPO_ROOT / "deploy" / "nats-cluster.conf")],
                             capture_output=True, text=True, timeout=20)
    assert checked.returncode == 0, checked.stderr + checked.stdout
    assert "is valid" in checked.stderr + checked.stdout


@pytest.mark.unit
def test_bare_client_imports_nothing_of_rollmesh():
    source = BARE_CLIENT.read_text()
    assert "rollmesh" not in "".join(line for line in source.splitlines() if line.startswith(("import", "from")))


async def run_bare_client(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items() if key != "ROLLMESH_RUN_ROOT"}
    process = await asyncio.create_subprocess_exec(
        sys.executable, str(BARE_CLIENT), *args, cwd=cwd, env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    stdout, stderr = await asyncio.wait_for(process.communicate(), timeout=60)
    return subprocess.CompletedProcess([], process.returncode, stdout.decode(), stderr.decode())


async def with_rollout_worker(nats_client, namespace: str, client_run, seen: list) -> subprocess.CompletedProcess:
    """Run the client while playing the mesh's rollout worker: each request comes back completed."""
    js = nats_client.jetstream()
    await ensure_streams(js, namespace)  # as the mesh does when it starts
    publisher = BusPublisher(nats_client, js, namespace)
    requests = await nats_client.subscribe(ROLLOUT_REQUESTED.format(namespace))

    async def rollout_worker() -> None:
        async for msg in requests.messages:
            request = ROLLOUT_REQUESTED.decode(msg.data)  # the hand-written JSON passes the real decoder
            seen.append((request, msg.headers))
            await publisher.publish(ROLLOUT_COMPLETED, RolloutCompleted(
                rollout_id=request.rollout_id, task=request.task, group_id=request.group_id,
                purpose=request.purpose, reward=1.0, turns=2, tool_calls=1, prompt_len=1, tokens=[1],
                loss_mask=[0], logprobs=[0.0], versions=[-1], text="A: 18.015"))

    worker = asyncio.create_task(rollout_worker())
    try:
        return await client_run
    finally:
        worker.cancel()
        await requests.unsubscribe()


def write_run(run_root: Path, name: str, nats_url: str, namespace: str) -> Path:
    """A run directory as ``rollmesh up`` leaves it, as far as a client is concerned."""
    run_dir = run_root / name
    run_dir.mkdir(parents=True)
    (run_dir / "mesh.json").write_text(json.dumps({"nats_url": nats_url, "namespace": namespace,
                                                   "run_dir": str(run_dir)}))
    return run_dir


@pytest.mark.integration
@pytest.mark.timeout(90)
async def test_bare_client_gets_its_reward_from_a_mesh(nats_server, nats_client, namespace):
    seen: list = []
    done = await with_rollout_worker(nats_client, namespace, run_bare_client(
        "--nats-url", nats_server.url, "--namespace", namespace, "--formula", "H2O", "--timeout", "30"), seen)
    assert done.returncode == 0, done.stderr
    assert "reward 1.0 after 2 turn(s), 1 tool call(s)" in done.stdout
    (request, headers), = seen
    assert request.task_input == {"formula": "H2O"} and request.purpose == "eval"
    assert headers["Nats-Msg-Id"] == f"rollout.requested:{request.rollout_id}"


@pytest.mark.integration
@pytest.mark.timeout(90)
async def test_bare_client_reaches_the_mesh_of_the_latest_run_by_default(nats_server, nats_client, namespace,
                                                                        tmp_path):
    # Run names sort by start time: the older run names a port nothing listens on.
    run_root = tmp_path / ".rollmesh" / "runs"
    write_run(run_root, "20260101-000000-aaaaaa", "nats://127.0.0.1:1", "older")
    write_run(run_root, "20260101-000001-bbbbbb", nats_server.url, namespace)
    seen: list = []
    done = await with_rollout_worker(nats_client, namespace,
                                     run_bare_client("--timeout", "30", cwd=tmp_path), seen)
    assert done.returncode == 0, done.stderr
    assert "reward 1.0" in done.stdout
    assert len(seen) == 1


@pytest.mark.integration
@pytest.mark.timeout(90)
async def test_bare_client_reads_the_run_dir_it_is_given(nats_server, nats_client, namespace, tmp_path):
    chosen = write_run(tmp_path, "20260101-000000-aaaaaa", nats_server.url, namespace)
    write_run(tmp_path, "20260101-000001-bbbbbb", "nats://127.0.0.1:1", "newer")
    seen: list = []
    done = await with_rollout_worker(nats_client, namespace, run_bare_client(
        "--run-dir", str(chosen), "--timeout", "30", cwd=tmp_path), seen)
    assert done.returncode == 0, done.stderr
    assert len(seen) == 1


@pytest.mark.unit
@pytest.mark.timeout(90)
async def test_bare_client_says_where_it_looked_when_there_is_no_mesh(tmp_path):
    done = await run_bare_client("--timeout", "5", cwd=tmp_path)
    assert done.returncode == 1
    assert "no runs under .rollmesh/runs" in done.stderr
    stopped = tmp_path / ".rollmesh" / "runs" / "20260101-000000-aaaaaa"
    stopped.mkdir(parents=True)  # `rollmesh down` removes mesh.json
    done = await run_bare_client("--timeout", "5", cwd=tmp_path)
    assert done.returncode == 1
    assert f"{Path('.rollmesh/runs/20260101-000000-aaaaaa/mesh.json')} does not exist" in done.stderr


@pytest.mark.integration
@pytest.mark.timeout(90)
async def test_bare_client_says_so_when_no_mesh_made_the_streams(nats_server, namespace):
    done = await run_bare_client("--nats-url", nats_server.url, "--namespace", namespace, "--timeout", "5")
    assert done.returncode == 1
    assert "is the mesh up" in done.stderr


@pytest.mark.unit
@pytest.mark.timeout(60)
async def test_the_task_plugin_example_loads_by_import_path_and_a_rollout_of_it_runs_both_its_tools(
        monkeypatch, demo_model_dir):
    from support.fakes import RecordingPublisher, ScriptedEngine
    from rollmesh.chat import ChatModel, ToolCall
    from rollmesh.config import ModelConfig, RolloutConfig
    from rollmesh.engine.protocols import GenerationResult
    from rollmesh.messages import (SandboxExecReply, SandboxHeartbeatReply, SandboxLeaseReply,
                                   SandboxReleaseReply)
    from rollmesh.messages.subjects import (SANDBOX_EXEC, SANDBOX_HEARTBEAT, SANDBOX_LEASE, SANDBOX_RELEASE)
    from rollmesh.ports import MessageContext
    from rollmesh.rollout.agent_loop import RolloutWorkerLogic
    from rollmesh.rollout.saved_state import InMemoryRolloutStates
    from rollmesh.rollout.tasks import DemonstrableTask, TaskRegistry
    from rollmesh.messages import RolloutRequested, SamplingParams

    monkeypatch.syspath_prepend(str(REPO_ROOT / "examples"))
    registry = TaskRegistry.from_import_paths(["dilution_task:DilutionTask"])
    task = registry.get("dilution")
    assert isinstance(task, DemonstrableTask)
    chat = ChatModel.load(demo_model_dir)

    def turn(text: str) -> GenerationResult:
        ids = chat.encode(text)
        return GenerationResult(ids, [-0.5] * len(ids), [0] * len(ids), "eos", 0)

    calls = [ToolCall(id="", name="python", arguments={"code": "print(0.5 * 100 / 10)"}),
             ToolCall(id="", name="dilute", arguments={"stock_molar": 10, "target_molar": 0.5, "volume_ml": 100})]
    engine = ScriptedEngine([turn(chat.write_turn(content="", calls=calls)), turn(chat.write_turn(content="5.000"))])
    bus = RecordingPublisher(default_replies={
        SANDBOX_LEASE: SandboxLeaseReply(lease_id="lease-1", backend="fake"),
        SANDBOX_EXEC: SandboxExecReply(result="exit", exit_code=0, stdout=b"5.0\n"),
        SANDBOX_HEARTBEAT: SandboxHeartbeatReply(expires_at=1e9),
        SANDBOX_RELEASE: SandboxReleaseReply(released=True)})
    states = InMemoryRolloutStates()
    runner = RolloutWorkerLogic(RolloutConfig(strict_tokenization=True), ModelConfig(path=str(demo_model_dir)),
                           chat=chat, tasks=registry, engine=engine, publisher=bus, states=states,
                           max_seq_len=2048)  # its system prompt and two tools outgrow the demo's 256 positions
    request = RolloutRequested(rollout_id="d-1", task="dilution",
                               task_input={"stock": 10, "target": 0.5, "volume": 100},
                               sampling=SamplingParams(max_new_tokens=200))
    await runner.handle_requested(request, MessageContext(subject="test"))

    (completed,) = bus.messages(ROLLOUT_COMPLETED)
    assert (completed.reward, completed.tool_calls, completed.finish_reason) == (1.0, 2, "stop")
    assert completed.tokenization_mismatches["non_assistant"] == 0
    (exec_request,) = bus.requested(SANDBOX_EXEC)  # python ran in the sandbox; dilute in the worker
    assert exec_request.argv[-2:] == ["-c", "print(0.5 * 100 / 10)"]
    results = [m for m in states.states["d-1"].messages if m["role"] == "tool"]
    assert [(m["tool_call_id"], m["content"]) for m in results] == [("call_0", "5.0"), ("call_1", "5.000")]


def make_arithmetic_data(out: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ARITHMETIC_DATA), "--out", str(out), *args],
                          capture_output=True, text=True, timeout=60)


def read_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_the_arithmetic_data_is_right_eval_rows_are_held_out_and_a_seed_writes_the_same_files(tmp_path):
    done = make_arithmetic_data(tmp_path / "a", "--train", "300", "--eval", "60", "--seed", "3", "--max-operand", "20")
    assert done.returncode == 0, done.stderr
    train = read_rows(tmp_path / "a" / "arithmetic_train.jsonl")
    held_out = read_rows(tmp_path / "a" / "arithmetic_eval.jsonl")
    assert (len(train), len(held_out)) == (300, 60)
    operators = set()
    for row in train + held_out:
        a, op, b = re.fullmatch(r"What is (\d+) ([+-]) (\d+)\?", row["prompt"]).groups()
        assert row["answer"] == str(int(a) + int(b) if op == "+" else int(a) - int(b))
        assert int(row["answer"]) >= 0 and max(int(a), int(b)) <= 20
        operators.add(op)
    assert operators == {"+", "-"}
    prompts = [row["prompt"] for row in train]
    assert len(set(prompts)) == len(prompts)
    assert not set(prompts) & {row["prompt"] for row in held_out}
    # The sft and midtrain files are the training rows, row for row: the eval rows stay held out.
    # Half the demonstrations (--sft-exact 0.5, by seed) answer exactly, the rest off by one.
    sft = read_rows(tmp_path / "a" / "arithmetic_sft.jsonl")
    assert [[m["role"] for m in item["messages"]] for item in sft] == [["user", "assistant"]] * len(train)
    assert [item["messages"][0]["content"] for item in sft] == prompts
    errors = [int(item["messages"][1]["content"]) - int(row["answer"]) for item, row in zip(sft, train)]
    assert set(errors) == {-1, 0, 1} and 0.35 < errors.count(0) / len(errors) < 0.65
    assert all(int(item["messages"][1]["content"]) >= 0 for item in sft)
    exact = make_arithmetic_data(tmp_path / "exact", "--train", "300", "--eval", "60", "--seed", "3",
                                 "--max-operand", "20", "--sft-exact", "1")
    assert exact.returncode == 0, exact.stderr
    assert [item["messages"][1]["content"] for item in read_rows(tmp_path / "exact" / "arithmetic_sft.jsonl")] == [
        row["answer"] for row in train]
    text = read_rows(tmp_path / "a" / "arithmetic_text.jsonl")
    assert [item["text"] for item in text] == [
        row["prompt"].removeprefix("What is ").removesuffix("?") + " = " + row["answer"] for row in train]
    again = make_arithmetic_data(tmp_path / "b", "--train", "300", "--eval", "60", "--seed", "3", "--max-operand", "20")
    assert again.returncode == 0, again.stderr
    for name in ("arithmetic_train.jsonl", "arithmetic_eval.jsonl", "arithmetic_sft.jsonl", "arithmetic_text.jsonl"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    # More rows than there are distinct problems: refused, nothing written.
    refused = make_arithmetic_data(tmp_path / "c", "--train", "600", "--eval", "100", "--max-operand", "20")
    assert refused.returncode == 2 and "distinct problems" in refused.stderr
    assert not (tmp_path / "c").exists()


@pytest.mark.unit
@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", sorted(RUN_FILES))
def test_each_example_run_file_loads_and_passes_the_run_file_checks_on_the_generated_data(tmp_path, name):
    # The run file's data paths are relative to the run file: a copy beside the generated data/.
    done = make_arithmetic_data(tmp_path / "data", "--train", "40", "--eval", "8")
    assert done.returncode == 0, done.stderr
    run_file = Path(shutil.copy(REPO_ROOT / "examples" / name, tmp_path / name))
    config = load_config(run_file, environ={})
    check_stages(config)
    assert [stage.kind for stage in config.stages] == RUN_FILES[name]
    assert all(Path(stage.data).parent == tmp_path / "data" for stage in config.stages + config.eval)
    for stage in config.stages:
        assert [spec.name for spec in stage.rewards] == (["math"] if stage.kind == "rl" else [])
    assert config.model.path == "" and not config.serve.enabled  # the embedded demo model, no Serve app
    # Without its data the same file is refused before anything starts, naming the file.
    missing = Path(config.stages[-1].data)
    missing.unlink()
    with pytest.raises(RunFileError, match=missing.name):
        check_stages(load_config(run_file, environ={}))


@pytest.mark.unit
def test_the_readmes_data_command_writes_where_the_example_run_files_read():
    readme = (REPO_ROOT / "README.md").read_text()
    (command,) = [line.split("  #")[0] for line in readme.splitlines()
                  if line.startswith("python examples/make_arithmetic_data.py")]
    words = shlex.split(command)
    out = REPO_ROOT / words[words.index("--out") + 1]  # the README's commands run from the repo root
    written = {"arithmetic_train.jsonl", "arithmetic_eval.jsonl", "arithmetic_sft.jsonl", "arithmetic_text.jsonl"}
    for name in RUN_FILES:
        config = load_config(REPO_ROOT / "examples" / name, environ={})
        for part in config.stages + config.eval:
            assert Path(part.data).parent == out and Path(part.data).name in written, (name, part.data)
    assert "rollmesh train examples/train_pipeline.toml" in readme
