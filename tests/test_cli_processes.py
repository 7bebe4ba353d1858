"""`rollmesh up`'s readiness wait and `rollmesh down`, against stand-in mesh processes.

The stand-in writes mesh.json like the launcher does and obeys (or ignores) SIGTERM; starting the
real mesh is the end-to-end test's job.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_cli import restore_logging_config  # noqa: F401  (autouse: main() sets up logging)

from rollmesh.cli import main
from rollmesh.cli.errors import CliError
from rollmesh.cli.mesh import LOG_FILE, wait_mesh_ready
from rollmesh.mesh_address import MESH_FILE, MeshAddress, write_mesh_address

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

STAND_IN = r"""
import os, signal, sys, time
from pathlib import Path
from rollmesh.mesh_address import MeshAddress, write_mesh_address

run_dir, mode = Path(sys.argv[1]), sys.argv[2]

def stop(signum, frame):
    (run_dir / "mesh.json").unlink(missing_ok=True)  # as Mesh.stop does
    sys.exit(0)

signal.signal(signal.SIGTERM, signal.SIG_IGN if mode == "ignores" else stop)
if mode == "leaves-a-child":  # like a Ray worker that outlives its driver
    import subprocess
    straggler = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    (run_dir / "straggler.pid").write_text(str(straggler.pid))
write_mesh_address(MeshAddress(nats_url="nats://127.0.0.1:1", namespace="standin", run_dir=str(run_dir),
                         pid=os.getpid()))
while True:
    time.sleep(0.05)
"""


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    path = tmp_path / "runs" / "20300101-000000-abcdef"
    path.mkdir(parents=True)
    return path


def start_stand_in(run_dir: Path, mode: str) -> subprocess.Popen[bytes]:
    with (run_dir / LOG_FILE).open("ab") as log:
        child = subprocess.Popen([sys.executable, "-c", STAND_IN, str(run_dir), mode], stdout=log,
                                 stderr=subprocess.STDOUT, start_new_session=True)
    return child


@pytest.fixture
def stand_ins():
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for child in started:
        if child.poll() is None:
            child.kill()
        child.wait(timeout=10)


def test_wait_mesh_ready_returns_the_info_the_child_wrote(run_dir, stand_ins):
    stand_ins.append(child := start_stand_in(run_dir, "obeys"))
    info = wait_mesh_ready(child, run_dir, timeout_s=30)
    assert info.pid == child.pid and info.namespace == "standin"


def test_wait_mesh_ready_fails_with_the_log_tail_when_the_child_dies(run_dir):
    with (run_dir / LOG_FILE).open("ab") as log:
        child = subprocess.Popen([sys.executable, "-c", "print('boom: Ray would not start'); raise SystemExit(3)"],
                                 stdout=log, stderr=subprocess.STDOUT)
    with pytest.raises(CliError) as caught:
        wait_mesh_ready(child, run_dir, timeout_s=30)
    assert "exited with code 3" in caught.value.message
    assert "boom: Ray would not start" in caught.value.detail


def test_wait_mesh_ready_ignores_a_mesh_json_of_another_process_and_times_out(run_dir, stand_ins):
    write_mesh_address(MeshAddress(nats_url="nats://x:1", namespace="old", run_dir=str(run_dir), pid=1))
    stand_ins.append(child := subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]))
    with pytest.raises(CliError, match="not ready within"):
        wait_mesh_ready(child, run_dir, timeout_s=0.5)


def test_down_stops_the_mesh_with_sigterm(run_dir, stand_ins, capsys):
    stand_ins.append(child := start_stand_in(run_dir, "obeys"))
    wait_mesh_ready(child, run_dir, timeout_s=30)
    assert main(["--run-root", str(run_dir.parent), "down"]) == 0  # the latest run
    assert child.wait(timeout=10) == 0
    assert not (run_dir / MESH_FILE).exists()
    assert "mesh stopped" in capsys.readouterr().out


def test_down_kills_a_mesh_that_ignores_sigterm(run_dir, stand_ins, capsys):
    stand_ins.append(child := start_stand_in(run_dir, "ignores"))
    wait_mesh_ready(child, run_dir, timeout_s=30)
    assert main(["down", "--run-dir", str(run_dir), "--timeout", "0.5"]) == 1
    assert child.wait(timeout=10) == -9
    assert "did not stop within 0.5s" in capsys.readouterr().err


def test_down_clears_a_stale_mesh_json(run_dir, capsys):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    write_mesh_address(MeshAddress(nats_url="nats://x:1", namespace="old", run_dir=str(run_dir), pid=gone.pid))
    assert main(["down", "--run-dir", str(run_dir)]) == 0
    assert not (run_dir / MESH_FILE).exists()
    assert "stale" in capsys.readouterr().out


def test_down_without_a_mesh_fails(run_dir, capsys):
    assert main(["down", "--run-dir", str(run_dir)]) == 1
    assert "is the mesh up?" in capsys.readouterr().err


def test_up_refuses_a_run_dir_whose_mesh_is_running(run_dir, stand_ins, capsys):
    stand_ins.append(child := start_stand_in(run_dir, "obeys"))
    wait_mesh_ready(child, run_dir, timeout_s=30)
    assert main(["up", "--run-dir", str(run_dir)]) == 1
    assert f"a mesh (pid {child.pid}) already runs" in capsys.readouterr().err


def test_down_also_kills_what_the_mesh_left_behind_in_its_session(run_dir, stand_ins):
    stand_ins.append(child := start_stand_in(run_dir, "leaves-a-child"))
    wait_mesh_ready(child, run_dir, timeout_s=30)
    straggler = int((run_dir / "straggler.pid").read_text())
    assert main(["down", "--run-dir", str(run_dir)]) == 0
    assert child.wait(timeout=10) == 0
    deadline = time.monotonic() + 10
    while _alive(straggler) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(straggler)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_up_resume_needs_a_run_that_saved_its_config(run_dir, capsys):
    assert main(["up", "--resume", str(run_dir)]) == 2
    assert "no run to resume" in capsys.readouterr().err


def test_up_resume_takes_the_runs_own_config_not_another(run_dir, capsys):
    assert main(["up", "--resume", str(run_dir), "--namespace", "other"]) == 2
    assert "own config" in capsys.readouterr().err


def test_up_resume_runs_the_saved_config_in_the_child(run_dir):
    import argparse

    from rollmesh.cli.mesh import _resumed_config, child_command
    from rollmesh.config import load_config, save_run_config

    saved = load_config(overrides={"namespace": "resumed", "trainer.lr": 0.5})
    save_run_config(run_dir, saved)
    args = argparse.Namespace(resume=run_dir, config=None, run_dir=None, namespace=None, nats_url=None,
                              ray_address=None, no_serve=True, debug=False, run_root=None, metrics_port=None,
                              model=None)
    config = _resumed_config(args)
    assert (config.namespace, config.trainer.lr, config.serve.enabled) == ("resumed", 0.5, False)
    command = child_command(args, run_dir)
    assert command[command.index("--resume") + 1] == str(run_dir.resolve()) and "--run-dir" not in command
