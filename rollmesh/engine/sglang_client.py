"""One SGLang server over HTTP, and the mapping between its native JSON and our engine types (routed-expert rows: ``sglang_routes``).

Knows SGLang's native HTTP API and httpx; knows nothing of processes (``sglang_server``), of
several servers or weight versions over time (``sglang_backend``), nor of Ray or NATS. SGLang's
own package is never imported: it pins a CUDA torch, so we only speak its wire format.

Checked against sgl-project/sglang sources read through the code index (the index holds many
versions of each file; commits named where the index named them):
- ``python/sglang/srt/entrypoints/http_server.py`` at 0025436eab05: ``/generate``, ``/health`` ==
  ``/health_generate`` (503 while starting), ``/get_model_info`` (has ``weight_version``),
  ``/pause_generation``, ``/continue_generation``, ``/flush_cache`` (400 while requests run),
  ``/update_weights_from_disk`` (``{success, message, num_paused_requests}``, 400 on failure),
  error bodies ``{"error": {"message"}}`` or ``{"message", "code"}``. A later stored build moves
  model info to ``/model_info`` and answers 404 on ``/get_weight_version``, so we ask
  ``/model_info`` first and fall back to ``/get_model_info``.
- ``python/sglang/srt/managers/io_struct.py`` (unpinned 2026 snapshot, msgspec ``BaseReq``):
  ``GenerateReqInput.return_routed_experts`` / ``routed_experts_start_len`` (rows
  ``[start_len, seqlen - 1)``), ``PauseGenerationReqInput.mode`` in abort|retract|in_place,
  ``UpdateWeightFromDiskReqInput(model_path, load_format, abort_all_requests, weight_version,
  flush_cache, ...)``.
- ``tokenizer_manager.py`` (same snapshot): ``meta_info`` = ``finish_reason`` (``{"type": "stop",
  "matched": id|str}``, ``{"type": "length", "length"}``, ``{"type": "abort", "message",
  "status_code"}``), ``prompt_tokens``, ``completion_tokens``, ``cached_tokens``,
  ``weight_version`` (the server's label when the output is emitted), ``output_token_logprobs``
  as ``(logprob, token_id, text|None)``, ``routed_experts`` as base64 of int32 bytes.
- ``sampling_params.py``: ``SamplingParams(json_schema, regex, ebnf, structural_tag)``, strings;
  ``GenerateOptions.grammar`` goes out under its kind's name. ``stop_token_ids`` end a generation
  at any of those ids (finish_reason ``{"type": "stop", "matched": <id>}``, the id kept in
  ``output_ids``). Under ``--skip-tokenizer-init`` ``SamplingParams.normalize`` calls
  ``raise_if_tokenizer_required``, which refuses any ``stop`` string with a ValueError that
  ``/generate`` answers as a 400 (sglang#27882): so stop strings go out as ``stop_token_ids``
  there, each one token of the model's tokenizer (``stop_ids_for``). Not checked here: that every
  SGLang build reads xgrammar's newer structural-tag form (``{"type": "structural_tag",
  "format"}``) and reports logprobs after the grammar's mask, as the local engine does.

    EngineError
    ├── SGLangUnavailableError(url, reason)           retryable: refused, timed out, 503
    ├── SGLangHTTPError(url, endpoint, status, message) SGLang refused an admin call, or a 5xx
    └── SGLangResponseError(url, endpoint, reason)    a 200 whose body does not fit the contract
A 4xx on ``/generate`` is our ``InvalidRequestError``; a failed weight load is ``WeightsError``.

Every request carries the current span's W3C ``traceparent`` header (none when no span is
active), so a server that traces requests can join the caller's trace; others ignore it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import httpx

from rollmesh.engine.errors import EngineError, InvalidRequestError, WeightsError
from rollmesh.engine.protocols import FinishReason, GenerateOptions, GenerationResult
from rollmesh.engine.sglang_routes import RoutedExpertsShape, decode_routed_experts
from rollmesh.messages.base import SamplingParams
from rollmesh.telemetry.trace_headers import inject_trace_headers

PauseMode = Literal["abort", "retract", "in_place"]
PAUSE_MODES: tuple[str, ...] = ("abort", "retract", "in_place")
# SGLang labels weights "default" until someone sets a version; we read that as version 0.
_UNSET_LABEL = "default"


class SGLangUnavailableError(EngineError):
    """The server could not be reached or said it cannot serve now. Retryable."""

    retryable = True

    def __init__(self, url: str, reason: str, *, request_id: str | None = None) -> None:
        where = f" (request {request_id})" if request_id else ""
        super().__init__(f"SGLang at {url} unavailable: {reason}{where}")
        self.url = url
        self.reason = reason
        self.request_id = request_id


class SGLangHTTPError(EngineError):
    def __init__(self, url: str, endpoint: str, status: int, message: str) -> None:
        super().__init__(f"SGLang at {url}{endpoint} answered {status}: {message}")
        self.url = url
        self.endpoint = endpoint
        self.status = status
        self.message = message


class SGLangResponseError(EngineError):
    def __init__(self, url: str, endpoint: str, reason: str, *, request_id: str | None = None) -> None:
        where = f" (request {request_id})" if request_id else ""
        super().__init__(f"unreadable answer from SGLang at {url}{endpoint}: {reason}{where}")
        self.url = url
        self.endpoint = endpoint
        self.reason = reason
        self.request_id = request_id


# -- request and response mapping (plain functions) -----------------------------------------


def build_generate_payload(
    input_ids: list[int], sampling: SamplingParams, *, request_id: str, options: GenerateOptions,
    stop_token_ids: list[int] | None = None, stop_strings: bool = True,
) -> dict[str, Any]:
    """The ``/generate`` body: token ids in, output logprobs always on (we need behaviour logprobs),
    with SGLang's ``top_logprobs_num`` when the caller asks for alternatives. Never streamed: the
    Serve app streams through the torch engine's decode actors; this backend answers whole.

    ``stop_token_ids``: ids that end the generation (the model's end-of-turn ids, as the local
    engine stops at, and under ``--skip-tokenizer-init`` the ids of the stop strings).
    ``stop_strings=False`` leaves ``sampling.stop`` out: a server without a tokenizer answers 400
    to any stop string (sglang#27882)."""
    sampling_params: dict[str, Any] = {
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "max_new_tokens": sampling.max_new_tokens,
    }
    if sampling.stop and stop_strings:
        sampling_params["stop"] = list(sampling.stop)
    if stop_token_ids:
        sampling_params["stop_token_ids"] = sorted(set(stop_token_ids))
    if options.grammar is not None:
        # SGLang's own names for the three kinds (SamplingParams json_schema / ebnf /
        # structural_tag, each a string), compiled by its grammar backend (xgrammar by default).
        # A grammar's end_ids have no SGLang equivalent: its turn ends at any of its stop ids.
        sampling_params[options.grammar.kind] = options.grammar.text
    payload: dict[str, Any] = {
        "rid": request_id,
        "input_ids": list(input_ids),
        "sampling_params": sampling_params,
        "return_logprob": True,
        "stream": False,
    }
    if options.top_logprobs:
        payload["top_logprobs_num"] = options.top_logprobs
    if options.return_routed_experts:
        payload["return_routed_experts"] = True
        # Sent only when it changes something, so a server predating the field sees the same body.
        if options.routed_experts_start_len:
            payload["routed_experts_start_len"] = options.routed_experts_start_len
    return payload


def stop_ids_for(stops: list[str], encode: Callable[[str], list[int]], *,
                 request_id: str | None = None) -> list[int]:
    """The token id of each stop string, for a server without a tokenizer
    (``--skip-tokenizer-init``). A stop string that is not one token of the model's tokenizer
    cannot be matched on ids by SGLang, so the request is refused here, before SGLang answers 400."""
    ids = []
    for stop in stops:
        encoded = encode(stop)
        if len(encoded) != 1:
            raise InvalidRequestError(
                f"stop string {stop!r} is {len(encoded)} tokens; under --skip-tokenizer-init "
                "(inference.sglang.skip_tokenizer_init) SGLang matches stops on single token ids only",
                field="sampling.stop", request_id=request_id)
        ids.append(encoded[0])
    return ids


def parse_weight_version(label: object) -> int:
    """SGLang's weight label as our int version; raises ValueError when it is not one."""
    if label is None or label == _UNSET_LABEL:
        return 0
    if isinstance(label, bool):
        raise ValueError(f"weight_version {label!r} is not an integer")
    if isinstance(label, int):
        return label
    if isinstance(label, str) and label.strip().lstrip("-").isdigit():
        return int(label)
    raise ValueError(f"weight_version {label!r} is not an integer (rollmesh labels versions 0, 1, ...)")


def parse_finish_reason(raw: object, *, request_id: str | None = None,
                        stop_string_ids: frozenset[int] = frozenset()) -> FinishReason:
    """Map SGLang's finish_reason dict; a 4xx-coded abort is SGLang refusing the request.
    ``stop_string_ids``: the ids stop strings were sent as (``--skip-tokenizer-init``)."""
    kind = raw.get("type") if isinstance(raw, dict) else raw
    if kind == "length":
        return "length"
    if kind == "stop":
        # A matched token id (or ids) is the model's EOS, unless it stands for one of our stop
        # strings; a matched string is one of our stops.
        matched = raw.get("matched") if isinstance(raw, dict) else None
        if isinstance(matched, int) and matched in stop_string_ids:
            return "stop"
        return "stop" if isinstance(matched, str) else "eos"
    if kind == "abort":
        status = raw.get("status_code") if isinstance(raw, dict) else None
        if isinstance(status, int) and 400 <= status < 500:
            raise InvalidRequestError(str(raw.get("message")), field="request", request_id=request_id)
        return "abort"
    raise ValueError(f"unknown finish_reason {raw!r}")


@dataclass(frozen=True, slots=True)
class GenerateAnswer:
    """One parsed ``/generate`` answer: the result, the server's label, and a server quirk seen."""

    result: GenerationResult
    weight_version: int
    ignored_start_len: bool = False


def parse_generate_response(
    body: dict[str, Any], *, prompt_len: int, request_id: str, options: GenerateOptions,
    shape: RoutedExpertsShape | None, stop_string_ids: frozenset[int] = frozenset(),
) -> GenerateAnswer:
    """A ``/generate`` answer as a GenerationResult; raises ValueError where it breaks the contract.

    Every token gets the one ``meta_info.weight_version`` label: SGLang stamps the server's label
    at emission, not per token, so tokens made before a mid-request update (pause modes retract
    and in_place) carry the newer label. Callers that need exact per-token versions pause with
    ``abort`` and resubmit the partial output (the AReaL pattern).
    """
    meta = body.get("meta_info")
    output_ids = body.get("output_ids")
    if not isinstance(meta, dict) or not isinstance(output_ids, list):
        raise ValueError("no meta_info or output_ids")
    token_ids = [int(t) for t in output_ids]
    entries = meta.get("output_token_logprobs")
    if not isinstance(entries, list) or len(entries) != len(token_ids):
        raise ValueError(f"{len(entries) if isinstance(entries, list) else 'no'} output logprobs "
                         f"for {len(token_ids)} tokens")
    if any(int(entry[1]) != token for entry, token in zip(entries, token_ids)):
        raise ValueError("output_token_logprobs token ids differ from output_ids")
    # orjson writes a non-finite float as null; the only one a logprob can be is -inf.
    logprobs = [float("-inf") if entry[0] is None else float(entry[0]) for entry in entries]
    finish_reason = parse_finish_reason(meta.get("finish_reason"), request_id=request_id,
                                        stop_string_ids=stop_string_ids)
    top_logprobs = _top_logprobs(meta, len(token_ids)) if options.top_logprobs else None
    version = parse_weight_version(meta.get("weight_version"))
    routed, start, ignored = None, 0, False
    if options.return_routed_experts:
        if shape is None:
            raise ValueError("routed experts were requested but the engine has no RoutedExpertsShape")
        encoded = meta.get("routed_experts")
        start = options.routed_experts_start_len
        if isinstance(encoded, str):
            routed, ignored = decode_routed_experts(
                encoded, shape, seqlen=prompt_len + len(token_ids), start_len=start
            )
        elif finish_reason != "abort":  # an abort may come before any forward pass: no rows
            raise ValueError("no routed_experts (was the server launched with "
                             "--enable-return-routed-experts?)")
    result = GenerationResult(
        token_ids=token_ids, logprobs=logprobs, versions=[version] * len(token_ids),
        finish_reason=finish_reason, prompt_len=prompt_len, request_id=request_id,
        cached_tokens=int(meta.get("cached_tokens") or 0),
        routed_experts=routed, routed_experts_start=start, top_logprobs=top_logprobs,
        # SGLang masks every step of a grammar request and does not say where the mask was
        # all-true, so each of its tokens counts as constrained.
        constrained=[True] * len(token_ids) if options.grammar is not None else [],
    )
    return GenerateAnswer(result, version, ignored)


def _top_logprobs(meta: dict[str, Any], num_tokens: int) -> list[list[tuple[int, float]]]:
    """SGLang's ``output_top_logprobs`` (per token: [logprob, token_id, text] entries, most
    likely first) as the engine's (token id, logprob) pairs."""
    entries = meta.get("output_top_logprobs")
    if not isinstance(entries, list) or len(entries) != num_tokens:
        raise ValueError(f"{len(entries) if isinstance(entries, list) else 'no'} output top "
                         f"logprobs for {num_tokens} tokens")
    return [[(int(entry[1]), float("-inf") if entry[0] is None else float(entry[0]))
             for entry in alternatives or ()] for alternatives in entries]


def error_message(response: httpx.Response) -> str:
    """SGLang's message out of any of its error shapes, else the start of the body."""
    try:
        body = response.json()
    except ValueError:
        return response.text[:500] or response.reason_phrase
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
        for key in ("message", "detail", "error"):
            if body.get(key):
                return str(body[key])
    return str(body)[:500]


# -- the client -----------------------------------------------------------------------------


class SGLangClient:
    """One server's endpoints; every transport failure comes out as a typed EngineError."""

    def __init__(self, base_url: str, http: httpx.AsyncClient, *,
                 generate_timeout_s: float | None = None, admin_timeout_s: float = 600.0) -> None:
        self.base_url = base_url.rstrip("/")
        self._http = http
        self.generate_timeout_s = generate_timeout_s
        self.admin_timeout_s = admin_timeout_s
        self._model_info_path = "/model_info"

    async def generate(self, payload: dict[str, Any]) -> dict[str, Any]:
        request_id = payload.get("rid")
        # Non-streaming: if we go away (cancel, timeout) SGLang sees the disconnect and aborts.
        response = await self._send("POST", "/generate", payload, self.generate_timeout_s, request_id)
        if 400 <= response.status_code < 500:
            raise InvalidRequestError(error_message(response), field="request", request_id=request_id)
        return self._json(response, "/generate", request_id)

    async def model_info(self) -> dict[str, Any]:
        response = await self._send("GET", self._model_info_path, None, self.admin_timeout_s)
        if response.status_code == 404 and self._model_info_path == "/model_info":
            self._model_info_path = "/get_model_info"  # builds before the rename
            return await self.model_info()
        return self._json(response, self._model_info_path)

    async def weight_version(self) -> int:
        info = await self.model_info()
        try:
            return parse_weight_version(info.get("weight_version"))
        except ValueError as exc:
            raise SGLangResponseError(self.base_url, self._model_info_path, str(exc)) from exc

    async def is_healthy(self, path: str = "/health_generate") -> bool:
        """One token generated end to end (SGLang's /health_generate); False while starting."""
        try:
            response = await self._send("GET", path, None, self.admin_timeout_s)
        except SGLangUnavailableError:
            return False
        return response.status_code == 200

    async def pause_generation(self, mode: PauseMode) -> None:
        self._json(await self._send("POST", "/pause_generation", {"mode": mode}, self.admin_timeout_s),
                   "/pause_generation")

    async def continue_generation(self) -> None:
        self._json(await self._send("POST", "/continue_generation", {}, self.admin_timeout_s),
                   "/continue_generation")

    async def flush_cache(self) -> None:
        # Answers plain text; 400 means requests were still running (see pause modes).
        response = await self._send("POST", "/flush_cache", None, self.admin_timeout_s)
        if response.status_code != 200:
            raise SGLangHTTPError(self.base_url, "/flush_cache", response.status_code, error_message(response))

    async def update_weights_from_disk(
        self, model_path: str, version: int, *, load_format: str | None = None,
        flush_cache: bool = False, abort_all_requests: bool = False,
    ) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model_path": model_path,
            "weight_version": str(version),
            "flush_cache": flush_cache,
            "abort_all_requests": abort_all_requests,
        }
        if load_format is not None:
            body["load_format"] = load_format
        response = await self._send("POST", "/update_weights_from_disk", body, self.admin_timeout_s)
        if response.status_code == 400:
            raise WeightsError(
                f"SGLang at {self.base_url} did not load {model_path}: {error_message(response)}",
                version=version, path=model_path,
            )
        answer = self._json(response, "/update_weights_from_disk")
        if not answer.get("success", False):
            raise WeightsError(f"SGLang at {self.base_url} did not load {model_path}: "
                               f"{answer.get('message')}", version=version, path=model_path)
        return answer

    # Lending the accelerator (``scheduler.lend_role_accelerators``). http_server.py (sglang main,
    # 9c0549b727fe): POST ``/release_memory_occupation`` and ``/resume_memory_occupation`` take
    # io_struct.py's ``ReleaseMemoryOccupationReqInput`` / ``ResumeMemoryOccupationReqInput``
    # (``tags``: "weights", "kv_cache" (newer builds also "cuda_graph"); absent: all) and answer 200
    # with an empty body, or an error body. Memory really goes back to the device only on a server
    # started with ``--enable-memory-saver``; without it the calls succeed and free nothing.

    async def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        await self._memory_call("/release_memory_occupation", tags)

    async def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        await self._memory_call("/resume_memory_occupation", tags)

    async def _memory_call(self, endpoint: str, tags: list[str] | None) -> None:
        body = {} if tags is None else {"tags": tags}
        response = await self._send("POST", endpoint, body, self.admin_timeout_s)
        if response.status_code != 200:
            raise SGLangHTTPError(self.base_url, endpoint, response.status_code, error_message(response))

    # Weights without files (``sglang_weight_sync``). Payloads are SGLang's io_struct.py
    # ``InitWeightsUpdateGroupReqInput`` / ``DestroyWeightsUpdateGroupReqInput`` /
    # ``UpdateWeightsFromDistributedReqInput`` (names, dtypes as torch's names without "torch.",
    # shapes, group_name, flush_cache, weight_version) / ``UpdateWeightsFromTensorReqInput``
    # (serialized_named_tensors: one base64 ForkingPickler dump per TP rank, load_format,
    # flush_cache, weight_version); http_server.py answers each ``{success, message}``, 200 or 400.

    async def init_weights_update_group(self, *, master_address: str, master_port: int, rank_offset: int,
                                        world_size: int, group_name: str, backend: str) -> None:
        """Join the trainer's broadcast group; returns once every member joined."""
        await self._weights_call("/init_weights_update_group", {
            "master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
            "world_size": world_size, "group_name": group_name, "backend": backend}, None)

    async def destroy_weights_update_group(self, group_name: str) -> None:
        await self._weights_call("/destroy_weights_update_group", {"group_name": group_name}, None)

    async def update_weights_from_distributed(self, *, names: list[str], dtypes: list[str],
                                              shapes: list[list[int]], group_name: str, version: int | None,
                                              flush_cache: bool = False) -> None:
        """Receive one bucket, broadcast by rank 0 of ``group_name`` tensor by tensor in this order,
        and label the weights ``version`` (None: the label stays; SGLang sets it only when given);
        returns once loaded."""
        body = {"names": names, "dtypes": dtypes, "shapes": shapes, "group_name": group_name,
                "flush_cache": flush_cache}
        if version is not None:
            body["weight_version"] = str(version)
        await self._weights_call("/update_weights_from_distributed", body, version)

    async def update_weights_from_tensor(self, *, serialized_named_tensors: list[str], version: int | None,
                                         flush_cache: bool = False, load_format: str | None = None) -> None:
        """Load tensors shared by CUDA IPC handles (a colocated trainer) and label them ``version``
        (None: the label stays); returns once loaded."""
        body = {"serialized_named_tensors": serialized_named_tensors, "load_format": load_format,
                "flush_cache": flush_cache}
        if version is not None:
            body["weight_version"] = str(version)
        await self._weights_call("/update_weights_from_tensor", body, version)

    async def _weights_call(self, endpoint: str, body: dict[str, Any], version: int | None) -> None:
        response = await self._send("POST", endpoint, body, self.admin_timeout_s)
        if response.status_code == 400:
            raise WeightsError(f"SGLang at {self.base_url} refused {endpoint}: {error_message(response)}",
                               version=version)
        answer = self._json(response, endpoint)
        if not answer.get("success", False):
            raise WeightsError(f"SGLang at {self.base_url} failed {endpoint}: {answer.get('message')}",
                               version=version)

    # -- transport --------------------------------------------------------------------------

    async def _send(self, method: str, endpoint: str, body: dict[str, Any] | None,
                    timeout_s: float | None, request_id: str | None = None) -> httpx.Response:
        try:
            response = await self._http.request(
                method, self.base_url + endpoint, json=body, headers=inject_trace_headers({}),
                timeout=httpx.Timeout(timeout_s, connect=10.0),
            )
        except httpx.TimeoutException as exc:
            raise SGLangUnavailableError(self.base_url, f"{endpoint} timed out ({type(exc).__name__})",
                                         request_id=request_id) from exc
        except httpx.HTTPError as exc:
            raise SGLangUnavailableError(self.base_url, f"{endpoint}: {type(exc).__name__}: {exc}",
                                         request_id=request_id) from exc
        if response.status_code == 503:
            raise SGLangUnavailableError(self.base_url, f"{endpoint} answered 503: {error_message(response)}",
                                         request_id=request_id)
        return response

    def _json(self, response: httpx.Response, endpoint: str, request_id: str | None = None) -> dict[str, Any]:
        if response.status_code != 200:
            raise SGLangHTTPError(self.base_url, endpoint, response.status_code, error_message(response))
        try:
            body = response.json()
        except ValueError as exc:
            raise SGLangResponseError(self.base_url, endpoint, "body is not JSON", request_id=request_id) from exc
        if not isinstance(body, dict):
            raise SGLangResponseError(self.base_url, endpoint, f"expected an object, got {type(body).__name__}",
                                      request_id=request_id)
        return body
