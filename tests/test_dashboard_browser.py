"""The live dashboard in a real headless Chromium, against the session's real mesh.

The mesh (tests/conftest.py ``mesh``: every role as a Ray actor, on the session's nats-server)
gets its Serve app deployed here the way ``rollmesh up`` deploys it, dashboard included. Debian's
``chromium`` is driven by the ``playwright`` package with the system executable (never
``playwright install``; ``make test`` installs both, and their absence fails this test, saying
so). The app has an API key, which the page asks for once and sends as a Bearer header (its
data needs it, its static page does not). The page must show rollouts completing while they are
submitted, a typed failure, the
sandbox pool, the workers' weight versions and the accelerator timeline, and a rollout's trace
link must open its waterfall. Screenshots go to ``$ROLLMESH_TEST_ARTIFACTS`` (else the test's
tmp dir); the test prints where.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import shutil
import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import nats
import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

SUBMITTED = 3
API_KEY = "dashboard-test-key"
# Generous: two shared cores, and the page only refreshes once a second.
# A guard against a hang, never a timing assertion: on a loaded 2-core machine, with the session
# mesh still recovering from an earlier test's restarted actors, rollouts can take minutes.
# ROLLMESH_TEST_WAIT_S sets it, as for the suite's other mesh tests.
PAGE_TIMEOUT_MS = int(float(os.environ.get("ROLLMESH_TEST_WAIT_S", "240")) * 1000)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def chromium_path() -> str:
    path = shutil.which("chromium")
    if path is None:
        pytest.fail("Debian's chromium is not installed: `make test` installs it as root "
                    "(apt-get install chromium)")
    if importlib.util.find_spec("playwright") is None:
        pytest.fail("the playwright package is missing: pip install -e '.[test]'")
    return path


@pytest.fixture
def artifacts(tmp_path: Path) -> Path:
    directory = Path(os.environ.get("ROLLMESH_TEST_ARTIFACTS") or tmp_path / "artifacts")
    directory.mkdir(parents=True, exist_ok=True)
    return directory


@pytest.fixture(scope="module")
def dashboard_url(mesh) -> Iterator[str]:
    """The mesh's Serve app with its dashboard and an API key, deployed as the launcher does
    (serve is off in the session's mesh), and taken down again after this module."""
    from rollmesh.serve_apps import shutdown_inference_app

    runtime, inference = mesh.mesh.runtime, mesh.config.inference
    runtime.deploy_serve(
        prefill_names=[f"prefill-{i}" for i in range(inference.prefill_worker_count)],
        decode_names=[f"decode-{i}" for i in range(inference.num_decode_workers)],
        host="127.0.0.1", port=free_port(), api_key=API_KEY, follow=mesh.info)
    try:
        assert runtime.dashboard_url.endswith("/dashboard"), runtime.dashboard_url
        yield runtime.dashboard_url
    finally:
        shutdown_inference_app()
        runtime.serve_url = runtime.dashboard_url = ""


async def submit(nats_url: str, namespace: str, requests: list[dict]) -> None:
    nc = await nats.connect(nats_url)
    try:
        for request in requests:
            await nc.jetstream().publish(f"rl.{namespace}.rollout.requested", json.dumps(request).encode())
    finally:
        await nc.close()


async def number(page, selector: str) -> int:
    return int(await page.text_content(selector))


async def test_the_dashboards_data_needs_the_api_key_and_its_static_page_does_not(
        mesh, dashboard_url: str) -> None:
    async with httpx.AsyncClient(timeout=30) as client:
        assert (await client.get(dashboard_url)).status_code == 200
        refused = await client.get(dashboard_url + "/state")
        assert refused.status_code == 401 and API_KEY not in refused.text
        answered = await client.get(dashboard_url + "/state",
                                    headers={"Authorization": f"Bearer {API_KEY}"})
        assert answered.status_code == 200 and answered.json()["namespace"] == mesh.namespace
        bad = await client.get(dashboard_url + "/traces/not-a-trace/spans",
                               headers={"Authorization": f"Bearer {API_KEY}"})
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_trace_id"


async def test_the_dashboard_shows_the_mesh_live_and_links_rollouts_to_their_traces(
        mesh, dashboard_url: str, artifacts: Path) -> None:
    from playwright.async_api import async_playwright

    executable = chromium_path()
    async with async_playwright() as playwright:
        browser = await playwright.chromium.launch(executable_path=executable, headless=True,
                                                   args=["--no-sandbox", "--disable-gpu"])
        try:
            page = await browser.new_page(viewport={"width": 1400, "height": 1100})
            await page.goto(dashboard_url)
            # The mesh has an API key: the page asks for it once, then sends it with every poll.
            await page.wait_for_selector("#key-form", state="visible", timeout=PAGE_TIMEOUT_MS)
            await page.fill("#key-input", API_KEY)
            await page.click("#key-form button")
            await page.wait_for_function(
                "document.getElementById('feed').textContent === 'connected'", timeout=PAGE_TIMEOUT_MS)
            completed_before = await number(page, "#count-completed")
            points_before = await number(page, "#reward-points")

            tag = uuid.uuid4().hex[:6]
            await submit(mesh.info.nats_url, mesh.namespace, [
                {"rollout_id": f"dash-{tag}-{i}", "task": "molar_mass", "purpose": "eval",
                 "task_input": {"formula": "H2O"}, "sampling": {"max_new_tokens": 24}}
                for i in range(SUBMITTED)
            ] + [{"rollout_id": f"dash-{tag}-bad", "task": "no_such_task"}])

            # Live: the counts on the open page grow as the rollouts finish, without a reload.
            await page.wait_for_function(
                f"Number(document.getElementById('count-completed').textContent) >= "
                f"{completed_before + SUBMITTED} && Number(document.getElementById('reward-points')"
                f".textContent) >= {points_before + SUBMITTED}", timeout=PAGE_TIMEOUT_MS)
            await page.wait_for_function(
                f"document.getElementById('failures').textContent.includes('dash-{tag}-bad')",
                timeout=PAGE_TIMEOUT_MS)
            failures = await page.text_content("#failures")
            assert "unknown_task" in failures and "no_such_task" in failures
            # The polled numbers: the sandbox broker's pool, every worker's weight version, and
            # the GPU scheduler's accounting as the timeline's latest point.
            await page.wait_for_function(
                "document.querySelectorAll('#accelerator-chart polyline').length > 0 || "
                "document.getElementById('accelerator-now').textContent.startsWith('now:')",
                timeout=PAGE_TIMEOUT_MS)
            assert "leased" in await page.text_content("#sandbox-pool")
            weights = await page.text_content("#weights")
            assert "decode-0" in weights and "v" in weights
            await page.screenshot(path=str(artifacts / "dashboard.png"), full_page=True)

            completed_rows = await page.text_content("#completed")
            assert f"dash-{tag}-" in completed_rows
            link = await page.get_attribute("#completed a.trace-link", "href")
            assert link and link.startswith("/dashboard/traces/"), link
            # Followed in the same tab, which holds the key (sessionStorage is per tab).
            await page.click("#completed a.trace-link")
            spans = await wait_trace_spans(page, artifacts)
            assert "rollout" in spans, spans
        finally:
            await browser.close()
    print(f"dashboard screenshots: {artifacts / 'dashboard.png'}, {artifacts / 'trace.png'}")


async def wait_trace_spans(page, artifacts: Path, timeout_s: float = 90.0) -> str:
    """Reload the trace page until its waterfall shows spans (a span reaches traces.jsonl a few
    seconds after it ends); returns the page's span names."""
    deadline = time.monotonic() + timeout_s
    while True:
        await page.wait_for_function("document.body.dataset.spans !== undefined", timeout=PAGE_TIMEOUT_MS)
        if int(await page.evaluate("document.body.dataset.spans")) > 0:
            break
        assert time.monotonic() < deadline, f"no span of {page.url} in the run's traces"
        await asyncio.sleep(1.0)
        await page.reload()
    await page.screenshot(path=str(artifacts / "trace.png"), full_page=True)
    return await page.text_content("#spans")
