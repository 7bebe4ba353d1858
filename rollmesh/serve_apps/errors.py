"""Errors of the HTTP API, each with its status code and OpenAI error fields. Knows the engine's
error tree (to map it), not Ray or FastAPI.

    ApiError(status, message, code, param)
    ├── InvalidApiRequestError      400  bad body or sampling params, prompt too long, bad ids
    ├── AuthenticationError         401  no or a wrong ``Authorization: Bearer`` key
    ├── ModelNotFoundError(model)   404
    └── EngineUnavailableError      503  no decode slot, loop stopped, a worker died

    InvalidApiKeyFileError(ValueError)   at startup: the configured key file is unreadable or empty
"""

from __future__ import annotations

from rollmesh.engine.errors import (
    CapacityError,
    EngineError,
    EngineStoppedError,
    InvalidRequestError,
    PromptTooLongError,
)
from rollmesh.serve_apps.http_shapes import ErrorDetail, ErrorResponse


class ApiError(Exception):
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


class InvalidApiRequestError(ApiError):
    status = 400
    error_type = "invalid_request_error"


class AuthenticationError(ApiError):
    status = 401
    error_type = "invalid_request_error"

    def __init__(self, message: str) -> None:
        super().__init__(message, code="invalid_api_key")


class InvalidApiKeyFileError(ValueError):
    """The configured API key file cannot be read or is empty (raised at startup, not per request)."""


class ModelNotFoundError(ApiError):
    status = 404
    error_type = "invalid_request_error"

    def __init__(self, model: str, served: str) -> None:
        super().__init__(
            f"the model {model!r} does not exist; this server serves {served!r}",
            code="model_not_found", param="model",
        )
        self.model = model


class EngineUnavailableError(ApiError):
    status = 503
    error_type = "server_error"


def api_error_from_engine(exc: EngineError) -> ApiError:
    """The HTTP error for an engine error (raised in an actor, already unwrapped from Ray's)."""
    if isinstance(exc, PromptTooLongError):
        return InvalidApiRequestError(str(exc), code="prompt_too_long", param="prompt")
    if isinstance(exc, InvalidRequestError):
        return InvalidApiRequestError(str(exc), code="invalid_value", param=exc.field)
    if isinstance(exc, (CapacityError, EngineStoppedError)):
        return EngineUnavailableError(str(exc), code="engine_unavailable")
    return ApiError(str(exc), code="engine_error")
