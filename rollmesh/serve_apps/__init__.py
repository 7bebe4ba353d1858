"""rollmesh.serve_apps: Ray Serve applications (the request plane).

``build_inference_app`` puts OpenAI-compatible ``/v1/completions`` and ``/v1/chat/completions``
(streaming included; optional bearer key, see ``api_keys``) and an SGLang-style
token-in/token-out ``/generate`` in front of named prefill and decode actors; the HTTP shapes
(``http_shapes``) are the public HTTP API, separate from the NATS wire contract.
"""

from rollmesh.serve_apps.api_keys import API_KEY_ENV, check_authorization, resolve_api_key
from rollmesh.serve_apps.chat_requests import render_chat
from rollmesh.serve_apps.errors import (
    ApiError,
    AuthenticationError,
    InvalidApiKeyFileError,
    EngineUnavailableError,
    InvalidApiRequestError,
    ModelNotFoundError,
)
from rollmesh.serve_apps.generation_requests import ServedModel
from rollmesh.serve_apps.inference_app import (
    APP_NAME,
    build_inference_app,
    deploy_inference_app,
    shutdown_inference_app,
)

__all__ = [
    "API_KEY_ENV",
    "APP_NAME",
    "ApiError",
    "AuthenticationError",
    "InvalidApiKeyFileError",
    "EngineUnavailableError",
    "InvalidApiRequestError",
    "ModelNotFoundError",
    "ServedModel",
    "build_inference_app",
    "check_authorization",
    "deploy_inference_app",
    "render_chat",
    "resolve_api_key",
    "shutdown_inference_app",
]
