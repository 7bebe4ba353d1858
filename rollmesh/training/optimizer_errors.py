"""Deprecated: the optimizers' errors live in ``rollmesh.training.errors`` (under TrainingError)."""

from rollmesh.moved_names import forward_moved_names

__getattr__ = forward_moved_names(__name__, {
    name: "rollmesh.training.errors" for name in ("OptimizerError", "OptimizerSetupError", "MissingGradientError")})
