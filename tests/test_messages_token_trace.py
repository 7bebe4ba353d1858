"""TokenTrace, the one shape of a rollout's tokens: its invariants, messages of senders that predate
it (flat ``tokens``/``loss_mask``/``logprobs``/``versions``) decoding into the same trace, and the
choice between carrying a trace inline and storing it, at ``rollout.inline_trajectory_bytes``; a
rollout split into several samples (``rollout.history_rewrite = "split"``) on the wire, inline and
stored, and read by a reader that predates it."""

from __future__ import annotations

import math

import msgspec
import pytest

from rollmesh.bus.message_keys import weight_version_of
from rollmesh.config import RolloutConfig
from rollmesh.messages import (
    NO_VERSION,
    RolloutCompleted,
    RolloutFailed,
    RolloutRequested,
    RolloutState,
    TokenTrace,
    TokenTraceError,
    TraceNotInlineError,
    WireMessage,
)
from rollmesh.messages.subjects import ROLLOUT_COMPLETED, ROLLOUT_FAILED
from rollmesh.rollout.saved_state import InMemoryRolloutStates, conversation_of
from rollmesh.rollout.trajectory_offload import (
    InMemoryTrajectories,
    OffloadingRolloutStates,
    fits_inline,
    load_trace,
    load_traces,
    place_trace,
    place_traces,
    trace_bytes,
)

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

# A prompt (2 tokens), a turn by version 3, a tool output token, a turn by version 4.
TRACE = TokenTrace(ids=[256, 65, 66, 10, 67], loss_mask=[0, 0, 1, 0, 1],
                   logprobs=[0.0, 0.0, -0.5, 0.0, -0.25], versions=[-1, -1, 3, -1, 4])
FLAT = {"tokens": TRACE.ids, "loss_mask": TRACE.loss_mask, "logprobs": TRACE.logprobs, "versions": TRACE.versions}
HEAD = {"rollout_id": "r-old", "task": "molar_mass", "group_id": "g", "purpose": "train", "reward": 1.0,
        "turns": 2, "tool_calls": 1, "prompt_len": 2}


# --- invariants --------------------------------------------------------------------------------

@pytest.mark.parametrize(("fields", "reason", "position"), [
    ({"ids": [1, 2], "loss_mask": [0], "logprobs": [0.0, 0.0], "versions": [-1, -1]}, "differ in length", -1),
    ({"ids": [1, 2], "loss_mask": [0, 2], "logprobs": [0.0, -0.1], "versions": [-1, 0]}, "other than 0 or 1", 1),
    ({"ids": [1, 2], "loss_mask": [0, 0], "logprobs": [0.0, -0.3], "versions": [-1, -1]}, "not generated", 1),
    ({"ids": [1], "loss_mask": [1], "logprobs": [math.nan], "versions": [2]}, "NaN", 0),
])
def test_a_trace_breaking_an_invariant_is_refused_when_built_and_when_decoded(fields, reason, position):
    with pytest.raises(TokenTraceError, match=reason) as raised:
        TokenTrace(**fields)
    assert raised.value.position == position
    with pytest.raises(msgspec.ValidationError, match=reason):
        msgspec.msgpack.decode(msgspec.msgpack.encode(fields), type=TokenTrace)


@pytest.mark.parametrize("fields", [
    {"ids": [1], "loss_mask": [0], "logprobs": [0.0], "versions": [-2]},  # -1 is the only "none"
    {"ids": [-1], "loss_mask": [0], "logprobs": [0.0], "versions": [-1]},
])
def test_a_decoded_trace_refuses_versions_below_no_version_and_negative_ids(fields):
    with pytest.raises(msgspec.ValidationError, match=r">= -1|>= 0"):
        msgspec.msgpack.decode(msgspec.msgpack.encode(fields), type=TokenTrace)


