"""The SGLang backend: an ``InferenceEngine`` over one or more SGLang servers, plus weight admin.

Knows ``sglang_client`` (one server's HTTP API and wire mapping) and the engine protocol; knows
nothing of how the servers were started (``sglang_server``), nor of Ray or NATS. Requests go
round-robin, or to one server per ``session_id`` (by hash, so a conversation's prefix stays in
that server's radix cache). Weight admin calls go to every server and wait for all of them.

Versions: SGLang stamps each answer with its label at emission (``meta_info.weight_version``),
not per token, so every token of a result carries that one label (see
``parse_generate_response``). The engine remembers the last label seen per server; a request with
``min_version`` above it asks the server again (another controller may have updated it) and fails
with the retryable ``VersionUnavailableError`` if the server is still older. Labels only grow
while a server lives; a server restarted on older weights is caught by checking the answer too.
"""

from __future__ import annotations

import asyncio
import itertools
import zlib
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import httpx
import structlog

from rollmesh.engine.errors import (
    InvalidRequestError,
    StaleWeightsError,
    VersionUnavailableError,
)
from rollmesh.engine.protocols import DEFAULT_OPTIONS, GenerateOptions, GenerationResult
from rollmesh.engine.sglang_client import (
    PAUSE_MODES,
    PauseMode,
    RoutedExpertsShape,
    SGLangClient,
    SGLangResponseError,
    build_generate_payload,
    parse_generate_response,
    stop_ids_for,
)
from rollmesh.messages.base import SamplingParams

_log = structlog.get_logger("rollmesh.engine.sglang_backend")
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class SGLangEngineStats:
    requests: int
    # Answers whose routed experts covered the whole sequence although a start was asked for.
    start_len_ignored: int
    versions: dict[str, int | None]  # last label seen per server URL


