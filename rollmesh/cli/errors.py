"""The CLI's one error type: a one-line message for people and an exit code for scripts.

Knows nothing else. ``main`` prints ``rollmesh: error: <message>`` (then ``detail``, such as a log
tail, when there is one) and exits with ``exit_code``; a traceback only with ``--debug``.
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130  # stopped by SIGINT or SIGTERM


class CliError(Exception):
    def __init__(self, message: str, *, detail: str = "", exit_code: int = EXIT_FAILURE) -> None:
        super().__init__(message)
        self.message = message
        self.detail = detail
        self.exit_code = exit_code
