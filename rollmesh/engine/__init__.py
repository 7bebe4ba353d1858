"""rollmesh.engine: the torch inference engine (paged KV, continuous batching, sessions, weight
swaps) and its seams. Models and tokenizers come from a Hugging Face directory (``model.path``).

Plain logic, no Ray and no NATS: the actor shells wrap ``PrefillEngine`` and ``DecodeLoop``. The
SGLang backend (``sglang_backend``) is imported from its module, not from here.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# Each public name is imported from its module on first use, not here: importing any
# ``rollmesh.engine.<module>`` runs this file first, and most callers (the GPU scheduler, the
# rollout workers, the Serve app) want an error class or a config reader, not torch (~3 s to import
# on the test machine, paid again by every Ray worker process of every mesh).
if TYPE_CHECKING:
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

_PUBLIC_MODULES = {
    "CapacityError": "rollmesh.engine.errors",
    "DecodeEngine": "rollmesh.engine.decode",
    "DecodeLoop": "rollmesh.engine.batch_loop",
    "DecodeStats": "rollmesh.engine.decode",
    "DecodeStepError": "rollmesh.engine.errors",
    "Detokenizer": "rollmesh.engine.protocols",
    "DuplicateRequestError": "rollmesh.engine.errors",
    "EngineBusyError": "rollmesh.engine.errors",
    "EngineError": "rollmesh.engine.errors",
    "EngineStoppedError": "rollmesh.engine.errors",
    "FinishReason": "rollmesh.engine.protocols",
    "GenerateOptions": "rollmesh.engine.protocols",
    "GenerationResult": "rollmesh.engine.protocols",
    "GrammarSpec": "rollmesh.engine.protocols",
    "InferenceEngine": "rollmesh.engine.protocols",
    "InvalidGrammarError": "rollmesh.engine.errors",
    "InvalidRequestError": "rollmesh.engine.errors",
    "KvBlockPool": "rollmesh.engine.kv_pages",
    "KvCapacityError": "rollmesh.engine.errors",
    "KvLayout": "rollmesh.engine.kv_pages",
    "LocalEngine": "rollmesh.engine.local_engine",
    "MemoryMoveStats": "rollmesh.engine.memory_release",
    "MemoryReleasedError": "rollmesh.engine.errors",
    "PagedAttention": "rollmesh.engine.kv_pages",
    "PagedCausalModel": "rollmesh.engine.paged_model",
    "PrefillEngine": "rollmesh.engine.prefill",
    "PrefillResult": "rollmesh.engine.prefill",
    "PromptTooLongError": "rollmesh.engine.errors",
    "SessionCache": "rollmesh.engine.session_cache",
    "StaleWeightsError": "rollmesh.engine.errors",
    "StopChecker": "rollmesh.engine.stopping",
    "VersionUnavailableError": "rollmesh.engine.errors",
    "WeightStager": "rollmesh.engine.weight_staging",
    "WeightsChecksumError": "rollmesh.engine.errors",
    "WeightsError": "rollmesh.engine.errors",
    "WeightsFileError": "rollmesh.engine.errors",
    "WeightsMismatchError": "rollmesh.engine.errors",
    "build_inference_model": "rollmesh.engine.paged_model",
    "load_tokenizer": "rollmesh.engine.paged_model",
    "load_weights": "rollmesh.engine.weights",
    "sample_tokens": "rollmesh.engine.sampling",
    "save_weights": "rollmesh.engine.weights",
}

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
    module = _PUBLIC_MODULES.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module), name)
        globals()[name] = value  # looked up once
        return value
    # Deprecated alias of GenerationResult (rollmesh.engine.decode_state says why); goes after one release.
    if name == "FinishedSequence":
        from rollmesh.engine import decode_state

        return decode_state.__getattr__(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
