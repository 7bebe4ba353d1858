"""Chat sessions as plain logic: the history-extension check, the store's leases and bounds, and
whole sessions on the demo model with scripted turns (``generate`` returns what the model would
write, encoded once as if sampled), streamed turns included (kept as sampled once finished; left
early, failed or deleted meanwhile: not kept). No Ray, no HTTP: test_serve_sessions.py drives a
deployed app with the official ``openai`` client.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncGenerator
from pathlib import Path

import pytest

from rollmesh.chat import ChatModel, TokenSample, ToolCall, check_trajectory
from rollmesh.chat.token_check import special_token_ids
from rollmesh.engine.protocols import GenerateOptions, GenerationResult
from rollmesh.engine.token_stream import TokenDelta
from rollmesh.messages.token_trace import NO_VERSION, TokenTrace
from rollmesh.serve_apps import InvalidApiRequestError, ServedModel
from rollmesh.serve_apps.chat_requests import ChatPrompt, chat_response
from rollmesh.serve_apps.chat_sessions import ChatSessions
from rollmesh.serve_apps.errors import EngineUnavailableError, SessionConflictError, SessionNotFoundError
from rollmesh.serve_apps.http_shapes import ChatCompletionRequest, ChatMessage
from rollmesh.serve_apps.session_history import SessionHistoryError, new_messages
from rollmesh.serve_apps.session_store import LocalSessionStore, SessionStore
from rollmesh.serve_apps.stream_events import chat_events
from rollmesh.serve_apps.chat_messages import template_messages
from support.serve_models import CALC, QUESTION, demo_served_model

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

VERSION = 3


@pytest.fixture(scope="module")
def served(demo_model_dir: Path) -> ServedModel:
    return demo_served_model(demo_model_dir)


def messages(*dicts: dict) -> list[ChatMessage]:
    return [ChatMessage.model_validate(d) for d in dicts]


# -- the history check --------------------------------------------------------------------------

HELD = [QUESTION, {"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_0", "type": "function", "function": {"name": "calc", "arguments": '{"formula": "H2O"}'}}],
    "reasoning_content": "ask calc"}]
RESULT = {"role": "tool", "tool_call_id": "call_0", "content": "18.015"}


def test_an_echoed_history_extends_the_session_whatever_form_the_client_gives_it() -> None:
    # The client's echo: content "" for null, arguments as an object with other spacing, no reasoning.
    echoed = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_0", "function": {"name": "calc", "arguments": {"formula": "H2O"}}}]}
    assert [m.role for m in new_messages(HELD, messages(QUESTION, echoed, RESULT))] == ["tool"]
    assert new_messages(HELD, messages(*HELD, RESULT))[0].tool_call_id == "call_0"


@pytest.mark.parametrize(("sent", "index", "what"), [
    ([QUESTION, RESULT], 1, "content, role, tool_call_id, tool_calls"),                     # the answer dropped
    ([{"role": "user", "content": "molar mass of NaCl?"}, HELD[1], RESULT], 0, "content"),  # edited
    ([QUESTION, {**HELD[1], "tool_calls": [{"id": "call_0", "function": {
        "name": "calc", "arguments": '{"formula": "NaCl"}'}}]}, RESULT], 1, "tool_calls"),
    ([QUESTION, {**HELD[1], "reasoning_content": "other"}, RESULT], 1, "reasoning_content"),
    ([*HELD], 1, "new one"),                                                    # nothing new
    ([QUESTION], 0, "new one"),                                                 # truncated history
    ([*HELD, {"role": "assistant", "content": "18"}], 2, "assistant message among the new"),
])
def test_a_history_that_does_not_extend_the_session_is_refused_at_its_first_difference(
    sent: list[dict], index: int, what: str,
) -> None:
    with pytest.raises(SessionHistoryError) as raised:
        new_messages(HELD, messages(*sent))
    assert raised.value.index == index
    assert what in raised.value.reason


# -- the store --------------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def record_for(session_id: str):
    from rollmesh.serve_apps.session_store import PendingTurn, SessionRecord

    return SessionRecord(session_id=session_id, settings="{}", render_tools=None, template_kwargs={},
                         messages=[], template_messages=[], trace=TokenTrace(), constrained=[],
                         pending=PendingTurn([], [], [], {}, []),
                         prompt_len=0, turns=1)


def test_the_store_leases_a_session_to_one_turn_at_a_time() -> None:
    store = SessionStore(ttl_s=60, max_sessions=4, clock=Clock())
    first = store.begin("s")
    assert first.status == "new" and first.record is None
    assert store.begin("s").status == "busy"
    assert store.commit("s", first.lease_id, record_for("s"))
    second = store.begin("s")
    assert second.status == "existing" and second.record.turns == 1
    assert not store.commit("s", "someone else's lease", record_for("s"))
    store.release("s", second.lease_id)  # a failed turn: unchanged, free again
    assert store.begin("s").status == "existing"
    failed_new = store.begin("t")
    store.release("t", failed_new.lease_id)  # a new session whose first turn failed is not kept
    assert store.get("t") is None


def test_sessions_expire_after_the_ttl_and_the_oldest_idle_one_makes_room() -> None:
    clock = Clock()
    store = SessionStore(ttl_s=60, max_sessions=2, clock=clock)
    for name in ("a", "b"):
        store.commit(name, store.begin(name).lease_id, record_for(name))
    clock.now += 30
    busy = store.begin("a")  # touched (and now in flight): b is the oldest idle one
    assert store.begin("c").status == "new"
    assert store.get("b") is None and store.stats().evicted == 1
    assert store.begin("d").status == "full"  # a and c are in flight: none can go
    clock.now += 61
    assert store.get("a") is None and store.get("c") is None  # a lease older than the TTL is dropped
    assert not store.commit("a", busy.lease_id, record_for("a"))
    assert store.stats().expired == 2
    store.commit("e", store.begin("e").lease_id, record_for("e"))
    assert store.delete("e") and not store.delete("e")


# -- whole sessions, scripted turns -------------------------------------------------------------


class ScriptedEngine:
    """Returns the given turns, encoded once as if sampled, and records each prompt and option."""

    def __init__(self, served: ServedModel, turns: list[str]) -> None:
        self.served = served
        self.turns = list(turns)
        self.prompts: list[list[int]] = []
        self.options: list[GenerateOptions] = []
        self.generated: list[list[int]] = []
        self.gate: asyncio.Event | None = None
        self.constrained_turns: set[int] = set()  # turns sampled under a grammar, every token
        self.fail_at: int | None = None
        self.streamed, self.closed = 0, False

    async def __call__(self, prompt: ChatPrompt, options: GenerateOptions) -> GenerationResult:
        self.prompts.append(list(prompt.input_ids))
        self.options.append(options)
        if self.gate is not None:
            await self.gate.wait()
        ids = self.served.chat.encode(self.turns.pop(0))
        ids = ids[:prompt.sampling.max_new_tokens]
        self.generated.append(ids)
        eot = bool(ids) and ids[-1] in self.served.chat.end_of_turn_ids
        constrained = [True] * len(ids) if len(self.generated) - 1 in self.constrained_turns else []
        return GenerationResult(ids, [-0.25] * len(ids), [VERSION] * len(ids), "eos" if eot else "length",
                                len(prompt.input_ids), constrained=constrained)

    async def stream(self, prompt: ChatPrompt, options: GenerateOptions,
                     ) -> AsyncGenerator[TokenDelta | GenerationResult, None]:
        """The next turn as the engine streams it: one token per piece, then the result; it fails
        with a worker error before token ``fail_at`` when set. ``streamed`` counts the pieces
        given, ``closed`` says whether the pieces were closed (what aborts a request)."""
        result = await self(prompt, options)
        self.streamed, self.closed = 0, False

        async def pieces() -> AsyncGenerator[TokenDelta | GenerationResult, None]:
            try:
                for at, token in enumerate(result.token_ids):
                    if at == self.fail_at:
                        raise EngineUnavailableError("a worker died", code="worker_unavailable")
                    self.streamed += 1
                    yield TokenDelta("r", at, [token], [result.logprobs[at]], [result.versions[at]])
                yield result
            finally:
                self.closed = True
        return pieces()


def request(*history: dict, session_id: str = "s1", **fields: object) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"messages": list(history), "session_id": session_id, "tools": [CALC], "temperature": 0.0, **fields})


def call_turn(served: ServedModel, formula: str) -> str:
    return served.chat.write_turn(content="", calls=[ToolCall("x", "calc", {"formula": formula})])


async def client_turn(sessions: ChatSessions, engine: ScriptedEngine, history: list[dict],
                      **fields: object) -> dict:
    """What a harness does: send the conversation, append the answer as the client holds it."""
    prompt, result = await sessions.turn(request(*history, **fields), engine)
    answer = chat_response(result, prompt, request_id="c", created=1, served=sessions.served)
    message = answer.choices[0].message.model_dump(exclude_none=True)
    history.append({"content": None, **message})
    return message


async def test_a_three_turn_tool_session_keeps_every_sampled_id_and_matches_a_whole_render(
    served: ServedModel,
) -> None:
    sessions = ChatSessions(served, LocalSessionStore(SessionStore(ttl_s=60, max_sessions=8)))
    engine = ScriptedEngine(served, [call_turn(served, "H2O"), call_turn(served, "NaCl"),
                                     "18.015 and 58.44" + served.chat.end_of_turn_text])
    history = [{"role": "system", "content": "use calc"}, QUESTION]
    first = await client_turn(sessions, engine, history)
    assert first["tool_calls"][0]["id"] == "call_0"
    history.append({"role": "tool", "tool_call_id": "call_0", "content": "18.015"})
    second = await client_turn(sessions, engine, history)
    assert second["tool_calls"][0]["id"] == "call_1"
    history += [{"role": "tool", "tool_call_id": "call_1", "content": "58.44"},
                {"role": "user", "content": "both?"}]
    assert (await client_turn(sessions, engine, history))["content"] == "18.015 and 58.44"

    # Each prompt is the last one, the turn as sampled, and only the new messages' tokens.
    for before, generated, after in zip(engine.prompts, engine.generated, engine.prompts[1:]):
        assert after[:len(before) + len(generated)] == before + generated
    assert all(options.session_id == "s1" for options in engine.options)  # the engine's KV is reused
    first_prompt = served.chat.encode(served.chat.render(history[:2], tools=[CALC], add_generation_prompt=True))
    assert engine.prompts[0] == first_prompt

    body = await sessions.trajectory("s1")
    trace = TokenTrace(**body.token_trace.model_dump())
    assert trace.ids == engine.prompts[-1] + engine.generated[-1]
    generated_at = [p for p, mask in enumerate(trace.loss_mask) if mask]
    spans: list[int] = []
    for prompt, ids in zip(engine.prompts, engine.generated):
        spans += range(len(prompt), len(prompt) + len(ids))
    assert generated_at == spans
    assert [trace.ids[p] for p in generated_at] == [i for ids in engine.generated for i in ids]
    assert all(trace.versions[p] == VERSION and trace.logprobs[p] == -0.25 for p in generated_at)
    assert all(trace.versions[p] == NO_VERSION for p in range(len(trace)) if not trace.loss_mask[p])
    assert (body.turns, body.prompt_len, body.finish_reason) == (3, len(first_prompt), "stop")
    assert body.tokenization_bugs == [] and body.tokenization_mismatches["non_assistant"] == 0
    assert [m["role"] for m in body.messages] == [m["role"] for m in history]

    # The same tokens, checked by rollmesh.chat itself against a whole render, as a client would.
    assert bug_class_differences(served, body.messages, trace) == 0


def bug_class_differences(served: ServedModel, openai_messages: list[dict], trace: TokenTrace) -> int:
    """``check_trajectory``'s bug count for ``trace`` as the tokens of ``openai_messages``."""
    conversation = template_messages([ChatMessage.model_validate(m) for m in openai_messages], served.chat)
    opening = next(i for i, m in enumerate(conversation) if m["role"] == "assistant")
    trajectory = served.chat.new_trajectory(conversation[:opening], tools=[CALC])
    trajectory.messages = conversation
    trajectory.samples = [TokenSample(list(trace.ids), list(trace.loss_mask),
                                      [p if m else None for p, m in zip(trace.logprobs, trace.loss_mask)],
                                      len(conversation))]
    (report,) = check_trajectory(trajectory, special_token_ids(served.chat.directory.tokenizer))
    return report.bugs


