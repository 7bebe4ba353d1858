"""A local HTTP server for the ``http`` and ``judge`` reward tests: real sockets on 127.0.0.1,
answering POSTs with whatever the test's ``answer`` function returns, and recording each request.

This is the reward server (or OpenAI-compatible judge) a user would run: the true edge of those
rewards. Standard library ``http.server`` in a thread, so the rewards' own httpx clients talk to it
over TCP exactly as they would to a remote one.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass
class Request:
    path: str
    headers: dict[str, str]
    body: Any


# (request, its number from 0) -> (HTTP status, JSON body or raw bytes)
Answer = Callable[[Request, int], tuple[int, Any]]


@dataclass
class RecordingServer:
    url: str
    requests: list[Request] = field(default_factory=list)
    # Set when the test ends: handlers that wait on it (a server that never answers) return.
    closing: threading.Event = field(default_factory=threading.Event)


@contextmanager
def reward_server(answer: Answer) -> Iterator[RecordingServer]:
    lock = threading.Lock()
    server_state = RecordingServer(url="")

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            length = int(self.headers.get("Content-Length", 0))
            request = Request(self.path, {k.lower(): v for k, v in self.headers.items()},
                              json.loads(self.rfile.read(length) or b"null"))
            with lock:
                number = len(server_state.requests)
                server_state.requests.append(request)
            status, body = answer(request, number)
            data = body if isinstance(body, bytes) else json.dumps(body).encode()
            try:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            except OSError:  # the client gave up (its timeout) before the answer
                pass

        def log_message(self, format: str, *args: object) -> None:  # quiet
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    server_state.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, name="reward-test-server", daemon=True)
    thread.start()
    try:
        yield server_state
    finally:
        server_state.closing.set()
        server.shutdown()
        server.server_close()
        thread.join(timeout=30)
