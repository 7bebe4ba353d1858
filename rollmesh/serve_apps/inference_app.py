"""The inference Serve application: OpenAI ``/v1/completions`` and ``/v1/chat/completions``
(streaming included), SGLang-style ``/generate``, vLLM's ``/tokenize`` and ``/detokenize``
(``tokenize_requests``), ``/v1/models`` and ``/health`` in front of the
prefill and decode actors, and the admin endpoints ``GET /v1/admin/weights``, SGLang's
``POST /update_weights_from_disk`` and ``POST /flush_cache``, and the chat sessions of outside
agent harnesses (``chat_sessions``: ``GET /v1/sessions/{id}/trajectory``, ``DELETE
/v1/sessions/{id}``; their store is one Ray actor, ``session_actor``). With an API key (given at
construction, never read here from the environment) every endpoint but ``/health`` requires
``Authorization: Bearer KEY``; so does the live dashboard's data (``rollmesh.dashboard``: its two
static pages at ``/dashboard`` and ``/dashboard/traces/<id>`` hold none and ask for the key).

Each replica loads the model directory's tokenizer, chat template and parsers once
(``rollmesh.chat.ChatModel``); the text routes speak them (``chat_requests``,
``generation_requests``).

Here: the ingress class (routes are its methods, bound to the replica by Serve's ingress wrapper:
each checks the key and hands over), the replica's construction, the app's build, deploy and
shutdown. What routes do: ``text_routes`` (completions, chat, ``/generate``, event streams),
``session_routes`` (chat-session turns), ``admin_routes``, ``tokenize_requests``; their router
calls and the mapping of what those raise: ``router_calls``.

Knows Ray Serve, FastAPI and the InferenceRouter; finds the workers by actor name (the launcher
spawned them; the GPU scheduler, for the decode workers it lends idle accelerators to:
``decode_loan_follower``), never spawns or stops them. Bad input is answered with a 4xx JSON
error and never reaches the engine, so a client cannot take the replica down; Ray's wrapping of
actor errors is undone in ``router_calls`` and nowhere else.

Tracing: the replica reports as ``rollmesh.serve``. Each request's SERVER span
(``POST /v1/completions``, ``http.*`` attributes, the child of the caller's ``traceparent``) is
FastAPI's own telemetry, not ours; we add the ``gen_ai.*`` attributes of its generate call
(``router_calls``), and the router carries the context on to the workers in ``trace_headers``.
"""

# No ``from __future__ import annotations`` here: FastAPI reads the route methods' annotations at
# runtime, and through Serve's ingress wrapper string annotations are not resolved (the body would
# be taken for a query parameter).
import time
from pathlib import Path
from typing import Any

import ray
from fastapi import FastAPI, Header, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve
from ray.serve import Application
from ray.serve.exceptions import RayServeException

from rollmesh.inference.decode_loans import DecodeLoanRoster
from rollmesh.inference.router import InferenceRouter
from rollmesh.chat import ChatModel
from rollmesh.config import DashboardConfig, ModelConfig, ServeConfig, TelemetryConfig
from rollmesh.dashboard.feed import WorkerHandle
from rollmesh.dashboard.routes import DashboardRoutes, is_dashboard_request
from rollmesh.engine.served_model import describe_served_model
from rollmesh.mesh_address import MeshAddress
from rollmesh.serve_apps.admin_routes import (
    answer_flush_cache,
    answer_update_weights,
    answer_weight_versions,
)
from rollmesh.serve_apps.api_keys import check_authorization
from rollmesh.serve_apps.chat_sessions import ChatSessions
from rollmesh.serve_apps.decode_loan_follower import DecodeLoanFollower
from rollmesh.serve_apps.errors import ApiError, InvalidApiRequestError
from rollmesh.serve_apps.generation_requests import ServedModel
from rollmesh.serve_apps.http_shapes import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    FlushCacheResponse,
    GenerateRequest,
    GenerateResponse,
    ModelCard,
    ModelList,
    SessionDeletedResponse,
    SessionTrajectoryResponse,
    TokenizeRequest,
    TokenizeResponse,
    UpdateWeightsFromDiskRequest,
    UpdateWeightsFromDiskResponse,
    WeightVersionsResponse,
)
from rollmesh.serve_apps.replica_loopback import keep_replica_grpc_on_loopback
from rollmesh.serve_apps.router_calls import RouterCalls
from rollmesh.serve_apps.session_actor import session_store_actor, stop_session_store
from rollmesh.serve_apps.session_routes import answer_session_turn, path_session_request
from rollmesh.serve_apps.text_routes import answer_chat, answer_completion, answer_generate
from rollmesh.serve_apps.tokenize_requests import detokenize, tokenize
from rollmesh.serve_apps.weight_admin import Worker
from rollmesh.telemetry.logging import setup_logging
from rollmesh.telemetry.tracing import setup_tracing, without_run_dir

