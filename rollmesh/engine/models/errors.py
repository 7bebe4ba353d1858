"""Errors raised while reading Hugging Face configs and checkpoints. Knows nothing but Python.

    EngineError (rollmesh.engine.errors)
    ├── ModelConfigError(path, field, reason)        a config.json we cannot build a model from
    │   └── UnsupportedModelTypeError(model_type)
    └── WeightsError
        ├── WeightsMismatchError
        │   └── CheckpointKeysError(path, missing, unexpected, mismatched)   strict key check failed
        └── WeightsFileError(path, reason)            reused as is for unreadable shards and indexes
"""

from __future__ import annotations

from rollmesh.engine.errors import EngineError, WeightsMismatchError

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3_moe", "mixtral")

# A key list in a message is for a human; past this many, say how many more there are.
_SHOWN_KEYS = 8


class ModelConfigError(EngineError):
    def __init__(self, reason: str, *, field: str, path: str | None = None) -> None:
        where = f"{path}: " if path else ""
        super().__init__(f"{where}config field {field!r}: {reason}")
        self.reason = reason
        self.field = field
        self.path = path


class UnsupportedModelTypeError(ModelConfigError):
    def __init__(self, model_type: object, *, path: str | None = None) -> None:
        super().__init__(
            f"model_type {model_type!r} is not one of {', '.join(SUPPORTED_MODEL_TYPES)}",
            field="model_type",
            path=path,
        )
        self.model_type = model_type


def _show(keys: list[str]) -> str:
    shown = ", ".join(keys[:_SHOWN_KEYS])
    more = len(keys) - _SHOWN_KEYS
    return f"{shown} (+{more} more)" if more > 0 else shown


class CheckpointKeysError(WeightsMismatchError):
    """The checkpoint's tensor names or shapes are not exactly the model's."""

    def __init__(
        self,
        *,
        path: str | None,
        missing: list[str],
        unexpected: list[str],
        mismatched: list[str] | None = None,
    ) -> None:
        mismatched = mismatched or []
        parts = []
        if missing:
            parts.append(f"{len(missing)} missing: {_show(missing)}")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected: {_show(unexpected)}")
        if mismatched:
            parts.append(f"{len(mismatched)} with the wrong shape: {_show(mismatched)}")
        where = f"{path}: " if path else ""
        super().__init__("; ".join(parts))
        # The parent words its message around a weights version, which a file on disk has not got.
        self.args = (f"{where}checkpoint does not fit the model: " + "; ".join(parts),)
        self.path = path
        self.missing = missing
        self.unexpected = unexpected
        self.mismatched = mismatched
