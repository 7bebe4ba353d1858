"""Errors raised by the inference engine. Knows nothing but Python.

    EngineError
    ├── InvalidRequestError(reason, field, request_id)  bad input; nothing changed
    │   ├── PromptTooLongError(num_tokens, max_tokens)
    │   ├── DuplicateRequestError(request_id)
    │   └── InvalidGrammarError(kind, detail)       a grammar xgrammar cannot compile
    ├── CapacityError(max_batch, request_id)            every decode slot is taken
    ├── EngineStoppedError(request_id)                  the loop stopped with it in flight
    ├── VersionUnavailableError(min_version, current)   retryable: weights not yet that new
    ├── MemoryReleasedError(request_id)                 retryable: memory lent out (GPU scheduler)
    ├── EngineBusyError(active, reason)                 a release needs an idle engine
    ├── KvCapacityError(blocks_needed, blocks_total)    the request can never fit the KV pool
    ├── DecodeStepError(weight_version, request_ids)    a batched step failed; its batch fails
    └── WeightsError(version, path)
        ├── WeightsMismatchError(reason)                a state dict that does not fit the model
        ├── StaleWeightsError(current_version)          older than the active version
        ├── WeightsChecksumError(expected, actual)
        ├── WeightsFileError(reason)                    unwritable, unreadable or malformed file
        ├── WeightsUnavailableError(reason)             no memory copy here: read the files
        └── WeightSyncError(method, reason)             a push into SGLang servers failed: files follow
"""

from __future__ import annotations


def _rebuild(cls: type, message: str, state: dict) -> "EngineError":
    error = cls.__new__(cls)
    Exception.__init__(error, message)
    error.__dict__.update(state)
    return error


class EngineError(Exception):
    """Root of the engine's errors."""

    def __reduce__(self):
        # Ray pickles errors raised in actors; the default reduce would call __init__ with the
        # message alone, which the keyword-only fields below refuse, and the caller would get an
        # UnserializableException instead of the typed error.
        return (_rebuild, (type(self), str(self), self.__dict__))


class InvalidRequestError(EngineError):
    def __init__(self, reason: str, *, field: str, request_id: str | None = None) -> None:
        where = f" (request {request_id})" if request_id else ""
        super().__init__(f"invalid {field}: {reason}{where}")
        self.reason = reason
        self.field = field
        self.request_id = request_id


class PromptTooLongError(InvalidRequestError):
    """The prompt leaves no room for one generated token within the model's context."""

    def __init__(self, num_tokens: int, max_tokens: int, *, request_id: str | None = None) -> None:
        super().__init__(
            f"{num_tokens} tokens, at most {max_tokens} fit (one position is kept for generation)",
            field="input_ids",
            request_id=request_id,
        )
        self.num_tokens = num_tokens
        self.max_tokens = max_tokens


class DuplicateRequestError(InvalidRequestError):
    def __init__(self, request_id: str) -> None:
        super().__init__("already in flight", field="request_id", request_id=request_id)


class InvalidGrammarError(InvalidRequestError):
    """The request's grammar (``GenerateOptions.grammar``) does not compile: an invalid JSON
    schema, EBNF or structural tag. Nothing was generated; the engine goes on serving."""

    def __init__(self, kind: str, detail: str, *, request_id: str | None = None) -> None:
        super().__init__(f"the {kind} grammar does not compile: {detail}", field="grammar",
                         request_id=request_id)
        self.kind = kind
        self.detail = detail


class CapacityError(EngineError):
    def __init__(self, max_batch: int, *, request_id: str | None = None) -> None:
        super().__init__(f"all {max_batch} decode slots are taken (request {request_id})")
        self.max_batch = max_batch
        self.request_id = request_id


class EngineStoppedError(EngineError):
    def __init__(self, request_id: str | None = None) -> None:
        super().__init__(f"the decode loop stopped (request {request_id})")
        self.request_id = request_id


