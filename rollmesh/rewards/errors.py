"""Errors of the rewards package, by whose fault a reward could not be given::

    RewardError                 base
      RewardInputError          the row's fault: it lacks what the reward checks against (no answer)
      RewardLoadError           the config's fault: a reward that does not load (unknown name, an
                                import path that does not import, bad args); raised at config load
      RewardUnavailableError    the infrastructure's fault: the reward could not be computed now
                                (its worker process died, a reward function raised, a server is down)

The agent loop turns ``RewardInputError`` into a ``RolloutFailed`` of kind ``invalid_request`` and
``RewardUnavailableError`` into one of kind ``reward_error`` (retried, then masked out of group
statistics): a reward that cannot be computed is never a zero.
"""

from __future__ import annotations


class RewardError(Exception):
    """A reward that could not be given."""


class RewardInputError(RewardError, ValueError):
    """The sample cannot be scored by ``reward``: the row lacks what it checks against."""

    def __init__(self, reward: str, reason: str) -> None:
        super().__init__(f"reward {reward!r}: {reason}")
        self.reward = reward
        self.reason = reason


class RewardLoadError(RewardError, LookupError):
    """The reward ``spec_label`` names cannot be loaded (a configuration error)."""

    def __init__(self, spec_label: str, reason: str) -> None:
        super().__init__(f"reward {spec_label!r} cannot be loaded: {reason}")
        self.spec_label = spec_label
        self.reason = reason


class RewardUnavailableError(RewardError, RuntimeError):
    """``reward`` could not be computed, for a reason that is not the model's output."""

    def __init__(self, reward: str, reason: str) -> None:
        super().__init__(f"reward {reward!r} unavailable: {reason}")
        self.reward = reward
        self.reason = reason
