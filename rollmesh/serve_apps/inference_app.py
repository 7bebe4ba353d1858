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

Knows Ray Serve, FastAPI and the InferenceRouter; finds the workers by actor name (the launcher
spawned them; the GPU scheduler, for the decode workers it lends idle accelerators to:
``decode_loan_follower``), never spawns or stops them. Bad input is answered with a 4xx JSON error and never
reaches the engine, so a client cannot take the replica down; Ray's wrapping of actor errors is
undone here and nowhere else.

Tracing: the replica reports as ``rollmesh.serve``. Each request's SERVER span
(``POST /v1/completions``, ``http.*`` attributes, the child of the caller's ``traceparent``) is
FastAPI's own telemetry, not ours; we add the ``gen_ai.*`` attributes of its generate call, and the
router carries the context on to the workers in ``trace_headers``.
"""

# No ``from __future__ import annotations`` here: FastAPI reads the route methods' annotations at
# runtime, and through Serve's ingress wrapper string annotations are not resolved (the body would
# be taken for a query parameter).
import dataclasses
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import ray
import structlog
from fastapi import FastAPI, Header, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from opentelemetry import trace
from ray import serve
from ray.exceptions import RayActorError, RayTaskError
from ray.serve import Application
from ray.serve.exceptions import RayServeException

from rollmesh.actors.decode_loans import DecodeLoanRoster
from rollmesh.actors.inference_router import InferenceRouter, generation_attributes
from rollmesh.chat import ChatModel
from rollmesh.config import ModelConfig, ServeConfig, TelemetryConfig
from rollmesh.dashboard.feed import DashboardSource, WorkerHandle
from rollmesh.dashboard.routes import DashboardRoutes, is_dashboard_request
from rollmesh.engine.errors import EngineError
from rollmesh.engine.paged_model import describe_served_model
from rollmesh.engine.protocols import GenerateOptions, GenerationResult
from rollmesh.messages.base import SamplingParams
from rollmesh.serve_apps.api_keys import check_authorization
from rollmesh.serve_apps.chat_requests import (
    ChatPrompt,
    chat_inputs,
    chat_response,
)
from rollmesh.serve_apps.chat_sessions import ChatSessions
from rollmesh.serve_apps.decode_loan_follower import DecodeLoanFollower
from rollmesh.serve_apps.errors import (
    ApiError,
    EngineUnavailableError,
    InvalidApiRequestError,
    api_error_from_engine,
)
from rollmesh.serve_apps.generate_extensions import generate_options
from rollmesh.serve_apps.generation_requests import (
    ServedModel,
    completion_inputs,
    completion_response,
    generate_inputs,
    generate_request_id,
    generate_response,
)
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
from rollmesh.serve_apps.session_actor import session_store_actor, stop_session_store
from rollmesh.serve_apps.stream_events import chat_events, completion_events, started
from rollmesh.serve_apps.tokenize_requests import detokenize, tokenize
from rollmesh.serve_apps.tool_choice import generate_grammar
from rollmesh.serve_apps.weight_admin import (
    Worker,
    flush_cache,
    update_weights_from_disk,
    weight_versions,
)
from rollmesh.telemetry import conventions
from rollmesh.telemetry.logging import setup_logging
from rollmesh.telemetry.tracing import setup_tracing, without_run_dir

APP_NAME = "rollmesh-inference"
# The Ray namespaces of the apps this process built: where their chat-session stores run.
_SESSION_NAMESPACES: set[str] = set()
# Requests a replica holds at once; each mostly waits on decode, which batches up to max_batch.
MAX_ONGOING_REQUESTS = 512

_log = structlog.get_logger("rollmesh.serve")
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
def _event_stream(events: Any) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


# The engine's field names as each route calls them, for the ``param`` of a mapped engine error.
COMPLETION_PARAMS = {"input_ids": "prompt", "max_new_tokens": "max_tokens"}
GENERATE_PARAMS = {"input_ids": "input_ids", "request_id": "rid",
                   "max_new_tokens": "sampling_params.max_new_tokens", "grammar": "sampling_params"}


def find_named_actor(name: str, namespace: str) -> Any:
    """How the dashboard finds the sandbox broker (by the name the launcher gave it), and the
    router a lent decode worker (by its grant id); ValueError when there is none."""
    return ray.get_actor(name, namespace=namespace)


def chat_params(body: ChatCompletionRequest) -> dict[str, str]:
    tokens = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    # A grammar the engine cannot compile is the tool's or the format's schema.
    grammar = "response_format" if body.response_format is not None else "tool_choice"
    return {"input_ids": "messages", "max_new_tokens": tokens, "grammar": grammar}


def api_error_from_ray(
    exc: BaseException, param_names: Mapping[str, str] | None = None
) -> ApiError:
    """The HTTP error for what ``await actor.method.remote()`` raised."""
    if isinstance(exc, RayActorError):
        return EngineUnavailableError(
            f"an inference worker is unavailable: {exc}", code="worker_unavailable"
        )
    # A task error raised in an actor arrives as RayTaskError(cause); when the cause could not be
    # unpickled here, ``cause`` is Ray's UnserializableException and we can only say 500.
    cause = exc.cause if isinstance(exc, RayTaskError) else exc
    if isinstance(cause, EngineError):
        return api_error_from_engine(cause, param_names)
    return ApiError(f"inference failed: {type(cause).__name__}", code="engine_error")


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
        dashboard: DashboardSource | None = None,
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
        # The constructor runs on the replica's event loop, where the dashboard's feed and the
        # follower of decode loans then live.
        self.dashboard = DashboardRoutes.start(
            dashboard, [WorkerHandle(w.name, w.role, w.actor) for w in self.workers],
            find_actor=find_named_actor)
        self.decode_loans = None
        if dashboard is not None:
            roster = DecodeLoanRoster(self.router, lambda name: find_named_actor(name, ray_namespace))
            self.decode_loans = DecodeLoanFollower(dashboard, roster)
            self.decode_loans.start()

    # A body that fails validation is answered 400 before the key is checked (FastAPI validates
    # before the handler runs); nothing reaches the engine either way.
    @_http.post("/v1/completions", response_model=None)
    async def completions(
        self, body: CompletionRequest, authorization: str | None = Header(default=None)
    ) -> CompletionResponse | StreamingResponse:
        check_authorization(authorization, self._api_key)
        input_ids, sampling = completion_inputs(body, self.served)
        options = dataclasses.replace(
            generate_options(body, prompt_len=len(input_ids), served=self.served),
            top_logprobs=body.logprobs or 0)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        if body.stream:
            pieces = await self._generate_stream(input_ids, sampling, request_id, options,
                                                 COMPLETION_PARAMS)
            return _event_stream(completion_events(
                pieces, request_id=request_id, created=int(time.time()), served=self.served,
                sampling=sampling, routed_experts_dtype=body.routed_experts_dtype,
                with_logprobs=body.logprobs is not None,
                include_usage=bool(body.stream_options and body.stream_options.include_usage)))
        result = await self._generate(input_ids, sampling, request_id, options,
                                      COMPLETION_PARAMS)
        return completion_response(
            result, request_id=request_id, created=int(time.time()), served=self.served,
            sampling=sampling, with_logprobs=body.logprobs is not None,
            routed_experts_dtype=body.routed_experts_dtype,
        )

    @_http.post("/v1/chat/completions", response_model=None)
    async def chat_completions(
        self, body: ChatCompletionRequest, authorization: str | None = Header(default=None)
    ) -> ChatCompletionResponse | StreamingResponse:
        check_authorization(authorization, self._api_key)
        if body.session_id is not None:  # a chat session: its trajectory is the prompt
            return await self._session_chat(body)
        prompt = chat_inputs(body, self.served)
        options = dataclasses.replace(
            generate_options(body, prompt_len=len(prompt.input_ids), served=self.served),
            top_logprobs=prompt.top_logprobs, grammar=prompt.grammar)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        if body.stream:
            pieces = await self._generate_stream(prompt.input_ids, prompt.sampling, request_id,
                                                 options, chat_params(body), operation="chat")
            return _event_stream(chat_events(
                pieces, prompt, request_id=request_id, created=int(time.time()),
                served=self.served, routed_experts_dtype=body.routed_experts_dtype,
                include_usage=bool(body.stream_options and body.stream_options.include_usage)))
        result = await self._generate(prompt.input_ids, prompt.sampling, request_id, options,
                                      chat_params(body), operation="chat")
        return chat_response(
            result, prompt, request_id=request_id, created=int(time.time()), served=self.served,
            routed_experts_dtype=body.routed_experts_dtype,
        )

    async def _session_chat(self, body: ChatCompletionRequest) -> ChatCompletionResponse | StreamingResponse:
        """A chat session's turn (``chat_sessions``): kept before it is answered, or, streamed,
        sent token by token and kept when the engine finishes it."""
        request_id = f"chatcmpl-{uuid.uuid4().hex}"

        def chat_options(prompt: ChatPrompt, options: GenerateOptions) -> GenerateOptions:
            return dataclasses.replace(options, top_logprobs=prompt.top_logprobs, grammar=prompt.grammar)

        if body.stream:
            async def stream(prompt: ChatPrompt, options: GenerateOptions):
                return await self._generate_stream(prompt.input_ids, prompt.sampling, request_id,
                                                   chat_options(prompt, options), chat_params(body),
                                                   operation="chat")

            prompt, pieces = await self.sessions.stream_turn(body, stream)
            return _event_stream(chat_events(
                pieces, prompt, request_id=request_id, created=int(time.time()),
                served=self.served, routed_experts_dtype=body.routed_experts_dtype,
                include_usage=bool(body.stream_options and body.stream_options.include_usage)))

        async def generate(prompt: ChatPrompt, options: GenerateOptions) -> GenerationResult:
            return await self._generate(prompt.input_ids, prompt.sampling, request_id,
                                        chat_options(prompt, options), chat_params(body), operation="chat")

        prompt, result = await self.sessions.turn(body, generate)
        return chat_response(result, prompt, request_id=request_id, created=int(time.time()),
                             served=self.served, routed_experts_dtype=body.routed_experts_dtype)

    @_http.post(
        "/generate", response_model=GenerateResponse, response_model_exclude_none=True
    )
    async def generate(
        self, body: GenerateRequest, authorization: str | None = Header(default=None)
    ) -> GenerateResponse:
        check_authorization(authorization, self._api_key)
        input_ids, sampling = generate_inputs(body, self.served)
        options = dataclasses.replace(
            generate_options(body, prompt_len=len(input_ids), served=self.served),
            grammar=generate_grammar(body.sampling_params))
        request_id = generate_request_id(body)
        result = await self._generate(input_ids, sampling, request_id, options, GENERATE_PARAMS)
        return generate_response(
            result, request_id=request_id, served=self.served, sampling=sampling,
            return_logprob=body.return_logprob, routed_experts_dtype=body.routed_experts_dtype,
        )

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
        if body.session_id not in (None, session_id):
            raise InvalidApiRequestError("session_id differs from the session in the path",
                                         code="invalid_value", param="session_id")
        return await self._session_chat(body.model_copy(update={"session_id": session_id}))

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
        try:
            return await weight_versions(self.workers)
        except (RayTaskError, RayActorError, EngineError) as exc:
            raise api_error_from_ray(exc) from exc

    @_http.post("/update_weights_from_disk", response_model=UpdateWeightsFromDiskResponse)
    async def admin_update_weights_from_disk(
        self, body: UpdateWeightsFromDiskRequest,
        authorization: str | None = Header(default=None),
    ) -> UpdateWeightsFromDiskResponse:
        check_authorization(authorization, self._api_key)
        try:
            answer = await update_weights_from_disk(self.workers, body)
        except (RayTaskError, RayActorError, EngineError) as exc:
            error = api_error_from_ray(exc)
            _log.warning("update_weights_failed", path=body.model_path, error=str(exc))
            raise error from exc
        _log.info("weights_updated_from_disk", path=body.model_path,
                  weight_version=answer.weight_version)
        return answer

    @_http.post("/flush_cache", response_model=FlushCacheResponse)
    async def admin_flush_cache(
        self, authorization: str | None = Header(default=None)
    ) -> FlushCacheResponse:
        check_authorization(authorization, self._api_key)
        try:
            return await flush_cache(self.workers)
        except (RayTaskError, RayActorError, EngineError) as exc:
            raise api_error_from_ray(exc) from exc

    async def _generate(
        self, input_ids: list[int], sampling: SamplingParams, request_id: str,
        options: GenerateOptions, param_names: Mapping[str, str],
        operation: str = "text_completion",
    ) -> GenerationResult:
        # The request's SERVER span (FastAPI's telemetry) is current here.
        span = trace.get_current_span()
        span.set_attributes({
            conventions.GEN_AI_OPERATION_NAME: operation,
            conventions.GEN_AI_REQUEST_MODEL: self.served.name,
            conventions.GEN_AI_REQUEST_MAX_TOKENS: sampling.max_new_tokens,
            conventions.GEN_AI_REQUEST_TEMPERATURE: sampling.temperature,
            conventions.GEN_AI_USAGE_INPUT_TOKENS: len(input_ids),
            "request_id": request_id,
        })
        try:
            result = await self.router.generate(
                input_ids, sampling, request_id=request_id, options=options)
        except (RayTaskError, RayActorError, EngineError) as exc:
            error = api_error_from_ray(exc, param_names)
            if error.status >= 500:
                _log.warning("generate_failed", request_id=request_id, error=str(exc))
            raise error from exc
        span.set_attributes(generation_attributes(result))
        return result

    async def _generate_stream(
        self, input_ids: list[int], sampling: SamplingParams, request_id: str,
        options: GenerateOptions, param_names: Mapping[str, str],
        operation: str = "text_completion",
    ):
        """The router's pieces, once the first has come (an error before it is this request's
        HTTP error; one after it is an error event: ``stream_events``)."""
        trace.get_current_span().set_attributes({
            conventions.GEN_AI_OPERATION_NAME: operation,
            conventions.GEN_AI_REQUEST_MODEL: self.served.name,
            conventions.GEN_AI_REQUEST_MAX_TOKENS: sampling.max_new_tokens,
            conventions.GEN_AI_REQUEST_TEMPERATURE: sampling.temperature,
            conventions.GEN_AI_USAGE_INPUT_TOKENS: len(input_ids),
            "request_id": request_id, "stream": True,
        })
        pieces = self.router.generate_stream(input_ids, sampling, request_id=request_id,
                                             options=options)
        return await started(pieces, lambda exc: api_error_from_ray(exc, param_names))


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
    dashboard: DashboardSource | None = None,
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
    ``dashboard``: the mesh the replica follows: ``/dashboard`` shows it (with
    ``dashboard.enabled``; otherwise, or with None, those routes answer 404), and the router also
    sends requests to the decode workers its GPU scheduler lends idle accelerators to.
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