def test_a_generated_token_may_be_untrained_and_a_demonstration_may_train_a_token_it_did_not_generate():
    grammar = TokenTrace(ids=[5], loss_mask=[0], logprobs=[-0.2], versions=[7])  # sampled under a grammar
    demonstration = TokenTrace(ids=[5], loss_mask=[1], logprobs=[0.0], versions=[NO_VERSION])
    assert grammar.generated_versions() == [7] and demonstration.generated_versions() == []


def test_forced_tail_concat_and_last_version_keep_the_four_lists_aligned():
    forced = TokenTrace.forced([9, 8])
    assert forced == TokenTrace(ids=[9, 8], loss_mask=[0, 0], logprobs=[0.0, 0.0], versions=[-1, -1])
    assert TRACE.tail(2) == TokenTrace(ids=[10, 67], loss_mask=[0, 1], logprobs=[0.0, -0.25], versions=[-1, 4])
    assert TRACE.tail(99) == TRACE
    assert TRACE.concat(forced).ids == TRACE.ids + [9, 8] and len(TRACE.concat(forced)) == 7
    assert TRACE.concat(forced).last_version() == 4 and forced.last_version() == NO_VERSION


# --- schema evolution: senders that predate TokenTrace -----------------------------------------

class PreTraceRolloutCompleted(WireMessage, frozen=True, tag="rollout.completed"):
    """RolloutCompleted as released before TokenTrace (its flat token fields required)."""

    rollout_id: str
    task: str
    group_id: str
    purpose: str
    reward: float
    turns: int
    tool_calls: int
    prompt_len: int
    tokens: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    versions: list[int]
    text: str = ""
    duration_s: float = 0.0
    trajectory_ref: str = ""
    routed_experts_ref: str = ""
    idempotency_key: str = ""
    attempts: int = 1
    infra_failures: int = 0
    trace_id: str = ""


def test_a_completed_rollout_from_a_sender_before_token_trace_decodes_into_the_same_trace():
    # The bytes an older rollout worker published (every field, as it encoded them).
    old = (b'{"type":"rollout.completed","rollout_id":"r-old","task":"molar_mass","group_id":"g",'
           b'"purpose":"train","reward":1.0,"turns":2,"tool_calls":1,"prompt_len":2,'
           b'"tokens":[256,65,66,10,67],"loss_mask":[0,0,1,0,1],"logprobs":[0.0,0.0,-0.5,0.0,-0.25],'
           b'"versions":[-1,-1,3,-1,4],"text":"AB","duration_s":1.5,"trajectory_ref":"",'
           b'"routed_experts_ref":"","idempotency_key":"r-old","attempts":1,"infra_failures":0,"trace_id":""}')
    assert old == msgspec.json.encode(PreTraceRolloutCompleted(**HEAD, **FLAT, text="AB", duration_s=1.5,
                                                               idempotency_key="r-old"))
    decoded = ROLLOUT_COMPLETED.decode(old)
    assert decoded.trajectory is None and decoded.token_trace() == TRACE
    assert weight_version_of(decoded) == 4, "its last generated token's version, as before"


def test_a_broken_old_message_is_refused_with_the_reason_when_its_trace_is_read():
    decoded = ROLLOUT_COMPLETED.decode(msgspec.json.encode(PreTraceRolloutCompleted(
        **HEAD, **{**FLAT, "versions": [-1, -1, 3]})))
    with pytest.raises(TokenTraceError, match="'r-old': ids, loss_mask, logprobs and versions differ"):
        decoded.token_trace()


def test_a_new_completed_rollout_carries_only_its_trace_and_a_reader_before_token_trace_refuses_it():
    new = RolloutCompleted(**HEAD, trajectory=TRACE, num_tokens=5, weight_version=4)
    data = ROLLOUT_COMPLETED.encode(new)
    assert not {"tokens", "loss_mask", "logprobs", "versions"} & set(msgspec.json.decode(data))
    assert ROLLOUT_COMPLETED.decode(data) == new
    # An old trainer dead-letters it (a required field is missing) rather than train on nothing.
    with pytest.raises(msgspec.ValidationError, match="missing required field `tokens`"):
        msgspec.json.decode(data, type=PreTraceRolloutCompleted)