APP_NAME = "rollmesh-inference"
# The Ray namespaces of the apps this process built: where their chat-session stores run.
_SESSION_NAMESPACES: set[str] = set()
# Requests a replica holds at once; each mostly waits on decode, which batches up to max_batch.
MAX_ONGOING_REQUESTS = 512

# FastAPI's native telemetry makes the request's SERVER span from the global provider (set up in
# the replica). Its per-operation child spans (dependencies, endpoint, serialization) are off: they
# add three spans to every request, and the handler's current span must be the SERVER span so the
# gen_ai.* attributes land there.
# The dashboard's requests (its page polls every second) are left out of the traces.
HTTP_TELEMETRY = {"tracing": True, "operation_spans": False, "metrics": False, "logs": False,
                  "exclude": is_dashboard_request}
_http = FastAPI(title="rollmesh inference", docs_url=None, redoc_url=None, telemetry=HTTP_TELEMETRY)


@_http.exception_handler(ApiError)
async def _api_error(_request: Request, exc: ApiError) -> JSONResponse:
    return JSONResponse(status_code=exc.status, content=exc.to_response().model_dump(),
                        headers=exc.headers())


@_http.exception_handler(RequestValidationError)
async def _invalid_body(_request: Request, exc: RequestValidationError) -> JSONResponse:
    # FastAPI answers 422 by default; OpenAI-style clients expect 400 for any bad body.
    return await _api_error(_request, invalid_body_error(exc.errors()))


def invalid_body_error(errors: Any) -> InvalidApiRequestError:
    """One 400 error from pydantic's error list (malformed JSON is one of them)."""
    errors = list(errors)
    if any(error.get("type") == "json_invalid" for error in errors):
        detail = errors[0].get("ctx", {}).get("error", errors[0].get("msg", ""))
        return InvalidApiRequestError(f"malformed JSON body: {detail}", code="invalid_json")
    params = [".".join(str(part) for part in error.get("loc", ())[1:]) for error in errors]
    message = "; ".join(
        f"{param or 'body'}: {error.get('msg', 'invalid')}" for param, error in zip(params, errors)
    )
    return InvalidApiRequestError(message, code="invalid_value", param=params[0] or None)


# The module globals the deployment class uses are defined above it on purpose: Serve's ingress
# wrapper pickles the class's methods when the decorator runs, so a global defined below it is
# missing in the replica (seen as a NameError there).
def find_named_actor(name: str, namespace: str) -> Any:
    """How the dashboard finds the sandbox broker (by the name the launcher gave it), and the
    router a lent decode worker (by its grant id); ValueError when there is none."""
    return ray.get_actor(name, namespace=namespace)


