"""The SGLang client's memory calls (the GPU scheduler lending a server's accelerator): the
endpoints and bodies of sglang's http_server.py / io_struct.py, and a refusal as a typed error.
httpx's MockTransport stands in for the server: only the wire format is under test here."""

from __future__ import annotations

import json

import httpx
import pytest

from rollmesh.engine.sglang_client import SGLangClient, SGLangHTTPError

pytestmark = pytest.mark.unit


def client(answer) -> tuple[SGLangClient, list[tuple[str, dict]]]:
    seen: list[tuple[str, dict]] = []

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append((request.url.path, json.loads(request.content or b"null")))
        return answer(request)

    http = httpx.AsyncClient(transport=httpx.MockTransport(handle))
    return SGLangClient("http://sglang:30000", http), seen


async def test_release_and_resume_post_sglangs_memory_occupation_bodies() -> None:
    sglang, seen = client(lambda request: httpx.Response(200, content=b""))
    await sglang.release_memory_occupation()
    await sglang.resume_memory_occupation(["weights"])
    await sglang.resume_memory_occupation(["kv_cache"])
    assert seen == [("/release_memory_occupation", {}), ("/resume_memory_occupation", {"tags": ["weights"]}),
                    ("/resume_memory_occupation", {"tags": ["kv_cache"]})]


async def test_a_refused_release_is_an_http_error_naming_the_endpoint() -> None:
    sglang, _ = client(lambda request: httpx.Response(400, json={"error": {"message": "memory saver is off"}}))
    with pytest.raises(SGLangHTTPError) as refused:
        await sglang.release_memory_occupation(["weights", "kv_cache"])
    assert refused.value.endpoint == "/release_memory_occupation" and refused.value.status == 400
    assert "memory saver is off" in str(refused.value)
