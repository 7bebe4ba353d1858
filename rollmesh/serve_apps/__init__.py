"""rollmesh.serve_apps: Ray Serve applications (the request plane).

``build_inference_app`` puts an OpenAI-compatible ``/v1/completions`` and an SGLang-style
token-in/token-out ``/generate`` in front of named prefill and decode actors; the HTTP shapes
(``http_shapes``) are the public HTTP API, separate from the NATS wire contract.
"""

from rollmesh.serve_apps.errors import (
    ApiError,
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
    "APP_NAME",
    "ApiError",
    "EngineUnavailableError",
    "InvalidApiRequestError",
    "ModelNotFoundError",
    "ServedModel",
    "build_inference_app",
    "deploy_inference_app",
    "shutdown_inference_app",
]