async def test_a_diverging_history_unknown_session_and_truncated_turn_are_refused(served: ServedModel) -> None:
    sessions = ChatSessions(served, LocalSessionStore(SessionStore(ttl_s=60, max_sessions=8)))
    engine = ScriptedEngine(served, [call_turn(served, "H2O"), "a long answer" + served.chat.end_of_turn_text])
    history = [QUESTION]
    await client_turn(sessions, engine, history)
    edited = [{"role": "user", "content": "something else"}, history[1],
              {"role": "tool", "tool_call_id": "call_0", "content": "18.015"}]
    with pytest.raises(InvalidApiRequestError) as raised:
        await sessions.turn(request(*edited), engine)
    assert (raised.value.code, raised.value.param) == ("session_history_mismatch", "messages.0")
    with pytest.raises(InvalidApiRequestError) as raised:
        await sessions.turn(request(*history, {"role": "tool", "tool_call_id": "call_0", "content": "1"},
                                    tools=None), engine)
    assert raised.value.code == "session_settings_mismatch"
    assert len(engine.prompts) == 1  # refused before the engine

    history.append({"role": "tool", "tool_call_id": "call_0", "content": "18.015"})
    await client_turn(sessions, engine, history, max_tokens=2)  # cut: no end of turn
    assert (await sessions.trajectory("s1")).finish_reason == "truncated"
    history.append({"role": "user", "content": "go on"})
    with pytest.raises(InvalidApiRequestError) as raised:
        await sessions.turn(request(*history), engine)
    assert raised.value.code == "session_truncated"

    with pytest.raises(SessionNotFoundError):
        await sessions.trajectory("nobody")
    assert (await sessions.delete("s1")).deleted
    with pytest.raises(SessionNotFoundError):
        await sessions.delete("s1")


