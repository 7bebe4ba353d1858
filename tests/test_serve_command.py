"""``rollmesh serve`` as a user runs it: a real process with its own nats-server and Ray, serving the
model directory of ``--model`` with ``ROLLMESH_API_KEY`` set, requests over HTTP (refused without
the key, answered with it), then SIGTERM and a clean exit 0, the key never in the output.

One process for all of it (starting one, its Ray and its workers, is the slow part).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from rollmesh.chat import ChatModel

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

READY_PREFIX = "rollmesh serve: ready at "
READY_TIMEOUT_S = 180.0
EXIT_TIMEOUT_S = 90.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def serve_process(tmp_path: Path, extra_env: dict[str, str] | None = None, extra_args: tuple[str, ...] = ()
                  ) -> Iterator[tuple[subprocess.Popen[str], str, list[str]]]:
    """A running ``rollmesh serve``, its base URL once ready, and its output lines so far."""
    port = free_port()
    env = {**os.environ, **(extra_env or {})}
    env.pop("RAY_ADDRESS", None)  # its own local Ray, never the test session's
    process = subprocess.Popen(
        [sys.executable, "-m", "rollmesh.cli", "--run-root", str(tmp_path / "runs"),
         "serve", "--port", str(port), *extra_args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )
    lines: list[str] = []
    ready = threading.Event()

    def read_output() -> None:  # a thread, so a silent child cannot block the readiness wait
        assert process.stdout is not None
        for line in process.stdout:
            lines.append(line)
            if line.startswith(READY_PREFIX):
                ready.set()

    reader = threading.Thread(target=read_output, daemon=True)
    reader.start()
    try:
        assert ready.wait(READY_TIMEOUT_S), "not ready:\n" + "".join(lines[-40:])
        (ready_line,) = [line for line in lines if line.startswith(READY_PREFIX)]
        url = ready_line[len(READY_PREFIX):].strip()
        assert url == f"http://127.0.0.1:{port}"
        yield process, url, lines
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(EXIT_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        reader.join(timeout=10)


def stop_and_wait(process: subprocess.Popen[str], lines: list[str]) -> int:
    process.send_signal(signal.SIGTERM)
    try:
        return process.wait(EXIT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail("no exit within the timeout after SIGTERM:\n" + "".join(lines[-40:]))


def test_serve_model_dir_answers_chat_and_completions_refuses_requests_without_its_key_and_exits_0_on_sigterm(
    tmp_path: Path, demo_model_dir: Path,
) -> None:
    model_dir = shutil.copytree(demo_model_dir, tmp_path / "my-model")
    key = "sk-test-" + os.urandom(8).hex()
    authorized = {"Authorization": f"Bearer {key}"}
    # --model wins over the configured model.path (here a directory that does not exist).
    env = {"ROLLMESH_MODEL__PATH": str(tmp_path / "not-a-model"), "ROLLMESH_API_KEY": key}
    with serve_process(tmp_path, env, ("--model", str(model_dir))) as (process, url, lines):
        assert [card["id"] for card in httpx.get(f"{url}/v1/models", timeout=30, headers=authorized).json()[
            "data"]] == ["my-model"]
        response = httpx.post(f"{url}/v1/completions", timeout=60, headers=authorized,
                              json={"prompt": "hello", "max_tokens": 4, "temperature": 0})
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["finish_reason"] in ("stop", "length")
        messages = [{"role": "user", "content": "molar mass of H2O?"}]
        chat = httpx.post(f"{url}/v1/chat/completions", timeout=60, headers=authorized, json={
            "messages": messages, "max_tokens": 4, "temperature": 0})
        assert chat.status_code == 200, chat.text
        model = ChatModel.load(model_dir)  # the prompt is the served model's template, its tokens
        prompt_ids = model.encode(model.render(messages, add_generation_prompt=True))
        assert chat.json()["usage"]["prompt_tokens"] == len(prompt_ids)
        check_the_api_key_is_wanted(url, key)
        assert stop_and_wait(process, lines) == 0
    assert key not in "".join(lines)


def check_the_api_key_is_wanted(url: str, key: str) -> None:
    body = {"prompt": "hi", "max_tokens": 2}
    refused = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert refused.status_code == 401
    assert refused.json()["error"]["code"] == "invalid_api_key"
    accepted = httpx.post(f"{url}/v1/completions", json=body, timeout=60, headers={"Authorization": f"Bearer {key}"})
    assert accepted.status_code == 200, accepted.text
    assert httpx.get(f"{url}/health", timeout=30).status_code == 200
