"""rollmesh.engine: the torch inference engine (paged KV, continuous batching, sessions, weight
swaps) and its seams. Models and tokenizers come from a Hugging Face directory (``model.path``).

Plain logic, no Ray and no NATS: the actor shells wrap ``PrefillEngine`` and ``DecodeLoop``. The
SGLang backend (``sglang_backend``) is imported from its module, not from here.
"""

from rollmesh.engine.batch_loop import DecodeLoop
from rollmesh.engine.decode import DecodeEngine, DecodeStats
from rollmesh.engine.errors import (
    CapacityError,
    DecodeStepError,
    DuplicateRequestError,
    EngineBusyError,
    EngineError,
    EngineStoppedError,
    InvalidGrammarError,
    InvalidRequestError,
    KvCapacityError,
    MemoryReleasedError,
    PromptTooLongError,
    StaleWeightsError,
    WeightsChecksumError,
    WeightsError,
    WeightsFileError,
    VersionUnavailableError,
    WeightsMismatchError,
)
from rollmesh.engine.kv_pages import KvBlockPool, KvLayout, PagedAttention
from rollmesh.engine.local_engine import LocalEngine
from rollmesh.engine.memory_release import MemoryMoveStats
from rollmesh.engine.prefill import PrefillEngine, PrefillResult
from rollmesh.engine.paged_model import PagedCausalModel, build_inference_model, load_tokenizer
from rollmesh.engine.protocols import (
    Detokenizer,
    FinishReason,
    GenerateOptions,
    GenerationResult,
    GrammarSpec,
    InferenceEngine,
)
from rollmesh.engine.session_cache import SessionCache
from rollmesh.engine.sampling import sample_tokens
from rollmesh.engine.stopping import StopChecker
from rollmesh.engine.weight_staging import WeightStager
from rollmesh.engine.weights import load_weights, save_weights

__all__ = [
    "CapacityError",
    "DecodeEngine",
    "DecodeLoop",
    "DecodeStats",
    "DecodeStepError",
    "Detokenizer",
    "DuplicateRequestError",
    "EngineBusyError",
    "EngineError",
    "EngineStoppedError",
    "FinishReason",
    "GenerateOptions",
    "GenerationResult",
    "GrammarSpec",
    "InferenceEngine",
    "InvalidGrammarError",
    "InvalidRequestError",
    "KvBlockPool",
    "KvCapacityError",
    "KvLayout",
    "LocalEngine",
    "MemoryMoveStats",
    "MemoryReleasedError",
    "PagedAttention",
    "PagedCausalModel",
    "PrefillEngine",
    "PrefillResult",
    "PromptTooLongError",
    "SessionCache",
    "StaleWeightsError",
    "StopChecker",
    "VersionUnavailableError",
    "WeightStager",
    "WeightsChecksumError",
    "WeightsError",
    "WeightsFileError",
    "WeightsMismatchError",
    "build_inference_model",
    "load_tokenizer",
    "load_weights",
    "sample_tokens",
    "save_weights",
]


def __getattr__(name: str) -> object:
    # Deprecated alias of GenerationResult (rollmesh.engine.decode_state says why); goes after one release.
    if name == "FinishedSequence":
        from rollmesh.engine import decode_state

        return decode_state.__getattr__(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
