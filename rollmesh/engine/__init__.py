"""rollmesh.engine: the torch reference inference engine and its seams.

Plain logic, no Ray and no NATS: the actor shells wrap ``PrefillEngine`` and ``DecodeLoop``.
"""

from rollmesh.engine.batch_loop import DecodeLoop
from rollmesh.engine.decode import DecodeEngine, DecodeStats, FinishedSequence
from rollmesh.engine.errors import (
    CapacityError,
    DecodeStepError,
    DuplicateRequestError,
    EngineError,
    EngineStoppedError,
    InvalidRequestError,
    PromptTooLongError,
    StaleWeightsError,
    WeightsChecksumError,
    WeightsError,
    WeightsFileError,
    WeightsMismatchError,
)
from rollmesh.engine.local_engine import LocalEngine
from rollmesh.engine.model import ModelShape, TinyDecoder, build_model
from rollmesh.engine.prefill import PrefillEngine, PrefillResult
from rollmesh.engine.protocols import Detokenizer, FinishReason, GenerationResult, InferenceEngine
from rollmesh.engine.sampling import sample_tokens
from rollmesh.engine.stopping import StopChecker
from rollmesh.engine.tokenizer import ByteTokenizer
from rollmesh.engine.weight_staging import WeightStager
from rollmesh.engine.weights import load_weights, save_weights

__all__ = [
    "ByteTokenizer",
    "CapacityError",
    "DecodeEngine",
    "DecodeLoop",
    "DecodeStats",
    "DecodeStepError",
    "Detokenizer",
    "DuplicateRequestError",
    "EngineError",
    "EngineStoppedError",
    "FinishReason",
    "FinishedSequence",
    "GenerationResult",
    "InferenceEngine",
    "InvalidRequestError",
    "LocalEngine",
    "ModelShape",
    "PrefillEngine",
    "PrefillResult",
    "PromptTooLongError",
    "StaleWeightsError",
    "StopChecker",
    "TinyDecoder",
    "WeightStager",
    "WeightsChecksumError",
    "WeightsError",
    "WeightsFileError",
    "WeightsMismatchError",
    "build_model",
    "load_weights",
    "sample_tokens",
    "save_weights",
]
