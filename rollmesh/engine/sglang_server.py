"""Launch and stop one SGLang server process (``python -m sglang.launch_server``), or the router
of a prefill/decode pair (``python -m sglang_router.launch_router --pd-disaggregation``).

Knows the launch command's fixed flags, POSIX process groups and the health probe of
``sglang_client``; the flags a config asks for come in as ``flags`` (``sglang_launch``); knows
nothing of generation or weights. The server runs from its own Python (``spec.python``,
typically a separate venv: SGLang pins a CUDA torch our venv must not get), in its own process
group so that stopping it also stops the scheduler and detokenizer processes it forks. Its output
goes to a log file rather than a pipe so nobody has to keep draining it. Readiness is
``/health_generate`` answering 200 (one token generated end to end), polled with backoff.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import msgspec

from rollmesh.engine.errors import EngineError
from rollmesh.engine.sglang_client import SGLangClient

_TAIL_LINES = 40


class SGLangServerStartError(EngineError):
    def __init__(self, url: str, reason: str, *, log_path: str, log_tail: str = "") -> None:
        tail = f"\n--- last lines of {log_path} ---\n{log_tail}" if log_tail else ""
        super().__init__(f"SGLang server {url} did not start: {reason}{tail}")
        self.url = url
        self.reason = reason
        self.log_path = log_path
        self.log_tail = log_tail


class SGLangServerSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How to launch one server. Config: unknown fields are refused."""

    model_path: str
    port: int
    python: str = "python3"  # an interpreter that has sglang installed
    host: str = "127.0.0.1"
    enable_return_routed_experts: bool = False
    # SGLang labels weights "default" unless told; a number keeps every label an int version.
    weight_version: int = 0
    # The flags of inference.sglang's typed keys (``sglang_launch.server_flags``), then extra_args.
    flags: list[str] = []
    extra_args: list[str] = []
    env: dict[str, str] = {}
    ready_timeout_s: float = 900.0
    # SGLang's own probe: one token generated end to end. Node ranks > 0 of a multi-node server
    # serve no HTTP; they are not launched through this class.
    health_path: str = "/health_generate"

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def argv(self) -> list[str]:
        argv = [
            self.python, "-m", "sglang.launch_server",
            "--model-path", self.model_path,
            "--host", self.host,
            "--port", str(self.port),
            "--weight-version", str(self.weight_version),
        ]
        if self.enable_return_routed_experts:
            argv.append("--enable-return-routed-experts")
        return argv + list(self.flags) + list(self.extra_args)


class SGLangRouterSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The router of a prefill/decode pair (sgl-model-gateway's ``launch_router``): it sends each
    request to a prefill server, which hands its KV to a decode server by the transfer backend."""

    port: int
    prefill: list[tuple[str, int]]  # (server URL, its --disaggregation-bootstrap-port)
    decode: list[str]
    python: str = "python3"  # an interpreter that has sglang-router installed
    host: str = "127.0.0.1"
    env: dict[str, str] = {}
    ready_timeout_s: float = 900.0
    health_path: str = "/health"

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def argv(self) -> list[str]:
        argv = [self.python, "-m", "sglang_router.launch_router", "--pd-disaggregation"]
        for url, bootstrap_port in self.prefill:
            argv += ["--prefill", url, str(bootstrap_port)]
        for url in self.decode:
            argv += ["--decode", url]
        return argv + ["--host", self.host, "--port", str(self.port)]


def pick_free_port(host: str = "127.0.0.1") -> int:
    """A port free now; SGLang needs one named up front. Another process may take it before use."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class SGLangServer:
    """One SGLang server child process: ``start`` waits until healthy, ``stop`` ends its group."""

    def __init__(self, spec: SGLangServerSpec | SGLangRouterSpec, log_path: Path) -> None:
        self.spec = spec
        self.log_path = Path(log_path)
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return self.spec.url

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    async def __aenter__(self) -> "SGLangServer":
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await asyncio.to_thread(self.stop)

    async def start(self) -> str:
        """Launch and wait until healthy; returns the base URL. Stops the process if it fails."""
        self.launch()
        try:
            await self.wait_healthy()
        except BaseException:
            await asyncio.to_thread(self.stop)
            raise
        return self.url

    def launch(self) -> None:
        if self._process is not None:
            raise SGLangServerStartError(self.url, "already launched", log_path=str(self.log_path))
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self._process = subprocess.Popen(
                self.spec.argv(), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                env={**os.environ, **self.spec.env},
                start_new_session=True,  # its own process group: stop() signals the whole tree
                preexec_fn=_end_with_parent,
            )

    async def wait_healthy(self) -> None:
        deadline = time.monotonic() + self.spec.ready_timeout_s
        delay = 0.05
        async with httpx.AsyncClient() as http:
            client = SGLangClient(self.url, http, admin_timeout_s=30.0)
            while True:
                exit_code = self._process.poll() if self._process is not None else None
                if exit_code is not None:
                    self._fail(f"exited with code {exit_code}")
                if await client.is_healthy(self.spec.health_path):
                    return
                if time.monotonic() > deadline:
                    self._fail(f"not healthy within {self.spec.ready_timeout_s}s")
                await asyncio.sleep(delay)  # polling backoff; the probe is the signal
                delay = min(delay * 2, 2.0)

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM to the group (SGLang shuts its children down), then SIGKILL what is left."""
        process, self._process = self._process, None
        if process is None:
            return
        _signal_group(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pass
        # A hung leader, or children it left behind, still hold the group; none may outlive us.
        _signal_group(process.pid, signal.SIGKILL)
        process.wait(timeout=timeout_s)

    def log_tail(self) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-_TAIL_LINES:])

    def _fail(self, reason: str) -> None:
        raise SGLangServerStartError(self.url, reason, log_path=str(self.log_path),
                                     log_tail=self.log_tail())


def _end_with_parent() -> None:
    """In the child before exec: SIGTERM it when the thread that launched it ends (Linux
    PR_SET_PDEATHSIG; an actor's event-loop thread lives as long as the actor), so an actor killed
    outright leaves no server holding its GPUs. SGLang's launch_server ends its children on SIGTERM."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


_PR_SET_PDEATHSIG = 1


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass  # the whole group has exited