def test_a_saved_state_from_a_worker_before_token_trace_decodes_and_resumes_with_the_same_trace():
    request = RolloutRequested(rollout_id="r-old", task="molar_mass", task_input={"formula": "H2O"})
    outcome = PreTraceRolloutCompleted(**HEAD, **FLAT)
    # What an older worker's KV value held: msgpack, flat token fields, an old-shaped outcome.
    old = msgspec.msgpack.encode({"type": "rollout.state", "rollout_id": "r-old", "request": request,
                                  "turn": 2, **FLAT, "prompt_len": 2, "outcome": outcome})
    state = msgspec.msgpack.decode(old, type=RolloutState)
    assert state.token_trace() == TRACE and state.outcome.token_trace() == TRACE
    # No chat messages to rebuild its trajectory from: a resuming worker starts it over.
    assert state.messages == [] and state.finish_reason == "" and conversation_of(state).messages == []


# --- schema evolution: senders that predate chat messages --------------------------------------

def test_a_completed_rollout_from_a_sender_before_chat_messages_decodes_with_a_stopped_unchecked_default():
    before = RolloutCompleted(**HEAD, trajectory=TRACE, num_tokens=5, weight_version=4)
    data = msgspec.json.encode(before)  # omit_defaults: what an older sender wrote, field for field
    assert not {"finish_reason", "tokenization_mismatches", "malformed_tool_calls"} & set(msgspec.json.decode(data))
    decoded = ROLLOUT_COMPLETED.decode(data)
    assert (decoded.finish_reason, decoded.tokenization_mismatches, decoded.malformed_tool_calls) == ("stop", {}, 0)
    assert decoded.token_trace() == TRACE


def test_a_new_completed_rollout_says_how_it_finished_and_what_the_token_check_found():
    new = RolloutCompleted(**HEAD, trajectory=TRACE, num_tokens=5, finish_reason="truncated",
                           tokenization_mismatches={"special": 1, "non_assistant": 0, "assistant": 2},
                           malformed_tool_calls=1)
    assert ROLLOUT_COMPLETED.decode(ROLLOUT_COMPLETED.encode(new)) == new
    with pytest.raises(msgspec.ValidationError, match="finish_reason"):
        ROLLOUT_COMPLETED.decode(ROLLOUT_COMPLETED.encode(new).replace(b'"truncated"', b'"length"'))


# --- schema evolution: split samples ----------------------------------------------------------

# A second sample: the whole render of the conversation at the split, then a turn by version 5.
LATER = TokenTrace(ids=[256, 65, 10, 68], loss_mask=[0, 0, 0, 1], logprobs=[0.0, 0.0, 0.0, -0.75],
                   versions=[-1, -1, -1, 5])


class PreSplitReader(WireMessage, frozen=True, tag="rollout.completed"):
    """What a reader of RolloutCompleted before split samples looks at."""

    rollout_id: str
    trajectory: TokenTrace | None = None


def test_a_completed_rollout_from_a_sender_before_split_samples_decodes_as_one_sample():
    # Bytes a TokenTrace-era worker published (defaults omitted).
    old = (b'{"type":"rollout.completed","rollout_id":"r-old","task":"molar_mass","group_id":"g",'
           b'"purpose":"train","reward":1.0,"turns":2,"tool_calls":1,"prompt_len":2,"trajectory":'
           + msgspec.json.encode(TRACE) + b',"num_tokens":5,"weight_version":4}')
    decoded = ROLLOUT_COMPLETED.decode(old)
    assert (decoded.split_samples, decoded.split_sample_refs, decoded.num_samples) == ([], [], 1)
    assert decoded.token_traces() == [TRACE]