@serve.deployment(
    num_replicas=1,
    ray_actor_options={"num_cpus": 0},
    max_ongoing_requests=MAX_ONGOING_REQUESTS,
)
@serve.ingress(_http)
class InferenceServer:
    """One replica: validates, routes a generate call through prefill then decode, answers."""

    def __init__(
        self,
        *,
        prefill_actor_names: list[str],
        decode_actor_names: list[str],
        ray_namespace: str,
        model: ModelConfig,
        model_name: str,
        routes_experts: bool | None = None,
        api_key: str = "",
        telemetry: TelemetryConfig | None = None,
        run_dir: str = "",
        follow: MeshAddress | None = None,
        dashboard: DashboardConfig | None = None,
        sessions: ServeConfig | None = None,
    ) -> None:
        keep_replica_grpc_on_loopback()  # Serve binds that server once this constructor returns
        setup_logging("serve:inference")
        telemetry = telemetry or TelemetryConfig()
        setup_tracing("serve", telemetry if run_dir else without_run_dir(telemetry),
                      Path(run_dir or "."), instance="serve:inference")
        facts = describe_served_model(model)
        self.served = ServedModel(name=model_name, max_seq_len=facts.max_seq_len,
                                  vocab_size=facts.vocab_size, chat=ChatModel.from_config(model),
                                  routes_experts=routes_experts)
        self._api_key = api_key  # never logged
        sessions = sessions or ServeConfig()
        self.sessions = ChatSessions(self.served, session_store_actor(
            namespace=ray_namespace, ttl_s=sessions.session_ttl_s, max_sessions=sessions.max_sessions))
        self.created = int(time.time())
        self.workers = [
            Worker(name, role, ray.get_actor(name, namespace=ray_namespace))
            for role, names in (("prefill", prefill_actor_names), ("decode", decode_actor_names))
            for name in names
        ]
        self.router = InferenceRouter(
            [w.actor for w in self.workers if w.role == "prefill"],
            [w.actor for w in self.workers if w.role == "decode"],
            model_name=self.served.name,
        )
        self.calls = RouterCalls(self.router, self.served)
        # The constructor runs on the replica's event loop, where the dashboard's feed and the
        # follower of decode loans then live.
        self.dashboard = DashboardRoutes.start(
            follow, dashboard or DashboardConfig(), [WorkerHandle(w.name, w.role, w.actor) for w in self.workers],
            find_actor=find_named_actor)
        self.decode_loans = None
        if follow is not None:
            roster = DecodeLoanRoster(self.router, lambda name: find_named_actor(name, ray_namespace))
            self.decode_loans = DecodeLoanFollower(follow, roster)
            self.decode_loans.start()

    # A body that fails validation is answered 400 before the key is checked (FastAPI validates
    # before the handler runs); nothing reaches the engine either way.
    @_http.post("/v1/completions", response_model=None)
    async def completions(
        self, body: CompletionRequest, authorization: str | None = Header(default=None)
    ) -> CompletionResponse | StreamingResponse:
        check_authorization(authorization, self._api_key)
        return await answer_completion(body, self.served, self.calls)

    @_http.post("/v1/chat/completions", response_model=None)
    async def chat_completions(
        self, body: ChatCompletionRequest, authorization: str | None = Header(default=None)
    ) -> ChatCompletionResponse | StreamingResponse:
        check_authorization(authorization, self._api_key)
        if body.session_id is not None:  # a chat session: its trajectory is the prompt
            return await answer_session_turn(body, self.served, self.calls, self.sessions)
        return await answer_chat(body, self.served, self.calls)

    @_http.post(
        "/generate", response_model=GenerateResponse, response_model_exclude_none=True
    )
    async def generate(
        self, body: GenerateRequest, authorization: str | None = Header(default=None)
    ) -> GenerateResponse:
        check_authorization(authorization, self._api_key)
        return await answer_generate(body, self.served, self.calls)

    @_http.post("/tokenize", response_model=TokenizeResponse)
    async def tokenize_text(
        self, body: TokenizeRequest, authorization: str | None = Header(default=None)
    ) -> TokenizeResponse:
        check_authorization(authorization, self._api_key)
        return tokenize(body, self.served)

    @_http.post("/detokenize", response_model=DetokenizeResponse)
    async def detokenize_ids(
        self, body: DetokenizeRequest, authorization: str | None = Header(default=None)
    ) -> DetokenizeResponse:
        check_authorization(authorization, self._api_key)
        return detokenize(body, self.served)

    # For a harness that can set its base URL but no extra body: base_url=".../v1/sessions/ID".
    @_http.post("/v1/sessions/{session_id}/chat/completions", response_model=None)
    async def session_chat_completions(
        self, session_id: str, body: ChatCompletionRequest,
        authorization: str | None = Header(default=None),
    ) -> ChatCompletionResponse | StreamingResponse:
        check_authorization(authorization, self._api_key)
        return await answer_session_turn(path_session_request(session_id, body), self.served,
                                         self.calls, self.sessions)

    @_http.get("/v1/sessions/{session_id}/trajectory", response_model=SessionTrajectoryResponse)
    async def session_trajectory(
        self, session_id: str, authorization: str | None = Header(default=None)
    ) -> SessionTrajectoryResponse:
        check_authorization(authorization, self._api_key)
        return await self.sessions.trajectory(session_id)

    @_http.delete("/v1/sessions/{session_id}", response_model=SessionDeletedResponse)
    async def delete_session(
        self, session_id: str, authorization: str | None = Header(default=None)
    ) -> SessionDeletedResponse:
        check_authorization(authorization, self._api_key)
        return await self.sessions.delete(session_id)

    @_http.get("/v1/models", response_model=ModelList)
    async def models(self, authorization: str | None = Header(default=None)) -> ModelList:
        check_authorization(authorization, self._api_key)
        return ModelList(data=[ModelCard(id=self.served.name, created=self.created)])

    @_http.get("/health")
    async def health(self) -> dict[str, str]:
        return {"status": "ok"}

    # -- the live dashboard (rollmesh.dashboard): its two pages hold no data; the data needs the key

    @_http.get("/dashboard", response_model=None)
    async def dashboard_page(self) -> Response:
        return self.dashboard.page()

    @_http.get("/dashboard/state", response_model=None)
    async def dashboard_state(self, authorization: str | None = Header(default=None)) -> Response:
        check_authorization(authorization, self._api_key)
        return self.dashboard.state_answer()

    @_http.get("/dashboard/traces/{trace_id}", response_model=None)
    async def dashboard_trace_page(self, trace_id: str) -> Response:
        return self.dashboard.trace_page(trace_id)

    @_http.get("/dashboard/traces/{trace_id}/spans", response_model=None)
    async def dashboard_trace_spans(
        self, trace_id: str, authorization: str | None = Header(default=None)
    ) -> Response:
        check_authorization(authorization, self._api_key)
        return await self.dashboard.trace_answer(trace_id)

    # -- admin ----------------------------------------------------------------------------

    @_http.get("/v1/admin/weights", response_model=WeightVersionsResponse)
    async def admin_weights(
        self, authorization: str | None = Header(default=None)
    ) -> WeightVersionsResponse:
        check_authorization(authorization, self._api_key)
        return await answer_weight_versions(self.workers)

    @_http.post("/update_weights_from_disk", response_model=UpdateWeightsFromDiskResponse)
    async def admin_update_weights_from_disk(
        self, body: UpdateWeightsFromDiskRequest,
        authorization: str | None = Header(default=None),
    ) -> UpdateWeightsFromDiskResponse:
        check_authorization(authorization, self._api_key)
        return await answer_update_weights(self.workers, body)

    @_http.post("/flush_cache", response_model=FlushCacheResponse)
    async def admin_flush_cache(
        self, authorization: str | None = Header(default=None)
    ) -> FlushCacheResponse:
        check_authorization(authorization, self._api_key)
        return await answer_flush_cache(self.workers)


