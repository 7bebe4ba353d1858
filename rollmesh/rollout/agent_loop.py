"""The agent loop of one rollout: generate -> parse tool calls -> run them -> append -> ... -> reward.

Knows the task plugins, the model's ``ChatModel``, the inference, publisher and state-store seams
and the wire contract; not Ray, not nats-py (they arrive as injected collaborators). Tracing: the
rollout has one span; every turn is its own trace whose root span links back to the rollout span.

Token in, token out. The task's messages are rendered by the model's own chat template and
tokenized once; every generated id is kept exactly as sampled with its logprob and weight version;
a turn is parsed (content, reasoning, tool calls in the model's own format) from its ids; the
turn's calls run concurrently and their results are appended as the template writes them (loss
mask 0). A turn without an end-of-turn id (cut by ``max_new_tokens``) ends the rollout as
"truncated". Afterwards the tokens are checked against a whole render of the conversation
(``RolloutCompleted.tokenization_mismatches``; with ``rollout.strict_tokenization`` a difference
in text the model did not generate that no documented history rewrite of the family explains
fails the rollout as ``tokenization_error``, never retried). With ``rollout.history_rewrite =
"split"`` a rollout may end as several training samples, each checked against its own render.

Surviving crashes. After every turn the rollout's state (tokens, mask, logprobs, versions, the
chat messages, the calls, its lease and workspace snapshot) is saved to the state store, then the work queue is
told the request is still in progress; a keepalive (``MessageContext.keep_alive_while``) repeats
that every third of the ack wait while a long tool call runs. A worker that dies stops both: the request is redelivered after the ack wait,
and whoever takes it resumes from the last saved turn. The outcome is saved before it is
published, so a request redelivered after its rollout ended (a worker that died between publishing
and acking) re-publishes that outcome and runs nothing again.

Infrastructure failures (sandbox died or lost, broker unreachable, inference error or a generation
not back within ``generate_timeout_s``, a reward that cannot be computed) are retried from the last saved turn up to ``infra_retries`` times; then the
rollout ends as a typed ``RolloutFailed``, never a silent zero reward.

Sandbox: one lease per rollout, its idempotency token the rollout id (a resumed rollout gets the
sandbox its earlier attempt had, while that lease lives; if it is gone and snapshots are on, a
fork of the last snapshot). While the rollout runs, a heartbeat keeps the lease alive however long
it takes; a worker that dies stops heartbeating and the broker reaps the sandbox within a TTL. A
tool's own failure (non-zero exit, timeout, oom, signal, output cut) is a tool result the model
sees.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time
from collections.abc import Callable

import msgspec
import structlog
from opentelemetry import trace

from rollmesh.ports import (
    MessageContext,
    Publisher,
    RolloutStateStore,
    RoutedExpertsStore,
    StateStoreError,
    Subscription,
    TrajectoryStore,
)
from rollmesh.chat import ChatError, ChatModel
from rollmesh.chat.token_check import special_token_ids
from rollmesh.config import ModelConfig, RolloutConfig
from rollmesh.engine.served_model import describe_served_model
from rollmesh.engine.protocols import InferenceEngine
from rollmesh.messages import (
    INFRA_FAILURE_KINDS,
    RolloutCompleted,
    RolloutFailed,
    RolloutRequested,
    RolloutState,
)
from rollmesh.messages.subjects import (
    ROLLOUT_COMPLETED,
    ROLLOUT_FAILED,
    ROLLOUT_REQUESTED,
)
from rollmesh.rewards.errors import RewardInputError, RewardUnavailableError
from rollmesh.rewards.reward_input import RewardInput, RewardScore, score_of
from rollmesh.rollout.errors import RolloutError
from rollmesh.rollout.rollout_sandbox import RolloutSandbox
from rollmesh.rollout.saved_state import InMemoryRolloutStates
from rollmesh.rollout.rollout_turns import RolloutRun, RolloutTurns, trace_id_of
from rollmesh.rollout.decode_loan_follower import RolloutDecodeLoanFollower
from rollmesh.rollout.environments import EnvironmentRollout
from rollmesh.rollout.tasks import Task, TaskInputError, TaskRegistry, UnknownTaskError, is_environment
from rollmesh.rollout.tool_runner import ToolRunner
from rollmesh.rollout.trajectory import RolloutTrajectory
from rollmesh.rollout.trajectory_offload import COMPLETED_OBJECT, OffloadingRolloutStates, place_traces
from rollmesh.sandbox.broker_client import SandboxBrokerClient
from rollmesh.moved_names import forward_moved_names
from rollmesh.telemetry import conventions, metrics, metrics_catalog

_log = structlog.get_logger("rollmesh.rollout")
_tracer = trace.get_tracer("rollmesh.rollout")
MAX_RETRY_DELAY_S = 30.0


def infra_retry_delay_s(failures: int, base_s: float, draw: float) -> float:
    """The pause before a rollout's retry after its ``failures``-th infrastructure failure:
    doubling from ``base_s`` up to ``MAX_RETRY_DELAY_S``, less a random part of up to half
    (``draw`` in [0, 1)), so rollouts that one overload failed together do not all come back in
    the same instant and queue up at once again."""
    return min(MAX_RETRY_DELAY_S, base_s * 2 ** (failures - 1)) * (0.5 + 0.5 * draw)

# Deprecated: renamed for its role (and took in what the actors' RolloutWorkerLogic added).
__getattr__ = forward_moved_names(__name__, {"RolloutRunner": "rollmesh.rollout.agent_loop:RolloutWorkerLogic"})


class RolloutWorkerLogic:
    """The rollout worker role's logic; the shell feeds it ``RolloutRequested`` messages, and the
    loan events when ``decode_loans`` follows elastic decode for its router."""

    def __init__(
        self,
        config: RolloutConfig,
        model_config: ModelConfig,
        *,
        chat: ChatModel,
        tasks: TaskRegistry,
        engine: InferenceEngine,
        publisher: Publisher,
        worker: str = "rollout-worker",
        clock: Callable[[], float] = time.time,
        sandbox: SandboxBrokerClient | None = None,
        states: RolloutStateStore | None = None,
        routed_experts: RoutedExpertsStore | None = None,
        trajectories: TrajectoryStore | None = None,
        max_seq_len: int | None = None,
        decode_loans: RolloutDecodeLoanFollower | None = None,
        draw: Callable[[], float] = random.random,
    ) -> None:
        """``draw``: uniform in [0, 1), for the jitter of infrastructure retries' pauses."""
        self.config = config
        self._draw = draw
        # The model's context (config.json's max_position_embeddings) unless a test names a shorter one.
        self.max_seq_len = max_seq_len or describe_served_model(model_config).max_seq_len
        # The model's tokenizer, chat template and tool-call format: built once per worker.
        self.chat = chat
        self.special_ids = special_token_ids(chat.directory.tokenizer)
        self.tasks = tasks
        # The import-path rewards a request may name (the dataset task's): the config's, no others.
        tasks.allow_reward_functions(config.reward_functions)
        self.publisher = publisher
        self.broker_client = sandbox or SandboxBrokerClient(publisher)
        self.rollout_sandbox = RolloutSandbox(self.broker_client, config)
        self.states: RolloutStateStore = states if states is not None else InMemoryRolloutStates()
        # Where a trace too large to travel inline (rollout.inline_trajectory_bytes) is stored,
        # for the completed message and the saved state alike; None: always inline.
        self.trajectories = trajectories
        if trajectories is not None:
            self.states = OffloadingRolloutStates(self.states, trajectories,
                                                  inline_bytes=config.inline_trajectory_bytes)
        self.worker = worker
        self.clock = clock
        # MoE models (routed_experts set): every turn's routed-expert rows are kept for routing replay.
        self.turns = RolloutTurns(config, chat=chat, engine=engine, tools=ToolRunner(self.broker_client, config),
                                  leases=self.rollout_sandbox, publisher=publisher, clock=clock,
                                  max_seq_len=self.max_seq_len, routed_experts=routed_experts)
        self.counts = {"completed": 0, "failed": 0, "resumed": 0, "republished": 0, "infra_retries": 0,
                       "joined": 0}
        self._running: dict[str, asyncio.Future[None]] = {}
        self.decode_loans = decode_loans
        metrics.observe(metrics_catalog.ROLLOUTS_IN_FLIGHT, self,
                        lambda runner: [(len(runner._running), {"worker": runner.worker})])

    def subscriptions(self) -> list[Subscription]:
        requested = Subscription(ROLLOUT_REQUESTED, self.handle_requested, "jetstream",
                                 max_concurrent=self.config.max_concurrent)
        loans = self.decode_loans.subscriptions() if self.decode_loans is not None else []
        return [requested, *loans]

    async def start(self) -> None:
        if self.decode_loans is not None:
            await self.decode_loans.start()

    def stats(self) -> dict[str, int]:
        if self.decode_loans is None:
            return dict(self.counts)
        return {**self.counts, "lent_decode_workers": len(self.decode_loans.router.lent_decode_workers())}

    async def handle_requested(self, request: RolloutRequested, ctx: MessageContext) -> None:
        """Run (or resume) the rollout; returns only after its outcome is durably published (then
        the shell acks)."""
        running = self._running.get(request.rollout_id)
        if running is not None:
            # Redelivered while it still runs here (the server lost its in-progress acks, e.g. in
            # a NATS restart): the running one publishes the outcome; this delivery waits for it.
            self.counts["joined"] += 1
            await ctx.keep_alive_while(running)  # raises if it failed: this delivery comes back
            return
        done = asyncio.get_running_loop().create_future()
        self._running[request.rollout_id] = done
        try:
            await self._handle(request, ctx)
        except BaseException as exc:
            done.set_exception(RuntimeError(f"rollout {request.rollout_id} did not finish: {exc!r}"))
            done.exception()  # read here: with no delivery waiting on it, it is nobody's error
            raise
        else:
            done.set_result(None)
        finally:
            self._running.pop(request.rollout_id, None)

    async def _handle(self, request: RolloutRequested, ctx: MessageContext) -> None:
        saved = await self._load(request)
        if saved is not None and saved.outcome is not None:
            # It ended, but the request was never acked: publish the same outcome again (dedup
            # ids and the trainer's idempotency keys make the repeat harmless), redo nothing.
            self.counts["republished"] += 1
            await self._publish(saved.outcome)
            return
        now = self.clock()
        state = saved or RolloutState(rollout_id=request.rollout_id, request=request, started_at=now)
        if saved is not None:
            self.counts["resumed"] += 1
            _log.info("rollout_resumed", rollout_id=request.rollout_id, turn=saved.turn,
                      attempt=saved.attempts + 1)
        state = msgspec.structs.replace(state, attempts=state.attempts + 1, updated_at=now)
        # Saved at once: a worker that takes this request over sees it was started before.
        await self._save(state)
        with _tracer.start_as_current_span(
            conventions.SPAN_ROLLOUT,
            attributes={"rollout_id": request.rollout_id, "task": request.task,
                        "purpose": request.purpose, "rollout.attempt": state.attempts,
                        "rollout.resumed_turn": state.turn,
                        conventions.RL_ROLLOUT_ID: request.rollout_id,
                        # The trajectory a rollout produces is known by the rollout's id.
                        conventions.RL_TRAJECTORY_ID: request.rollout_id,
                        conventions.RL_TASK: request.task},
        ) as rollout_span:
            run = RolloutRun(request, state, rollout_span, ctx)
            # Kept in progress between turns too: a tool may run for an hour.
            outcome = await ctx.keep_alive_while(self._run_with_retries(run))
            # The outcome names this attempt's trace, so a dashboard can link the rollout to it.
            outcome = msgspec.structs.replace(outcome, trace_id=trace_id_of(rollout_span))
            if isinstance(outcome, RolloutCompleted):
                rollout_span.set_attribute("rollout.reward", outcome.reward)
            else:
                rollout_span.set_attribute("rollout.failure", outcome.kind)
                _log.warning("rollout_failed", rollout_id=request.rollout_id, kind=outcome.kind,
                             reason=outcome.reason, infra_failures=outcome.infra_failures)
        # Saved before it is published: a redelivery finds it and does not run the rollout again.
        await self._save(msgspec.structs.replace(run.state, outcome=outcome, updated_at=self.clock()))
        await self._publish(outcome)

    async def _publish(self, outcome: RolloutCompleted | RolloutFailed) -> None:
        if isinstance(outcome, RolloutCompleted):
            await self.publisher.publish(ROLLOUT_COMPLETED, outcome)
            self.counts["completed"] += 1
            metrics.add(metrics_catalog.ROLLOUTS_COMPLETED, 1)
        else:
            await self.publisher.publish(ROLLOUT_FAILED, outcome)
            self.counts["failed"] += 1
            metrics.add(metrics_catalog.ROLLOUTS_FAILED, 1, {"kind": outcome.kind})

    async def _run_with_retries(self, run: RolloutRun) -> RolloutCompleted | RolloutFailed:
        request = run.request
        while True:
            try:
                return await self._attempt(run)
            except RolloutError as exc:
                infra = exc.kind in INFRA_FAILURE_KINDS
                if infra:
                    run.state = msgspec.structs.replace(run.state, infra_failures=run.state.infra_failures + 1)
                    await self._save(run.state)
                if not infra or run.state.infra_failures > self.config.infra_retries:
                    return RolloutFailed(
                        rollout_id=request.rollout_id, kind=exc.kind, reason=str(exc),
                        group_id=request.group_id, purpose=request.purpose,
                        turns=max(exc.turns, run.state.turn), idempotency_key=request.rollout_id,
                        attempts=run.state.attempts, infra_failures=run.state.infra_failures,
                    )
                self.counts["infra_retries"] += 1
                _log.warning("rollout_infra_retry", rollout_id=request.rollout_id, kind=exc.kind,
                             reason=str(exc), failures=run.state.infra_failures,
                             resume_turn=run.state.turn)
                # Backing off (doubling, jittered) gives a restarted actor or NATS time to come
                # back, and an overloaded sandbox broker requests spread out rather than in bursts.
                await asyncio.sleep(infra_retry_delay_s(run.state.infra_failures, self.config.infra_retry_delay_s,
                                                        self._draw()))

    async def _attempt(self, run: RolloutRun) -> RolloutCompleted:
        request = run.request
        task = self._task(request)
        if is_environment(task):  # a fresh instance per rollout, where its saved turns left it
            task = await asyncio.to_thread(self._environment, task, run)
        tools = self._tools(task)
        if run.state.messages:  # resumed (after a crash or an infrastructure failure)
            try:
                trajectory = RolloutTrajectory.resume(self.chat, run.state.messages, run.state.token_traces(),
                                                      tools=tools, history_rewrite=self.config.history_rewrite,
                                                      message_counts=run.state.sample_message_counts)
            except (ChatError, ValueError) as exc:
                raise RolloutError("invalid_request", f"the chat template refuses the saved conversation: {exc}",
                                   turns=run.state.turn) from exc
        else:  # a new rollout (or one saved before chat messages: it starts over)
            run.state, trajectory = self._started(run.state, task, tools)
        if tools:
            saved = run.state
            lease_id = await self.rollout_sandbox.lease(request.rollout_id, held=saved.lease_id,
                                               snapshot_id=saved.snapshot_id, turn=saved.turn)
            run.state = msgspec.structs.replace(run.state, lease_id=lease_id)
            try:
                conversation = await self.rollout_sandbox.while_leased(
                    lease_id, request.rollout_id, self.turns.run(run, task, tools, trajectory, lease_id, self._save))
            finally:
                await self.rollout_sandbox.release(lease_id, request.rollout_id)
        else:
            # A task without tools runs nothing in a sandbox (a call the model writes anyway is
            # malformed and answered without running): no lease, no heartbeats, no snapshots.
            conversation = await self.turns.run(run, task, tools, trajectory, "", self._save)
        mismatches = self._check_tokens(run, trajectory)
        score = await self._reward(task, request, conversation, turns=run.state.turn)
        # The tokens past the model's context can only be a tool result the model never read.
        # history_rewrite = "split": one trace per training sample, each trained with the reward.
        # A sample split off after the last turn (its tool results, when the rollout then ended)
        # holds nothing generated: it would only cost the trainer a forward pass, so it stays out.
        traces = trajectory.traces(max_len=self.max_seq_len)
        if len(traces) > 1 and not any(traces[-1].loss_mask):
            traces = traces[:-1]
        # A long trace goes to the object store here, before the message naming it is published.
        try:
            carried = await place_traces(request.rollout_id, COMPLETED_OBJECT, traces,
                                         inline_bytes=self.config.inline_trajectory_bytes, store=self.trajectories)
        except StateStoreError as exc:
            raise RolloutError("internal_error", f"trajectory not stored: {exc}", turns=run.state.turn) from exc
        return RolloutCompleted(
            rollout_id=request.rollout_id, task=request.task, group_id=request.group_id,
            purpose=request.purpose, reward=score.total, turns=run.state.turn,
            tool_calls=len(conversation.tool_calls), prompt_len=run.state.prompt_len,
            # The text of a stored trace is left out too (it is as long): decode its ids. Split
            # samples: the last one's, the conversation as the template last rendered it.
            text=self.chat.decode(traces[-1].ids) if carried["trajectory"] is not None else "",
            duration_s=self.clock() - run.state.started_at, idempotency_key=request.rollout_id,
            routed_experts_ref=run.state.routed_experts_ref,
            attempts=run.state.attempts, infra_failures=run.state.infra_failures,
            num_tokens=sum(len(trace) for trace in traces), weight_version=traces[-1].last_version(),
            finish_reason=conversation.finish_reason, tokenization_mismatches=mismatches,
            malformed_tool_calls=conversation.malformed_tool_calls, reward_components=score.components,
            final_text=conversation.final_text, temperature=request.sampling.temperature,
            **carried,  # type: ignore[arg-type]
        )

    async def _reward(self, task: Task, request: RolloutRequested, conversation: RewardInput, *,
                      turns: int) -> RewardScore:
        """The task's reward of the finished conversation, run in a thread: a reward may block
        (a math check in its worker process, a reward server) and the worker's other rollouts
        must not wait on it. A row the reward cannot score is ``invalid_request``; a reward that
        cannot be computed (its worker died, it raised, it returned no number) is ``reward_error``
        (retried: the retry resumes after the last turn and only scores again), never a zero."""
        answer = request.task_input.get("answer")
        sample = dataclasses.replace(conversation, row=request.task_input,
                                     answer=answer if isinstance(answer, str) else None)
        try:
            value = await asyncio.to_thread(task.reward, sample)
        except (RewardInputError, TaskInputError) as exc:
            raise RolloutError("invalid_request", str(exc), turns=turns) from exc
        except RewardUnavailableError as exc:
            raise RolloutError("reward_error", str(exc), turns=turns) from exc
        except Exception as exc:  # the task's own reward failed: not the model's fault
            raise RolloutError("reward_error", f"task {task.name!r}: its reward raised {exc!r}", turns=turns) from exc
        try:
            return score_of(value)
        except ValueError as exc:
            raise RolloutError("reward_error", f"task {task.name!r}: {exc}", turns=turns) from exc

    def _tools(self, task: Task) -> list[dict]:
        tools = task.tools()
        try:
            self.chat.toolset(tools)  # checked and compiled once per declaration, not per rollout
        except ChatError as exc:
            raise RolloutError("invalid_request", f"task {task.name!r} declares its tools wrongly: {exc}") from exc
        return tools

    def _started(self, state: RolloutState, task: Task, tools: list[dict]) -> tuple[RolloutState, RolloutTrajectory]:
        """A rollout about to run its first turn: its first prompt rendered and tokenized once."""
        request = state.request
        try:
            messages = task.messages(request.task_input)
        except TaskInputError as exc:
            raise RolloutError("invalid_request", str(exc)) from exc
        try:
            trajectory = RolloutTrajectory.start(self.chat, messages, tools=tools,
                                                 history_rewrite=self.config.history_rewrite)
        except ChatError as exc:  # the template refuses the conversation (or cannot be joined)
            raise RolloutError("invalid_request", f"the chat template refuses the conversation: {exc}") from exc
        if len(trajectory) >= self.max_seq_len:
            raise RolloutError("invalid_request", f"prompt of {len(trajectory)} tokens does not fit "
                               f"the model's context of {self.max_seq_len}")
        state = msgspec.structs.replace(state, trajectory=trajectory.trace(), trajectory_ref="",
                                        split_samples=[], split_sample_refs=[], sample_message_counts=[],
                                        prompt_len=len(trajectory), messages=trajectory.messages, turn=0,
                                        tool_calls=[], final_text="", finish_reason="", malformed_tool_calls=0)
        return state, trajectory

    def _check_tokens(self, run: RolloutRun, trajectory: RolloutTrajectory) -> dict[str, int]:
        """The trajectory against a whole render of its conversation: differences by kind, counted;
        a bug-class one fails the rollout when ``rollout.strict_tokenization`` is on."""
        try:
            counts, bugs = trajectory.check_tokens(self.special_ids)
        except ChatError as exc:  # the template will not render the finished conversation whole
            _log.warning("tokenization_unchecked", rollout_id=run.request.rollout_id, error=str(exc))
            if self.config.strict_tokenization:
                raise RolloutError("tokenization_error", f"the conversation could not be rendered whole to "
                                   f"check its tokens: {exc}", turns=run.state.turn) from exc
            return {}
        for kind, count in counts.items():
            if count:
                metrics.add(metrics_catalog.TOKENIZATION_MISMATCHES, count, {"kind": kind})
        if bugs:
            _log.warning("tokenization_mismatch", rollout_id=run.request.rollout_id, bugs=bugs, counts=counts)
            if self.config.strict_tokenization:
                raise RolloutError("tokenization_error",
                                   f"{len(bugs)} difference(s) from a whole render in text the model did not "
                                   f"generate: {'; '.join(bugs)[:500]}", turns=run.state.turn)
        return counts

    # -- state and the work queue -----------------------------------------------------------

    async def _load(self, request: RolloutRequested) -> RolloutState | None:
        try:
            saved = await self.states.load(request.rollout_id)
        except StateStoreError as exc:
            _log.warning("rollout_state_unreadable", rollout_id=request.rollout_id, error=str(exc))
            return None
        if saved is not None and saved.request != request:
            # The same id for a different request: the new request wins; its old state is void.
            _log.warning("rollout_state_mismatch", rollout_id=request.rollout_id)
            return None
        return saved

    async def _save(self, state: RolloutState) -> None:
        try:
            await self.states.save(state)
        except StateStoreError as exc:  # the rollout still runs; only resuming it would be lost
            _log.warning("rollout_state_not_saved", rollout_id=state.rollout_id, error=str(exc))

    def _environment(self, registered: Task, run: RolloutRun) -> EnvironmentRollout:
        try:
            environment = EnvironmentRollout.fresh(registered, run.request.task_input)  # type: ignore[arg-type]
            if run.state.messages:
                environment.replay(run.state.messages)
        except TaskInputError as exc:
            raise RolloutError("invalid_request", str(exc)) from exc
        except Exception as exc:  # the environment's own code failed: not the policy's doing
            raise RolloutError("internal_error", f"environment {registered.name!r}: {exc!r}",
                               turns=run.state.turn) from exc
        return environment

    def _task(self, request: RolloutRequested) -> Task:
        try:
            return self.tasks.get(request.task)
        except UnknownTaskError as exc:
            raise RolloutError("unknown_task", str(exc)) from exc