def test_split_samples_round_trip_and_a_reader_before_them_reads_the_first_sample():
    new = RolloutCompleted(**HEAD, trajectory=TRACE, split_samples=[LATER], num_tokens=9, weight_version=5)
    data = ROLLOUT_COMPLETED.encode(new)
    decoded = ROLLOUT_COMPLETED.decode(data)
    assert decoded == new and decoded.num_samples == 2 and decoded.token_traces() == [TRACE, LATER]
    assert msgspec.json.decode(data, type=PreSplitReader).trajectory == TRACE
    # A single-sample message does not write the new fields at all.
    assert b"split_sample" not in ROLLOUT_COMPLETED.encode(RolloutCompleted(**HEAD, trajectory=TRACE))


async def test_split_samples_travel_inline_together_or_are_stored_one_object_each():
    both, store = trace_bytes(TRACE) + trace_bytes(LATER), InMemoryTrajectories()
    inline = await place_traces("r-1", "completed", [TRACE, LATER], inline_bytes=both, store=store)
    assert inline == {"trajectory": TRACE, "trajectory_ref": "", "split_samples": [LATER], "split_sample_refs": []}
    assert store.traces == {}

    carried = await place_traces("r-1", "completed", [TRACE, LATER], inline_bytes=both - 1, store=store)
    message = RolloutCompleted(**HEAD, **carried)
    assert message.trajectory is None and message.split_samples == [] and message.num_samples == 2
    assert store.traces == {"memory/r-1/completed": TRACE, "memory/r-1/completed-sample-1": LATER}
    with pytest.raises(TraceNotInlineError):
        message.token_traces()
    assert await load_traces(message, store) == [TRACE, LATER]


async def test_a_long_split_state_stores_every_sample_per_turn_and_resumes_with_all_of_them():
    inner, blobs = InMemoryRolloutStates(), InMemoryTrajectories()
    states = OffloadingRolloutStates(inner, blobs, inline_bytes=trace_bytes(TRACE))
    request = RolloutRequested(rollout_id="r-1", task="molar_mass")
    split = RolloutState(rollout_id="r-1", request=request, turn=2, trajectory=TRACE, split_samples=[LATER],
                         sample_message_counts=[3, 5])
    await states.save(split)
    saved = inner.states["r-1"]
    assert saved.trajectory is None and saved.split_samples == []
    assert set(blobs.traces) == {saved.trajectory_ref, *saved.split_sample_refs} and len(blobs.traces) == 2

    loaded = await OffloadingRolloutStates(inner, blobs, inline_bytes=trace_bytes(TRACE)).load("r-1")
    assert loaded.token_traces() == [TRACE, LATER] and loaded.sample_message_counts == [3, 5]
    await states.save(msgspec.structs.replace(split, turn=3))
    assert len(blobs.traces) == 2 and all("turn-3" in ref for ref in blobs.traces), "turn 2's blobs are deleted"
    await states.delete("r-1")
    assert blobs.traces == {}


def test_a_tokenization_error_is_a_failure_kind_that_is_not_retried_as_infrastructure():
    from rollmesh.messages import INFRA_FAILURE_KINDS

    failed = RolloutFailed(rollout_id="r-1", kind="tokenization_error", reason="non_assistant at token 12")
    assert ROLLOUT_FAILED.decode(ROLLOUT_FAILED.encode(failed)) == failed
    assert "tokenization_error" not in INFRA_FAILURE_KINDS


def test_a_saved_state_from_a_worker_before_chat_messages_decodes_with_its_calls_and_no_messages():
    request = RolloutRequested(rollout_id="r-old", task="molar_mass", task_input={"formula": "H2O"})
    old = msgspec.msgpack.encode({"type": "rollout.state", "rollout_id": "r-old", "request": request, "turn": 1,
                                  "trajectory": TRACE, "prompt_len": 2, "final_text": "",
                                  "tool_calls": [{"name": "calc", "argument": "H2O", "ok": True, "output": "18.015"}]})
    state = msgspec.msgpack.decode(old, type=RolloutState)
    (call,) = state.tool_calls
    assert (call.name, call.argument, call.call_id, call.arguments) == ("calc", "H2O", "", {})
    assert (state.messages, state.finish_reason, state.malformed_tool_calls) == ([], "", 0)
    assert state.token_trace() == TRACE