async def test_a_second_request_while_a_turn_is_in_flight_gets_409_and_the_session_survives(
    served: ServedModel,
) -> None:
    sessions = ChatSessions(served, LocalSessionStore(SessionStore(ttl_s=60, max_sessions=8)))
    engine = ScriptedEngine(served, [call_turn(served, "H2O"), call_turn(served, "NaCl")])
    engine.gate = asyncio.Event()
    first = asyncio.create_task(sessions.turn(request(QUESTION), engine))
    while not engine.prompts:
        await asyncio.sleep(0)
    with pytest.raises(SessionConflictError) as raised:
        await sessions.turn(request(QUESTION), engine)
    assert raised.value.status == 409
    engine.gate.set()
    await first
    assert (await sessions.trajectory("s1")).turns == 1


async def test_two_replicas_on_one_store_continue_each_others_session(served: ServedModel) -> None:
    store = LocalSessionStore(SessionStore(ttl_s=60, max_sessions=8))
    engine = ScriptedEngine(served, [call_turn(served, "H2O"), "18.015" + served.chat.end_of_turn_text])
    history = [QUESTION]
    await client_turn(ChatSessions(served, store), engine, history)
    history.append({"role": "tool", "tool_call_id": "call_0", "content": "18.015"})
    await client_turn(ChatSessions(served, store), engine, history)
    body = await ChatSessions(served, store).trajectory("s1")
    assert body.turns == 2 and body.tokenization_bugs == []
    assert json.loads(json.dumps(body.model_dump()))["token_trace"]["ids"][-1] in served.chat.end_of_turn_ids