class SGLangEngine:
    """``InferenceEngine`` over SGLang servers; ``async with`` closes its HTTP connections."""

    def __init__(
        self,
        base_urls: Sequence[str],
        *,
        routed_experts_shape: RoutedExpertsShape | None = None,
        generate_timeout_s: float | None = None,
        admin_timeout_s: float = 600.0,
        http: httpx.AsyncClient | None = None,
        end_of_turn_ids: Iterable[int] = (),
        encode: Callable[[str], list[int]] | None = None,
        skip_tokenizer_init: bool = False,
        admin_urls: Sequence[str] | None = None,
    ) -> None:
        """``end_of_turn_ids``: the model's end-of-turn ids (its tokenizer's), sent as
        ``stop_token_ids`` so a turn ends where the local engine ends it. ``skip_tokenizer_init``:
        the servers run with ``--skip-tokenizer-init``, so stop strings go as their token ids
        (``encode``: the model's tokenizer, text -> ids). ``admin_urls``: where pause, weight and
        version calls go when they are not the generate URLs (a PD router in front of its
        prefill and decode servers)."""
        if not base_urls:
            raise ValueError("SGLangEngine needs at least one server URL")
        if skip_tokenizer_init and encode is None:
            raise ValueError("skip_tokenizer_init needs encode (the model's tokenizer) for stop strings")
        self._owns_http = http is None
        # No pool limit: every in-flight generate holds a connection for its whole duration.
        self._http = http or httpx.AsyncClient(limits=httpx.Limits(max_connections=None))
        self.servers = [
            SGLangClient(url, self._http, generate_timeout_s=generate_timeout_s,
                         admin_timeout_s=admin_timeout_s)
            for url in base_urls
        ]
        self.admin_servers = self.servers if admin_urls is None else [
            SGLangClient(url, self._http, admin_timeout_s=admin_timeout_s) for url in admin_urls]
        self.routed_experts_shape = routed_experts_shape
        self.end_of_turn_ids = sorted(set(end_of_turn_ids))
        self.skip_tokenizer_init = skip_tokenizer_init
        self._encode = encode
        self._paused: PauseMode | None = None
        self._versions: dict[str, int | None] = {s.base_url: None for s in self.servers}
        self._round_robin = itertools.count()
        self._requests = 0
        self._start_len_ignored = 0

    async def __aenter__(self) -> "SGLangEngine":
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._owns_http:
            await self._http.aclose()

    # -- generation -------------------------------------------------------------------------

    def server_for(self, session_id: str | None) -> SGLangClient:
        if session_id is None:
            return self.servers[next(self._round_robin) % len(self.servers)]
        # crc32, not hash(): stable across processes, so every caller picks the same server.
        return self.servers[zlib.crc32(session_id.encode()) % len(self.servers)]

    async def generate(
        self,
        input_ids: list[int],
        sampling: SamplingParams,
        *,
        request_id: str,
        options: GenerateOptions = DEFAULT_OPTIONS,
    ) -> GenerationResult:
        self._check_request(input_ids, sampling, request_id, options)
        server = self.server_for(options.session_id)
        if options.min_version is not None:
            await self._require_version(server, options.min_version, request_id)
        stop_string_ids: list[int] = []
        if self.skip_tokenizer_init and sampling.stop:
            assert self._encode is not None
            stop_string_ids = stop_ids_for(list(sampling.stop), self._encode, request_id=request_id)
        payload = build_generate_payload(
            input_ids, sampling, request_id=request_id, options=options,
            stop_token_ids=[*self.end_of_turn_ids, *stop_string_ids],
            stop_strings=not self.skip_tokenizer_init)
        body = await server.generate(payload)
        self._requests += 1
        try:
            answer = parse_generate_response(
                body, prompt_len=len(input_ids), request_id=request_id, options=options,
                shape=self.routed_experts_shape,
                stop_string_ids=frozenset(stop_string_ids) - frozenset(self.end_of_turn_ids),
            )
        except (ValueError, TypeError, IndexError, KeyError) as exc:
            raise SGLangResponseError(server.base_url, "/generate", str(exc), request_id=request_id) from exc
        self._versions[server.base_url] = answer.weight_version
        if answer.ignored_start_len:
            if self._start_len_ignored == 0:
                _log.warning("sglang_ignores_routed_experts_start_len", url=server.base_url,
                             request_id=request_id)
            self._start_len_ignored += 1
        if options.min_version is not None and answer.weight_version < options.min_version:
            raise VersionUnavailableError(options.min_version, answer.weight_version, request_id=request_id)
        return answer.result

    def _check_request(self, input_ids: list[int], sampling: SamplingParams, request_id: str,
                       options: GenerateOptions) -> None:
        """Refused here: what the local engine refuses (so both backends agree), and routed-expert
        asks this engine could not read back."""
        if not input_ids:
            raise InvalidRequestError("empty prompt", field="input_ids", request_id=request_id)
        if any(not s for s in sampling.stop):
            raise InvalidRequestError("empty stop string", field="sampling.stop", request_id=request_id)
        if options.return_routed_experts:
            if self.routed_experts_shape is None:
                raise InvalidRequestError(
                    "this engine was built without a RoutedExpertsShape",
                    field="return_routed_experts", request_id=request_id,
                )
            if not 0 <= options.routed_experts_start_len <= len(input_ids):
                raise InvalidRequestError(
                    f"{options.routed_experts_start_len} is outside [0, {len(input_ids)}]",
                    field="routed_experts_start_len", request_id=request_id,
                )

    async def _require_version(self, server: SGLangClient, min_version: int, request_id: str) -> None:
        known = self._versions[server.base_url]
        if known is None or known < min_version:
            if self.admin_servers is not self.servers:
                known = await self.current_version()  # a router: its servers hold the versions
            else:
                known = await server.weight_version()
                self._versions[server.base_url] = known
        if known < min_version:
            raise VersionUnavailableError(min_version, known, request_id=request_id)

    # -- weight admin -----------------------------------------------------------------------

    async def current_version(self) -> int:
        """The version every server has reached (the oldest among them), asked afresh."""
        versions = await self._on_every_server(lambda s: s.weight_version())
        if self.admin_servers is not self.servers:  # behind a router: it serves the oldest
            self._versions = dict.fromkeys(self._versions, min(versions))
        for server, version in zip(self.admin_servers, versions):
            if server.base_url in self._versions:
                self._versions[server.base_url] = version
        return min(versions)

    async def update_weights_from_disk(
        self, path: str, version: int, *, load_format: str | None = None,
        flush_cache: bool = False, abort_all_requests: bool = False,
    ) -> None:
        """Every server loads ``path`` and labels it ``version``.

        SGLang waits for running requests before loading unless generation is paused (``pause``)
        or ``abort_all_requests``. The prefix cache is not flushed by default: after a pause that
        keeps requests (``in_place``, ``retract``) the flush fails, and SGLang's scheduler asserts
        it succeeded (``assert flush_cache_success`` in its weight updater) and dies; fixed only
        on the sglang-miles branch (sglang#31962). So ``flush_cache=True`` while so paused is
        refused here.
        """
        if flush_cache and self._paused in ("in_place", "retract"):
            raise InvalidRequestError(
                f"flush_cache after pause({self._paused!r}) kills SGLang's scheduler (assert "
                "flush_cache_success): requests still wait; pause with 'abort' to flush",
                field="flush_cache")
        newest = max((v for v in self._versions.values() if v is not None), default=None)
        if newest is not None and version < newest:
            raise StaleWeightsError(version, newest)
        try:
            await self._on_every_server(lambda s: s.update_weights_from_disk(
                path, version, load_format=load_format, flush_cache=flush_cache,
                abort_all_requests=abort_all_requests,
            ))
        except Exception:
            # Some servers may have loaded it: forget what we knew and ask them next time.
            self._versions = dict.fromkeys(self._versions)
            raise
        self._versions = dict.fromkeys(self._versions, version)

    async def pause(self, mode: PauseMode = "in_place") -> None:
        """Pause every server. ``in_place`` (default) keeps running requests and their old-weight
        KV, to continue after ``resume``; ``retract`` recomputes their KV after ``resume``;
        ``abort`` returns them now (finish_reason "abort", partial output kept)."""
        if mode not in PAUSE_MODES:
            raise InvalidRequestError(f"{mode!r} is not one of {PAUSE_MODES}", field="mode")
        self._paused = mode  # before the call: a server may pause even if another fails
        await self._on_every_server(lambda s: s.pause_generation(mode))

    async def resume(self) -> None:
        await self._on_every_server(lambda s: s.continue_generation())
        self._paused = None

    async def swap_weights_from_disk(self, path: str, version: int, *,
                                     pause_mode: PauseMode = "in_place") -> None:
        """Pause, load ``path`` as ``version`` without flushing, continue (also after a failure)."""
        await self.pause(pause_mode)
        try:
            await self.update_weights_from_disk(path, version, flush_cache=False)
        finally:
            await self.resume()

    async def flush_cache(self) -> None:
        await self._on_every_server(lambda s: s.flush_cache())

    def statistics(self) -> SGLangEngineStats:
        return SGLangEngineStats(self._requests, self._start_len_ignored, dict(self._versions))

    async def _on_every_server(self, call: Callable[[SGLangClient], Awaitable[T]]) -> list[T]:
        """``call`` on all servers at once; every call finishes before the first error is raised."""
        outcomes = await asyncio.gather(*(call(s) for s in self.admin_servers), return_exceptions=True)
        errors = [o for o in outcomes if isinstance(o, BaseException)]
        for extra in errors[1:]:
            _log.warning("sglang_admin_call_failed", error=str(extra))
        if errors:
            raise errors[0]
        return outcomes  # type: ignore[return-value]