def test_a_stored_trace_is_not_read_inline():
    message = RolloutCompleted(**HEAD, trajectory_ref="RL_x_TRAJECTORIES/r-old/completed", num_tokens=5)
    with pytest.raises(TraceNotInlineError) as raised:
        message.token_trace()
    assert raised.value.ref == "RL_x_TRAJECTORIES/r-old/completed"


# --- inline or stored --------------------------------------------------------------------------

def test_the_inline_limit_defaults_to_256_kib():
    assert RolloutConfig().inline_trajectory_bytes == 262_144


def test_the_inline_size_is_the_traces_share_of_the_wire_message():
    with_trace = ROLLOUT_COMPLETED.encode(RolloutCompleted(**HEAD, trajectory=TRACE))
    without = ROLLOUT_COMPLETED.encode(RolloutCompleted(**HEAD))
    assert len(with_trace) - len(without) == trace_bytes(TRACE) + len(b',"trajectory":')


async def test_a_trace_of_exactly_the_limit_travels_inline_and_one_byte_more_is_stored_first():
    size, store = trace_bytes(TRACE), InMemoryTrajectories()
    assert fits_inline(TRACE, size) and not fits_inline(TRACE, size - 1)
    assert await place_trace("r-1", "completed", TRACE, inline_bytes=size, store=store) == {
        "trajectory": TRACE, "trajectory_ref": ""}
    assert store.traces == {}

    carried = await place_trace("r-1", "completed", TRACE, inline_bytes=size - 1, store=store)
    assert carried["trajectory"] is None and store.traces == {carried["trajectory_ref"]: TRACE}
    message = RolloutCompleted(**HEAD, **carried)
    assert await load_trace(message, store) == TRACE
    # Without a store (in-process runs) a trace always travels inline.
    assert (await place_trace("r-1", "completed", TRACE, inline_bytes=1, store=None))["trajectory"] == TRACE


async def test_a_long_state_keeps_its_trace_in_the_store_one_blob_per_saved_turn():
    inner, blobs = InMemoryRolloutStates(), InMemoryTrajectories()
    states = OffloadingRolloutStates(inner, blobs, inline_bytes=trace_bytes(TRACE) - 1)
    request = RolloutRequested(rollout_id="r-1", task="molar_mass")
    short = RolloutState(rollout_id="r-1", request=request, turn=0, trajectory=TokenTrace.forced([1]))
    await states.save(short)
    assert inner.states["r-1"].trajectory == short.trajectory and blobs.traces == {}

    await states.save(msgspec.structs.replace(short, turn=1, trajectory=TRACE))
    first_ref = inner.states["r-1"].trajectory_ref
    assert inner.states["r-1"].trajectory is None and blobs.traces == {first_ref: TRACE}
    longer = TRACE.concat(TokenTrace.forced([7]))
    await states.save(msgspec.structs.replace(short, turn=2, trajectory=longer))
    second_ref = inner.states["r-1"].trajectory_ref
    assert second_ref != first_ref and blobs.traces == {second_ref: longer}, "turn 1's blob is deleted"

    # Another worker (a fresh wrapper) resumes it with its whole trace, and deleting it forgets the blob.
    taken_over = OffloadingRolloutStates(inner, blobs, inline_bytes=trace_bytes(TRACE) - 1)
    loaded = await taken_over.load("r-1")
    assert loaded.trajectory == longer and loaded.trajectory_ref == "" and loaded.turn == 2
    await taken_over.delete("r-1")
    assert inner.states == {} and blobs.traces == {}