async def test_tokens_sampled_under_a_grammar_train_with_loss_mask_zero_across_turns(served: ServedModel) -> None:
    sessions = ChatSessions(served, LocalSessionStore(SessionStore(ttl_s=60, max_sessions=8)))
    engine = ScriptedEngine(served, [call_turn(served, "H2O"), "18.015" + served.chat.end_of_turn_text])
    engine.constrained_turns = {0}
    history = [QUESTION]
    await client_turn(sessions, engine, history)
    history.append({"role": "tool", "tool_call_id": "call_0", "content": "18.015"})
    await client_turn(sessions, engine, history)
    body = await sessions.trajectory("s1")
    trace = body.token_trace
    first = range(len(engine.prompts[0]), len(engine.prompts[0]) + len(engine.generated[0]))
    second = range(len(engine.prompts[1]), len(trace.ids))
    assert [p for p, mask in enumerate(trace.loss_mask) if mask] == list(second)
    # Still the engine's tokens, logprobs and versions; and still the model's text to the check.
    assert all(trace.versions[p] == VERSION and trace.logprobs[p] == -0.25 for p in first)
    assert body.tokenization_bugs == [] and body.tokenization_mismatches["non_assistant"] == 0


async def test_a_qwen3_session_keeps_the_reasoning_the_client_dropped_and_checks_clean(
    chat_model_dirs: dict[str, Path],
) -> None:
    """Qwen3's template drops earlier reasoning once a new user query comes: the session keeps the
    reasoning as sampled (keep_sampled), which the token check calls a documented rewrite."""
    chat = ChatModel.load(chat_model_dirs["qwen3"])
    served = ServedModel(name="qwen3", max_seq_len=4096, vocab_size=chat.vocab_size, chat=chat)
    sessions = ChatSessions(served, LocalSessionStore(SessionStore(ttl_s=60, max_sessions=8)))
    turns = [chat.write_turn(content="", calls=[ToolCall("x", "calc", {"formula": "H2O"})], reasoning="ask calc"),
             chat.write_turn(content="18.015", reasoning="calc said so"),
             chat.write_turn(content="58.44", reasoning="NaCl now")]
    engine = ScriptedEngine(served, turns)
    history = [QUESTION]
    first = await client_turn(sessions, engine, history)
    assert first["reasoning_content"] == "ask calc"
    history[-1] = {key: value for key, value in history[-1].items() if key != "reasoning_content"}
    history.append({"role": "tool", "tool_call_id": first["tool_calls"][0]["id"], "content": "18.015"})
    await client_turn(sessions, engine, history)
    history.append({"role": "user", "content": "and NaCl?"})
    await client_turn(sessions, engine, history)

    body = await sessions.trajectory("s1")
    assert body.messages[1]["reasoning_content"] == "ask calc"  # the server's record, not the echo
    assert body.token_trace.ids == engine.prompts[-1] + engine.generated[-1]
    assert body.tokenization_bugs == []