class VersionUnavailableError(EngineError):
    """The request needs a newer weight version than the engine has active. Retryable: the
    version arrives with the next weight update."""

    retryable = True

    def __init__(
        self, min_version: int, current_version: int, *, request_id: str | None = None
    ) -> None:
        super().__init__(
            f"weight version {min_version} required, {current_version} is active "
            f"(request {request_id}); retry after the update"
        )
        self.min_version = min_version
        self.current_version = current_version
        self.request_id = request_id


class MemoryReleasedError(EngineError):
    """The engine's weights and KV are in host memory: the GPU scheduler lent its accelerator
    (``scheduler.lend_role_accelerators``). Retryable: on another worker now, or on this one once
    the scheduler takes the accelerator back and the memory is resumed."""

    retryable = True

    def __init__(self, *, request_id: str | None = None) -> None:
        super().__init__(f"the engine's memory is released, its accelerator lent (request {request_id}); "
                         "retryable: send it to another worker, or again after the memory is resumed")
        self.request_id = request_id


class EngineBusyError(EngineError):
    """Memory can be released only by an idle engine: ``active`` requests (or staged weights)
    still need it. The caller drains first (``LocalEngine.release_memory`` does)."""

    def __init__(self, active: int, reason: str) -> None:
        super().__init__(f"cannot release the engine's memory: {reason} ({active} requests active)")
        self.active = active
        self.reason = reason


class KvCapacityError(InvalidRequestError):
    """The prompt plus its token budget needs more KV blocks than the whole pool holds."""

    def __init__(self, blocks_needed: int, blocks_total: int, *, request_id: str | None = None) -> None:
        super().__init__(
            f"needs {blocks_needed} KV blocks, the pool has {blocks_total}; "
            "lower max_new_tokens or the prompt length",
            field="max_new_tokens", request_id=request_id,
        )
        self.blocks_needed = blocks_needed
        self.blocks_total = blocks_total


class DecodeStepError(EngineError):
    """A batched decode step raised; every request in that batch is failed with this error."""

    def __init__(self, weight_version: int, request_ids: list[str]) -> None:
        super().__init__(f"decode step failed at weight version {weight_version}")
        self.weight_version = weight_version
        self.request_ids = request_ids


class WeightsError(EngineError):
    def __init__(
        self, message: str, *, version: int | None = None, path: str | None = None
    ) -> None:
        super().__init__(message)
        self.version = version
        self.path = path


class WeightsMismatchError(WeightsError):
    def __init__(self, reason: str, *, version: int | None = None) -> None:
        super().__init__(
            f"weights version {version} do not fit the model: {reason}", version=version
        )
        self.reason = reason


class StaleWeightsError(WeightsError):
    def __init__(self, version: int, current_version: int) -> None:
        super().__init__(
            f"weights version {version} is older than active version {current_version}",
            version=version,
        )
        self.current_version = current_version


class WeightsChecksumError(WeightsError):
    def __init__(self, path: str, expected: str, actual: str) -> None:
        super().__init__(f"{path}: sha256 {actual}, expected {expected}", path=path)
        self.expected = expected
        self.actual = actual


class WeightsFileError(WeightsError):
    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"{path}: {reason}", path=path)
        self.reason = reason


class WeightsUnavailableError(WeightsError):
    """The shared-memory copy of a version cannot be read here (another node, its holder gone or
    restarted, the version released): the caller reads the files instead."""

    def __init__(self, version: int, reason: str) -> None:
        super().__init__(f"weights version {version} are not in shared memory here: {reason}", version=version)
        self.reason = reason


class WeightSyncError(WeightsError):
    """Pushing a version into SGLang servers without files (``method``: "nccl" or "ipc") failed;
    the trainer announces the version's files and the servers load those instead."""

    def __init__(self, version: int, method: str, reason: str) -> None:
        super().__init__(f"weights version {version} not pushed by {method}: {reason}", version=version)
        self.method = method
        self.reason = reason
