"""An SGLang worker launches its server, generates through it, and takes it down when it stops.

The worker is the real ``SGLangWorkerActor`` as a Ray actor on the session's NATS and Ray; the
server is ``python -m sglang.launch_server`` from a stand-in ``sglang`` package (SGLang itself
needs a CUDA GPU) that serves ``FakeSGLang`` (tests/support/sglang_fake.py) on the ``--port`` it is given
and records its command line, so the launch plan's flags, the health wait, generation and the
process group's end are all the real code paths.
"""

from __future__ import annotations

import asyncio
import os
import sys
import textwrap
import uuid
from pathlib import Path

import pytest
import ray

from conftest import REPO_ROOT, TESTS_DIR
from rollmesh.mesh_address import MeshAddress
from rollmesh.actors.sglang_worker import SGLangWorkerActor
from rollmesh.config import InferenceConfig, ModelConfig, SGLangConfig
from rollmesh.messages.base import SamplingParams
from support.ray_actors import stop_and_kill

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

STAND_IN = textwrap.dedent('''
    """Stands in for sglang.launch_server: serves FakeSGLang on --port, records pid and argv."""
    import asyncio, os, sys
    from support.sglang_fake import FakeSGLang

    args = sys.argv[1:]
    with open(os.environ["FAKE_SGLANG_RECORD"], "w") as record:
        record.write(f"{os.getpid()}\\n" + " ".join(args))

    async def main():
        fake = FakeSGLang(label=args[args.index("--weight-version") + 1])
        await fake.start(port=int(args[args.index("--port") + 1]))
        await asyncio.Event().wait()

    asyncio.run(main())
''')


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


async def test_a_worker_launches_sglang_generates_through_it_and_stops_it(
        nats_server, ray_session, demo_model_dir, tmp_path):
    package = tmp_path / "pkgs" / "sglang"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "launch_server.py").write_text(STAND_IN)
    record = tmp_path / "record.txt"
    sglang = SGLangConfig(python=sys.executable, tp_size=2, ready_timeout_s=120, env={
        "PYTHONPATH": os.pathsep.join([str(tmp_path / "pkgs"), str(TESTS_DIR), str(REPO_ROOT)]),
        "FAKE_SGLANG_RECORD": str(record)})
    namespace = "sgw" + uuid.uuid4().hex[:8]
    mesh = MeshAddress(namespace=namespace, nats_url=nats_server.url, run_dir=str(tmp_path / "run"))
    name = f"decode-{namespace}"
    worker = ray.remote(SGLangWorkerActor).options(name=name, namespace=namespace, num_cpus=0).remote(
        name, mesh, ModelConfig(path=str(demo_model_dir)), InferenceConfig(backend="sglang", sglang=sglang), 0)
    try:
        await asyncio.wait_for(worker.start.remote(), 180)
        pid, argv = record.read_text().split("\n")
        assert argv.split()[:2] == ["--model-path", str(demo_model_dir)]
        assert "--tp-size 2" in argv and "--skip-tokenizer-init" not in argv
        finished = await worker.generate_prompt.remote([1, 2, 3], SamplingParams(max_new_tokens=3), "w-1")
        assert (finished.token_ids, finished.versions, finished.finish_reason) == ([100, 101, 102], [0] * 3, "length")
        assert await worker.current_version.remote() == 0
        # The streaming form the Serve app uses: the tokens as one piece, then the whole answer.
        pieces = [await ref async for ref in worker.generate_prompt_stream.options(num_returns="streaming").remote(
            [1, 2, 3], SamplingParams(max_new_tokens=2), "w-2")]
        assert [type(p).__name__ for p in pieces] == ["TokenDelta", "GenerationResult"]
        assert pieces[0].token_ids == pieces[1].token_ids == [100, 101]
        await asyncio.wait_for(worker.stop.remote(), 60)
        give_up = asyncio.get_running_loop().time() + 30
        while _alive(int(pid)) and asyncio.get_running_loop().time() < give_up:
            await asyncio.sleep(0.05)  # the SIGTERM is sent; the process may take a moment to end
        assert not _alive(int(pid))
    finally:
        stop_and_kill(worker)