# -- streamed turns -----------------------------------------------------------------------------


async def streamed_turn(sessions: ChatSessions, engine: ScriptedEngine, history: list[dict],
                        **fields: object) -> AsyncGenerator[tuple[dict, int], None]:
    """A streamed turn's chunks as the client reads them, each with the pieces streamed by then."""
    prompt, pieces = await sessions.stream_turn(request(*history, stream=True, **fields), engine.stream)
    # Closed when this generator is: a response closes its events when its client leaves
    # (cancelled mid-read, or collected).
    async with contextlib.aclosing(chat_events(pieces, prompt, request_id="c", created=1,
                                               served=sessions.served)) as events:
        async for event in events:
            if event != "data: [DONE]\n\n":
                yield json.loads(event[len("data: "):]), engine.streamed


async def test_a_streamed_session_turn_goes_out_token_by_token_and_is_kept_as_sampled(
    served: ServedModel,
) -> None:
    sessions = ChatSessions(served, LocalSessionStore(SessionStore(ttl_s=60, max_sessions=8)))
    answer = "water is 18.015 g/mol"
    engine = ScriptedEngine(served, [call_turn(served, "H2O"), answer + served.chat.end_of_turn_text])
    engine.constrained_turns = {1}
    history = [QUESTION]
    await client_turn(sessions, engine, history)
    history.append({"role": "tool", "tool_call_id": "call_0", "content": "18.015"})

    chunks, content = [], []
    async for chunk, streamed in streamed_turn(sessions, engine, history):
        chunks.append(chunk)
        if chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
            content.append((chunk["choices"][0]["delta"]["content"], streamed))
            if len(content) == 1:  # mid-turn: the session is still this turn's
                with pytest.raises(SessionConflictError):
                    await sessions.turn(request(*history), engine)
                assert (await sessions.trajectory("s1")).turns == 1
    assert "".join(text for text, _ in content) == answer
    assert len(content) > 3 and content[0][1] < len(engine.generated[-1]) // 2
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"

    # Kept once the stream ended: the ids, logprobs, versions and grammar flags as sampled.
    body = await sessions.trajectory("s1")
    trace = body.token_trace
    turn = range(len(engine.prompts[-1]), len(trace.ids))
    assert (body.turns, body.finish_reason) == (2, "stop")
    assert trace.ids == engine.prompts[-1] + engine.generated[-1]
    assert all(trace.versions[p] == VERSION and trace.logprobs[p] == -0.25 for p in turn)
    assert not any(trace.loss_mask[p] for p in turn)  # sampled under a grammar: mask 0
    assert body.messages[-1] == {"role": "assistant", "content": answer}
    assert body.tokenization_bugs == []