def build_inference_app(
    *,
    prefill_actor_names: list[str],
    decode_actor_names: list[str],
    ray_namespace: str,
    model: ModelConfig,
    model_name: str = "",
    api_key: str = "",
    telemetry: TelemetryConfig | None = None,
    run_dir: str = "",
    follow: MeshAddress | None = None,
    dashboard: DashboardConfig | None = None,
    sessions: ServeConfig | None = None,
) -> Application:
    """The bound application; deploy it with ``deploy_inference_app``. ``model``: the model the
    workers serve (an absolute ``model.path``; ``rollmesh.model_source.resolve_model``): each
    replica loads its tokenizer, chat template and parsers, with ``model``'s ``tool_parser``,
    ``reasoning_parser`` and ``chat_template_kwargs``. ``model_name``: the name clients ask for
    ("": the directory's name). Whether the model routes experts is read from its config.json, so
    a dense model's server refuses ``return_routed_experts`` before any worker runs. A non-empty
    ``api_key`` is required as ``Authorization: Bearer`` on every endpoint but ``/health``.
    ``telemetry`` and ``run_dir`` set up the replica's tracing (``traces.jsonl`` in ``run_dir``
    by default); without ``run_dir`` only the OTEL_* variables turn an exporter on.
    ``follow``: the mesh the replica follows, as the watch-only "dashboard" role: ``/dashboard``
    shows it (with ``dashboard.enabled``, the ``DashboardConfig``; otherwise, or with None, those
    routes answer 404), and the router also sends requests to the decode workers its GPU
    scheduler lends idle accelerators to.
    ``sessions``: its ``session_ttl_s`` and ``max_sessions`` bound the chat sessions (None: the
    defaults); ``shutdown_inference_app`` stops their store."""
    # Read here as well as in each replica: a directory that is no model fails the deploy at once
    # (ModelDirectoryError, ModelConfigError) instead of each replica's start, again and again.
    facts = describe_served_model(model)
    ChatModel.from_config(model)
    _SESSION_NAMESPACES.add(ray_namespace)
    return InferenceServer.bind(
        prefill_actor_names=list(prefill_actor_names),
        decode_actor_names=list(decode_actor_names),
        ray_namespace=ray_namespace,
        model=model,
        model_name=model_name or facts.name,
        routes_experts=facts.routes_experts,
        api_key=api_key,
        telemetry=telemetry,
        run_dir=str(run_dir),
        follow=follow,
        dashboard=dashboard,
        sessions=sessions,
    )


