"""The W&B tracker against the real ``wandb`` package, offline: the run directory under
``<run_dir>/wandb`` holds the config, two steps of scalars and a sample table, and ``wandb sync
--dry-run`` would upload it; nothing wandb starts outlives ``close``; online without an API key is a
TrackerError. wandb 0.31 reads its ``.wandb`` transaction log only in its Go service, so the log's
framing (a LevelDB log of protobuf ``Record``s) is read here, each record by wandb's own protobuf."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from rollmesh.run_config import TrackingConfig
from rollmesh.tracking import TrackerError, open_trackers

pytestmark = pytest.mark.unit

CONFIG = {"model": {"path": "/models/tiny"}, "trainer": {"lr": 1e-5}, "stages": [{"kind": "rl"}],
          "serve": {"api_key_file": "/secrets/key"}}
ROWS = [{"prompt": "1+1=?", "completion": "2", "reward": 1.0, "rewards/math": 1.0},
        {"prompt": "2+2=?", "completion": "5", "reward": 0.0, "rewards/math": 0.0}]
BLOCK = 32768  # LevelDB log: 32 KiB blocks of chunks (crc32 u32, length u16, type u8, data)


def wandb_records(path: Path) -> Iterator:
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    position, record = 7, b""  # header: ident, magic u16, version u8
    while position + 7 <= len(data):
        if BLOCK - position % BLOCK < 7:  # a block's tail too short for a chunk header is padding
            position += BLOCK - position % BLOCK
            continue
        _, length, kind = struct.unpack("<IHB", data[position:position + 7])
        record += data[position + 7:position + 7 + length]
        position += 7 + length
        if kind in (1, 4):  # full, last
            yield wandb_internal_pb2.Record.FromString(record)
            record = b""


def wandb_core_processes() -> list[psutil.Process]:
    return [p for p in psutil.Process().children(recursive=True) if "wandb-core" in p.name()]


@pytest.fixture(scope="module")
def wandb_env(tmp_path_factory) -> Iterator[pytest.MonkeyPatch]:
    home = tmp_path_factory.mktemp("home")
    with pytest.MonkeyPatch.context() as patch:
        # No account, no settings or ~/.netrc of the machine's, no error reports, nothing printed.
        patch.delenv("WANDB_API_KEY", raising=False)
        patch.delenv("WANDB_MODE", raising=False)
        patch.setenv("HOME", str(home))
        for name, folder in (("WANDB_CONFIG_DIR", "config"), ("WANDB_CACHE_DIR", "cache"),
                             ("WANDB_DATA_DIR", "data")):
            patch.setenv(name, str(home / folder))
        patch.setenv("WANDB_ERROR_REPORTING", "false")
        patch.setenv("WANDB_SILENT", "true")
        yield patch


@pytest.fixture(scope="module")
def wandb_run(wandb_env, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("run")
    tracking = TrackingConfig(backends=["wandb"], project="tiny-math", run_name="first",
                              wandb_mode="offline")
    with open_trackers(tracking, run_dir=run_dir, config=CONFIG) as trackers:
        trackers.log_scalars(1, {"rl/reward": 0.25, "rl/loss": 1.5})
        trackers.log_scalars(2, {"rl/reward": 0.75, "eval/arith/mean@4": 0.5})
        trackers.log_table("eval/arith/samples", 2, ROWS)
        assert trackers.backends == ["wandb"]
    (directory,) = (run_dir / "wandb").glob("offline-run-*")
    return directory


def records_of(directory: Path, kind: str) -> list:
    (log,) = directory.glob("run-*.wandb")
    return [getattr(r, kind) for r in wandb_records(log) if r.WhichOneof("record_type") == kind]


def test_offline_run_holds_the_project_name_and_config(wandb_run) -> None:
    (run,) = records_of(wandb_run, "run")
    assert (run.project, run.display_name) == ("tiny-math", "first")
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    config.pop("_wandb")
    assert config == CONFIG


def test_scalars_of_each_step_are_history_rows(wandb_run) -> None:
    # Each log call is a history row of its own, against trainer_step (W&B's own step only counts
    # rows): an evaluation finishing after a later step is still logged at its step.
    rows: dict[int, dict] = {}
    for history in records_of(wandb_run, "history"):
        row = {"/".join(item.nested_key) or item.key: json.loads(item.value_json) for item in history.item}
        rows.setdefault(row["trainer_step"], {}).update(
            {key: value for key, value in row.items() if key.startswith(("rl/", "eval/"))})
    assert rows[1] == {"rl/reward": 0.25, "rl/loss": 1.5}
    assert {k: v for k, v in rows[2].items() if "samples" not in k} == {
        "rl/reward": 0.75, "eval/arith/mean@4": 0.5}
    assert any(key.startswith("eval/arith/samples") for key in rows[2])


def test_sample_table_is_a_wandb_table_file_of_the_run(wandb_run) -> None:
    (path,) = (wandb_run / "files" / "media" / "table" / "eval" / "arith").glob("samples_2_*.table.json")
    table = json.loads(path.read_text())
    assert [dict(zip(table["columns"], row)) for row in table["data"]] == ROWS


def test_wandb_sync_would_upload_the_offline_run(wandb_run, wandb_env) -> None:
    result = subprocess.run([sys.executable, "-m", "wandb", "sync", "--dry-run", str(wandb_run)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "Would sync 1 run(s)" in result.stdout + result.stderr


def test_nothing_wandb_started_outlives_close(wandb_run) -> None:
    assert wandb_core_processes() == []


def test_online_without_an_api_key_is_a_tracker_error(wandb_env, tmp_path) -> None:
    tracking = TrackingConfig(backends=["wandb"], wandb_mode="online")
    with pytest.raises(TrackerError) as raised:
        open_trackers(tracking, run_dir=tmp_path, config=CONFIG)
    assert raised.value.backend == "wandb"
    assert "API key" in raised.value.reason
    assert wandb_core_processes() == []


def test_mode_unset_follows_wandb_mode_from_the_environment(wandb_env, tmp_path) -> None:
    wandb_env.setenv("WANDB_MODE", "offline")
    try:
        open_trackers(TrackingConfig(backends=["wandb"]), run_dir=tmp_path, config=CONFIG).close()
    finally:
        wandb_env.delenv("WANDB_MODE")
    assert len(list((tmp_path / "wandb").glob("offline-run-*"))) == 1


def test_a_resumed_job_continues_the_same_wandb_run(wandb_env, tmp_path) -> None:
    tracking = TrackingConfig(backends=["wandb"], project="tiny-math", wandb_mode="offline")
    for step in (1, 2):  # the job, then rollmesh train --resume
        with open_trackers(tracking, run_dir=tmp_path, config=CONFIG) as trackers:
            trackers.log_scalars(step, {"rl/reward": 0.25 * step})
    first, second = sorted((tmp_path / "wandb").glob("offline-run-*"))
    ids = {run.run_id for directory in (first, second) for run in records_of(directory, "run")}
    # Offline, each session is its own folder of the one run (wandb sync --append joins them).
    assert len(ids) == 1 and first.name.endswith(ids.pop())