async def test_a_streamed_turn_left_early_or_failed_leaves_the_session_as_it_was(
    served: ServedModel,
) -> None:
    sessions = ChatSessions(served, LocalSessionStore(SessionStore(ttl_s=60, max_sessions=8)))
    long_answer = "an answer long enough to leave" + served.chat.end_of_turn_text
    engine = ScriptedEngine(served, [call_turn(served, "H2O"), long_answer, long_answer,
                                     "18.015" + served.chat.end_of_turn_text])
    history = [QUESTION]
    await client_turn(sessions, engine, history)
    history.append({"role": "tool", "tool_call_id": "call_0", "content": "18.015"})
    before = await sessions.trajectory("s1")

    # The client leaves after two chunks: the events are closed, the engine's pieces with them.
    events = streamed_turn(sessions, engine, history)
    assert [await anext(events) for _ in range(2)]
    await events.aclose()
    assert engine.closed and engine.streamed < len(engine.generated[-1])
    assert await sessions.trajectory("s1") == before

    engine.fail_at = 3  # a worker dies mid-turn: an error event, and nothing kept
    chunks = [chunk async for chunk, _ in streamed_turn(sessions, engine, history)]
    assert chunks[-1]["error"]["code"] == "worker_unavailable"
    assert await sessions.trajectory("s1") == before

    engine.fail_at = None  # the session is free and unchanged: the next turn continues it
    await client_turn(sessions, engine, history)
    body = await sessions.trajectory("s1")
    assert body.turns == 2 and body.token_trace.ids == engine.prompts[-1] + engine.generated[-1]
    assert engine.prompts[-1] == engine.prompts[1] == engine.prompts[2]


async def test_a_streamed_turn_cut_by_max_tokens_is_kept_as_truncated(served: ServedModel) -> None:
    sessions = ChatSessions(served, LocalSessionStore(SessionStore(ttl_s=60, max_sessions=8)))
    engine = ScriptedEngine(served, ["a long answer, cut" + served.chat.end_of_turn_text])
    chunks = [chunk async for chunk, _ in streamed_turn(sessions, engine, [QUESTION], max_tokens=3)]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    body = await sessions.trajectory("s1")
    assert (body.turns, body.finish_reason) == (1, "truncated")
    assert body.token_trace.ids[body.prompt_len:] == engine.generated[0] and len(engine.generated[0]) == 3
    with pytest.raises(InvalidApiRequestError) as raised:
        await sessions.turn(request(QUESTION, {"role": "assistant", "content": chunks_text(chunks)},
                                    {"role": "user", "content": "go on"}), engine)
    assert raised.value.code == "session_truncated"


async def test_a_session_deleted_while_its_turn_streams_ends_the_stream_with_an_error_event(
    served: ServedModel,
) -> None:
    sessions = ChatSessions(served, LocalSessionStore(SessionStore(ttl_s=60, max_sessions=8)))
    engine = ScriptedEngine(served, [call_turn(served, "H2O"), "18.015 g/mol" + served.chat.end_of_turn_text])
    history = [QUESTION]
    await client_turn(sessions, engine, history)
    history.append({"role": "tool", "tool_call_id": "call_0", "content": "18.015"})
    chunks = []
    async for chunk, _ in streamed_turn(sessions, engine, history):
        chunks.append(chunk)
        if len(chunks) == 2:
            assert (await sessions.delete("s1")).deleted
    assert chunks[-1]["error"]["code"] == "session_busy"
    assert not any(c["choices"][0]["finish_reason"] for c in chunks if c.get("choices"))
    with pytest.raises(SessionNotFoundError):
        await sessions.trajectory("s1")


def chunks_text(chunks: list[dict]) -> str:
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices"))