def deploy_inference_app(
    app: Application, *, host: str, port: int, route_prefix: str = "/",
    tls_cert_file: str = "", tls_key_file: str = "",
) -> str:
    """Start Serve's HTTP proxy on host:port (HTTPS with a certificate and key), deploy ``app``,
    return its base URL."""
    http_options: dict[str, object] = {"host": host, "port": port}
    if tls_cert_file:
        http_options.update(ssl_certfile=tls_cert_file, ssl_keyfile=tls_key_file)
    serve.start(http_options=http_options)
    serve.run(app, name=APP_NAME, route_prefix=route_prefix, blocking=False)
    # A wildcard bind address is not one a client can connect to.
    reachable = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    scheme = "https" if tls_cert_file else "http"
    return f"{scheme}://{reachable}:{port}{route_prefix.rstrip('/')}"


def shutdown_inference_app() -> None:
    """Delete the application; stop Serve too when no other application is left on it. Does
    nothing when Serve is not running (a deploy that failed half-way can still be cleaned up)."""
    while _SESSION_NAMESPACES:  # the chat-session stores of the apps this process built
        stop_session_store(_SESSION_NAMESPACES.pop())
    try:
        serve.delete(APP_NAME)
    except RayServeException:
        return
    if not serve.status().applications:
        serve.shutdown()
