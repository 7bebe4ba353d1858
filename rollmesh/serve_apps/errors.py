"""Errors of the serving package, one tree under ``ServeError``: the HTTP API's, each with its
status code and OpenAI error fields, and the startup and session errors behind them. Knows the
engine's error tree (to map it), not Ray or FastAPI.

    ServeError
    ├── ApiError(status, message, code, param)
    │   ├── InvalidApiRequestError      400  bad body or sampling params, prompt too long, bad ids,
    │   │                                    KV pool too small, a dense model asked for experts,
    │   │                                    a weights file that cannot be loaded, invalid tools,
    │   │                                    messages the model's chat template refuses
    │   ├── AuthenticationError         401  no or a wrong ``Authorization: Bearer`` key
    │   ├── ModelNotFoundError(model)   404
    │   ├── SessionNotFoundError        404  no chat session by that id (never made, expired, deleted)
    │   ├── SessionConflictError        409  a chat session already has a turn in flight
    │   └── EngineUnavailableError      503  no decode slot, loop stopped, a worker died; with
    │                                        ``retry_after_s`` (a ``Retry-After`` header) when
    │                                        retrying will help: ``version_unavailable``
    ├── InvalidApiKeyFileError, ValueError  at startup: the configured key file is unreadable or empty
    │   └── ApiKeyRequiredError          at startup: bound beyond loopback or security enabled,
    │                                    and no key configured
    └── SessionHistoryError(reason, index), ValueError   (session_history) a session's messages
                                                         do not extend its history; answered 400
"""

from __future__ import annotations

from collections.abc import Mapping

from rollmesh.engine.errors import (
    CapacityError,
    EngineError,
    EngineStoppedError,
    InvalidRequestError,
    KvCapacityError,
    PromptTooLongError,
    StaleWeightsError,
    VersionUnavailableError,
    WeightsError,
)
from rollmesh.serve_apps.http_shapes import ErrorDetail, ErrorResponse

# Seconds a client should wait before retrying a retryable 503 (a weight update takes about this).
RETRY_AFTER_S = 1


class ServeError(Exception):
    """Root of the serving package's errors."""


class ApiError(ServeError):
    """An error the HTTP API reports as ``{"error": {...}}`` with ``status``."""

    status = 500
    error_type = "server_error"

    def __init__(self, message: str, *, code: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.param = param

    def to_response(self) -> ErrorResponse:
        return ErrorResponse(
            error=ErrorDetail(
                message=self.message, type=self.error_type, code=self.code, param=self.param
            )
        )

    def headers(self) -> dict[str, str]:
        return {}


class InvalidApiRequestError(ApiError):
    status = 400
    error_type = "invalid_request_error"


class AuthenticationError(ApiError):
    status = 401
    error_type = "invalid_request_error"

    def __init__(self, message: str) -> None:
        super().__init__(message, code="invalid_api_key")


class InvalidApiKeyFileError(ServeError, ValueError):
    """The configured API key file cannot be read or is empty (raised at startup, not per request)."""


class ApiKeyRequiredError(InvalidApiKeyFileError):
    """The HTTP API would be reachable beyond this machine (or security is on) without a key."""


class ModelNotFoundError(ApiError):
    status = 404
    error_type = "invalid_request_error"

    def __init__(self, model: str, served: str) -> None:
        super().__init__(
            f"the model {model!r} does not exist; this server serves {served!r}",
            code="model_not_found", param="model",
        )
        self.model = model


class SessionNotFoundError(ApiError):
    status = 404
    error_type = "invalid_request_error"

    def __init__(self, session_id: str, why: str) -> None:
        super().__init__(f"no chat session {session_id!r}: {why}", code="session_not_found",
                         param="session_id")
        self.session_id = session_id


class SessionConflictError(ApiError):
    status = 409
    error_type = "invalid_request_error"

    def __init__(self, session_id: str, why: str) -> None:
        super().__init__(f"chat session {session_id!r}: {why}", code="session_busy",
                         param="session_id")
        self.session_id = session_id


class EngineUnavailableError(ApiError):
    status = 503
    error_type = "server_error"

    def __init__(self, message: str, *, code: str | None = None, param: str | None = None,
                 retry_after_s: int | None = None) -> None:
        super().__init__(message, code=code, param=param)
        self.retry_after_s = retry_after_s

    def headers(self) -> dict[str, str]:
        return {} if self.retry_after_s is None else {"Retry-After": str(self.retry_after_s)}


def api_error_from_engine(
    exc: EngineError, param_names: Mapping[str, str] | None = None
) -> ApiError:
    """The HTTP error for an engine error (raised in an actor, already unwrapped from Ray's).
    ``param_names`` maps the engine's field names to the route's ("input_ids" -> "prompt")."""
    names = dict(param_names or {})
    if isinstance(exc, VersionUnavailableError):
        return EngineUnavailableError(
            f"min_weight_version {exc.min_version} is not active yet (a worker has version "
            f"{exc.current_version}); retryable: send the request again after the weight update",
            code="version_unavailable", param="min_weight_version", retry_after_s=RETRY_AFTER_S,
        )
    if isinstance(exc, PromptTooLongError):
        return InvalidApiRequestError(
            str(exc), code="prompt_too_long", param=names.get(exc.field, "prompt"))
    if isinstance(exc, KvCapacityError):
        return InvalidApiRequestError(
            str(exc), code="kv_capacity_exceeded", param=names.get(exc.field, exc.field))
    if isinstance(exc, InvalidRequestError):
        code = "unsupported_value" if exc.field == "return_routed_experts" else "invalid_value"
        return InvalidApiRequestError(str(exc), code=code, param=names.get(exc.field, exc.field))
    if isinstance(exc, StaleWeightsError):
        return InvalidApiRequestError(str(exc), code="stale_weight_version",
                                      param="weight_version")
    if isinstance(exc, WeightsError):
        return InvalidApiRequestError(str(exc), code="invalid_weights", param="model_path")
    if isinstance(exc, (CapacityError, EngineStoppedError)):
        return EngineUnavailableError(str(exc), code="engine_unavailable")
    if getattr(exc, "retryable", False):
        return EngineUnavailableError(str(exc), code="engine_unavailable",
                                      retry_after_s=RETRY_AFTER_S)
    return ApiError(str(exc), code="engine_error")
