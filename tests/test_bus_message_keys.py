"""The ids a message carries for logs and spans (``rollmesh.bus.message_keys``): plain logic."""

from __future__ import annotations

import pytest

from rollmesh.bus.message_keys import log_fields, weight_version_of
from rollmesh.messages import (
    RolloutCompleted,
    RolloutProgressed,
    SandboxExecRequest,
    SandboxLeaseRequest,
    SandboxReleaseRequest,
)

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


def completed(versions: list[int]) -> RolloutCompleted:
    return RolloutCompleted(rollout_id="r-1", task="t", group_id="g", purpose="train", reward=1.0,
                            turns=2, tool_calls=1, prompt_len=2, tokens=list(range(len(versions))),
                            loss_mask=[int(v >= 0) for v in versions], logprobs=[0.0] * len(versions),
                            versions=versions)


@pytest.mark.parametrize("versions, expected", [
    # prompt, turn 1 by version 3, tool output, turn 2 by version 5 (ends the trajectory)
    ([-1, -1, 3, 3, -1, -1, 5, 5], 5),
    # the last generated token is followed by tool output the model never answered
    ([-1, 2, 4, -1, -1], 4),
    # a resumed rollout whose later turn ran on older weights: the last token's, not the largest
    ([-1, 7, 7, -1, 6], 6),
    ([-1, 0, -1], 0),
])
def test_a_completed_rollout_carries_the_version_of_its_last_generated_token(versions, expected):
    assert weight_version_of(completed(versions)) == expected
    assert log_fields(completed(versions)) == {"rollout_id": "r-1", "weight_version": expected}


def test_a_completed_rollout_with_no_generated_token_carries_no_weight_version():
    assert weight_version_of(completed([-1, -1, -1])) is None
    assert log_fields(completed([-1, -1])) == {"rollout_id": "r-1"}


def test_a_message_with_its_own_weight_version_keeps_it():
    progressed = RolloutProgressed(rollout_id="r-2", turn=1, num_tokens=3, weight_version=9)
    assert log_fields(progressed) == {"rollout_id": "r-2", "weight_version": 9}


def test_sandbox_requests_name_the_rollout_they_are_made_for_and_none_otherwise():
    assert log_fields(SandboxLeaseRequest(holder="r-3", rollout_id="r-3")) == {"rollout_id": "r-3"}
    assert log_fields(SandboxExecRequest(lease_id="l", argv=["true"], rollout_id="r-3")) == {"rollout_id": "r-3"}
    assert log_fields(SandboxReleaseRequest(lease_id="l")) == {}  # from the CLI: no rollout
