"""Errors of the training optimizers. Knows nothing but the standard library.

    OptimizerError
    ├── OptimizerSetupError     a parameter the optimizer cannot take (device, layout, dtype)
    └── MissingGradientError    a parameter has no gradient when the step runs
"""

from __future__ import annotations


class OptimizerError(Exception):
    """Root of the tree; ``parameter`` is the name of the parameter concerned."""

    def __init__(self, message: str, *, parameter: str) -> None:
        super().__init__(f"{message} (parameter {parameter!r})")
        self.parameter = parameter


class OptimizerSetupError(OptimizerError):
    def __init__(self, reason: str, *, parameter: str) -> None:
        super().__init__(f"optimizer cannot take this parameter: {reason}", parameter=parameter)
        self.reason = reason


class MissingGradientError(OptimizerError):
    # Both optimizers update every element of their flat state each step; skipping a parameter
    # the way torch.optim does would need a mask per chunk, so a missing gradient is an error.
    def __init__(self, *, parameter: str, step: int) -> None:
        super().__init__(f"no gradient at step {step}", parameter=parameter)
        self.step = step
