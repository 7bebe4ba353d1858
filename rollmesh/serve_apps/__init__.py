"""rollmesh.serve_apps: Ray Serve applications (the request plane).

``build_inference_app`` puts OpenAI-compatible ``/v1/completions`` and ``/v1/chat/completions``
(streaming included; optional bearer key, see ``api_keys``) in the served model's own tokenizer,
chat template and tool-call format (``chat_requests``, ``chat_messages``), an SGLang-style
token-in/token-out ``/generate``, vLLM's ``/tokenize`` and ``/detokenize``
(``tokenize_requests``) and the weight and cache admin endpoints (``weight_admin``) in front of
named prefill and decode actors; OpenAI ``logprobs`` are built in ``openai_logprobs``. rollmesh's extension fields (session, minimum weight
version, routed experts) are checked in ``generate_extensions``. The ingress class
(``inference_app``) hands each route to the module of its group: ``text_routes`` (completions,
chat, ``/generate``), ``session_routes``, ``admin_routes``, ``tokenize_requests``; their calls to
the router, and Ray's errors mapped to HTTP ones, are ``router_calls``. Chat sessions of outside agent
harnesses (``chat_sessions``: a conversation's trajectory kept token-exact across turns) check
their history in ``session_history``, grow in ``session_trajectory`` and live in one store per app
(``session_store``, run as a Ray actor by ``session_actor``). The HTTP shapes
(``http_shapes``) are the public HTTP API, separate from the NATS wire contract.
"""

from rollmesh.serve_apps.api_keys import (
    API_KEY_ENV,
    check_authorization,
    is_loopback,
    required_api_key,
    resolve_api_key,
)
from rollmesh.serve_apps.chat_requests import ChatPrompt, chat_inputs
from rollmesh.serve_apps.errors import (
    RETRY_AFTER_S,
    ApiError,
    ApiKeyRequiredError,
    AuthenticationError,
    InvalidApiKeyFileError,
    EngineUnavailableError,
    InvalidApiRequestError,
    ModelNotFoundError,
)
from rollmesh.serve_apps.generate_extensions import encode_routed_experts, generate_options
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
    "ChatPrompt",
    "ApiKeyRequiredError",
    "AuthenticationError",
    "InvalidApiKeyFileError",
    "EngineUnavailableError",
    "InvalidApiRequestError",
    "ModelNotFoundError",
    "RETRY_AFTER_S",
    "ServedModel",
    "build_inference_app",
    "chat_inputs",
    "check_authorization",
    "deploy_inference_app",
    "encode_routed_experts",
    "generate_options",
    "is_loopback",
    "required_api_key",
    "resolve_api_key",
    "shutdown_inference_app",
]
