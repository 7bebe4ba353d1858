"""Trainer events. Knows msgspec only."""

from __future__ import annotations

import msgspec

from rollmesh.messages.base import WireMessage


class TrainerStepped(WireMessage, frozen=True, tag="trainer.stepped"):
    step: int
    weight_version: int
    loss: float
    reward_mean: float
    # Training samples (token sequences) the step trained on; a rollout split by
    # rollout.history_rewrite = "split" gives several, each with its rollout's advantage.
    num_samples: int
    num_groups: int
    # Deprecated (read max_generation_lag): the same value under its old name, which said version
    # lag for what is the generation lag. Still sent, so readers of the last release read it.
    max_version_lag: int = 0
    dropped_stale: int = 0
    duration_s: float = 0.0
    # Deprecated (read generation_lag_p50, _p90, _histogram): as max_version_lag.
    version_lag_p50: int = 0
    version_lag_p90: int = 0
    version_lag_histogram: dict[int, int] = {}
    # Raw version lag (tool waits included) of the same trajectories, max over the batch: how old
    # the oldest token the importance ratio had to correct was.
    max_raw_version_lag: int = 0
    # Rollouts whose samples the step trained on (num_samples counts their samples); 0 from
    # senders that predate it.
    num_rollouts: int = 0
    # The group ids the step consumed, trained or dropped (a `rollmesh train` feeder's groups name
    # their stage, epoch and dataset row: rollmesh/training/prompt_ids.py), and how many of them
    # dynamic sampling dropped (trainer.drop_uniform_groups).
    groups: list[str] = []
    dropped_groups: int = 0
    # Train-versus-rollout logprob mismatch: mean |trainer logprob - behaviour logprob| over the
    # step's trained generated tokens, the trainer's taken before the update (training/losses.py).
    # None: the step trained nothing, or the sender predates it.
    logprob_mismatch: float | None = None
    # Generation lag (training/admission.py: version lag of the generated tokens, tool waits
    # excluded; the admission measure) of the trajectories trained on, max over the batch.
    max_generation_lag: int = 0
    # Its distribution over the step's admitted trajectories: nearest-rank percentiles (each a lag
    # that occurred) and lag -> trajectories (JSON object keys are strings on the wire; msgspec
    # decodes them back to ints). Admitted lags are <= max_staleness, so the histogram has at most
    # max_staleness + 1 keys.
    generation_lag_p50: int = 0
    generation_lag_p90: int = 0
    generation_lag_histogram: dict[int, int] = {}

    def __post_init__(self) -> None:
        # One release of both names: a message from an older sender fills the new fields from the
        # old ones, and a sender that sets only the new ones also fills the old ones, so readers
        # of the last release still read them. Remove with the deprecated fields.
        for old, new in _RENAMED_LAGS:
            old_value, new_value = getattr(self, old), getattr(self, new)
            if old_value and not new_value:
                msgspec.structs.force_setattr(self, new, old_value)
            elif new_value and not old_value:
                msgspec.structs.force_setattr(self, old, new_value)


# TrainerStepped's deprecated generation-lag fields and their new names.
_RENAMED_LAGS = (("max_version_lag", "max_generation_lag"), ("version_lag_p50", "generation_lag_p50"),
                 ("version_lag_p90", "generation_lag_p90"), ("version_lag_histogram", "generation_lag_histogram"))


class GroupDropped(WireMessage, frozen=True, tag="trainer.group_dropped"):
    """Dynamic sampling (trainer.drop_uniform_groups) set a complete group aside: its rewards were
    all equal, so it teaches nothing and does not count toward a step. Sent as the group
    completes, so a feeder can publish a prompt in its place at once; the group's members are
    recorded as consumed with the next durable step (TrainerStepped.groups)."""

    group_id: str
    reward: float
    step: int
