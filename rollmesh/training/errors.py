"""Errors of the training package, one tree under ``TrainingError``. Knows the standard library
and the checkpoint package's errors (a Megatron checkpoint write is also a checkpoint write).

    TrainingError
    ├── OptimizerError(parameter)                    the optimizers (adamw, chunked offload, megatron offload)
    │   ├── OptimizerSetupError(reason)              a parameter the optimizer cannot take
    │   └── MissingGradientError(step)               a parameter has no gradient when the step runs
    ├── PackingError(index, reason), ValueError      an example that cannot be packed
    │   └── SequenceTooLongError(length, max_seq_len)
    ├── RouterReplayError(sample), ValueError        recorded routes that cannot be replayed
    │   ├── RoutedRowsShapeError(shape, dtype, expected)
    │   ├── ExpertIdError(expert_id, num_experts)
    │   └── RowsAlignmentError(rows, tokens)
    ├── LossInputsError(missing), ValueError         a loss term without the tensor it needs
    ├── ConversationError(reason, message_index), ValueError   not one supervised sequence
    ├── TrainerOffloadedError(operation), RuntimeError         the torch trainer's memory is lent
    ├── RankPlacementError(variable), ValueError     the launcher's variables do not place a rank
    ├── TooManyRanksError(ranks_on_node, gpus), RuntimeError
    ├── MegatronRanksError(rank, method, detail), RuntimeError a megatron rank failed a call
    ├── MegatronOptimizerError(reason, grad_norm), RuntimeError
    ├── PipelineLayoutError(field), ValueError       microbatches the pipeline cannot run
    ├── UnsupportedMegatronModelError(field, path), ValueError
    └── (also CheckpointWriteError) a Megatron checkpoint not written:
        UnmappableModelError(model_type, field), StateDictMismatchError(missing, unexpected),
        ConflictingArgsError(names)

The builtin second bases stay because callers catch them (``except ValueError``). The modules
that raise an error still import it, so ``rollmesh.training.packing.PackingError`` keeps working.
"""

from __future__ import annotations

from rollmesh.checkpoint.errors import CheckpointWriteError


class TrainingError(Exception):
    """Root of the tree: ``except TrainingError`` catches every error the training package raises.
    Defines no ``__init__``, so each error's own fields and its other base's constructor apply."""


# Raised by optimizer_adamw.py, optimizer_offload.py and megatron_offload.py.
class OptimizerError(TrainingError):
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


# Raised by packing.py.
class PackingError(TrainingError, ValueError):
    """An example that cannot be packed: ``index`` in the caller's list, ``reason`` why."""

    def __init__(self, reason: str, *, index: int) -> None:
        super().__init__(f"example {index}: {reason}")
        self.index = index
        self.reason = reason


class SequenceTooLongError(PackingError):
    """An example longer than a whole row: the caller decides whether to drop, cut or fail."""

    def __init__(self, *, index: int, length: int, max_seq_len: int) -> None:
        super().__init__(f"{length} tokens > max_seq_len {max_seq_len}", index=index)
        self.length = length
        self.max_seq_len = max_seq_len


# Raised by router_replay.py.
class RouterReplayError(TrainingError, ValueError):
    """Recorded routes that cannot be replayed.

        RouterReplayError(sample)
        ├── RoutedRowsShapeError(shape, dtype, expected)   not integer [rows, sparse layers, top_k]
        ├── ExpertIdError(expert_id, num_experts)          an id out of range, or repeated in a row
        └── RowsAlignmentError(rows, tokens)               not one row per training input position

    ``sample`` is the sample's index in the batch, or None when unknown.
    """

    def __init__(self, message: str, *, sample: int | None) -> None:
        where = f"sample {sample}: " if sample is not None else ""
        super().__init__(where + message)
        self.sample = sample


class RoutedRowsShapeError(RouterReplayError):
    def __init__(self, *, shape: tuple[int, ...], dtype: str, expected: tuple[int, int],
                 sample: int | None) -> None:
        super().__init__(f"routed rows {shape} of {dtype}, expected integer ids "
                         f"[rows, {expected[0]}, {expected[1]}]", sample=sample)
        self.shape = shape
        self.dtype = dtype
        self.expected = expected


class ExpertIdError(RouterReplayError):
    def __init__(self, reason: str, *, expert_id: int, num_experts: int, sample: int | None) -> None:
        super().__init__(f"expert id {expert_id}: {reason} ({num_experts} experts)", sample=sample)
        self.reason = reason
        self.expert_id = expert_id
        self.num_experts = num_experts


class RowsAlignmentError(RouterReplayError):
    def __init__(self, *, rows: int, tokens: int, sample: int | None) -> None:
        super().__init__(f"{rows} routed rows for {tokens} tokens; the engine records one per "
                         f"position but the last ({max(tokens - 1, 0)})", sample=sample)
        self.rows = rows
        self.tokens = tokens


# Raised by losses.py.
class LossInputsError(TrainingError, ValueError):
    """A loss term was asked for without the tensor it needs (``missing`` names it)."""

    def __init__(self, message: str, *, missing: str) -> None:
        super().__init__(message)
        self.missing = missing


# Raised by megatron_devices.py.
class RankPlacementError(TrainingError, ValueError):
    """The launcher's variables do not place this rank: ``variable`` names the one in the way."""

    def __init__(self, reason: str, *, variable: str) -> None:
        super().__init__(f"{variable}: {reason}")
        self.variable = variable


class TooManyRanksError(TrainingError, RuntimeError):
    """More megatron ranks on one node (``ranks_on_node``) than GPUs there (``gpus``): one GPU
    per rank, so the layout needs more nodes or fewer ranks (``trainer.megatron``)."""

    def __init__(self, *, ranks_on_node: int, gpus: int) -> None:
        super().__init__(f"{ranks_on_node} megatron ranks on this node but {gpus} GPUs visible: one GPU per "
                         "rank (lower trainer.megatron's TP x PP x DP, or spread the ranks over more nodes)")
        self.ranks_on_node = ranks_on_node
        self.gpus = gpus


# Raised by megatron_model.py.
class UnsupportedMegatronModelError(TrainingError, ValueError):
    """An HF model this backend does not build: ``field`` is the HF config field in the way."""

    def __init__(self, reason: str, *, field: str, path: str) -> None:
        super().__init__(f"{path}: {field}: {reason}")
        self.field = field
        self.path = path


# Raised by megatron_optimizer.py.
class MegatronOptimizerError(TrainingError, RuntimeError):
    """megatron's optimizer refused a step or a state: ``reason`` says why (e.g. non-finite
    gradients, a state of another layout)."""

    def __init__(self, reason: str, *, grad_norm: float | None = None) -> None:
        super().__init__(reason if grad_norm is None else f"{reason} (grad norm {grad_norm})")
        self.reason = reason
        self.grad_norm = grad_norm


# Raised by megatron_pipeline.py.
class PipelineLayoutError(TrainingError, ValueError):
    """Microbatches the pipeline cannot run: ``field`` names what is in the way."""

    def __init__(self, reason: str, *, field: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field


# Raised by megatron_ranks.py.
class MegatronRanksError(TrainingError, RuntimeError):
    """A rank failed ``method`` (raised, died or timed out); ``detail`` is its traceback or why."""

    def __init__(self, *, rank: int, method: str, detail: str) -> None:
        last_line = detail.strip().splitlines()[-1] if detail.strip() else ""
        super().__init__(f"megatron rank {rank} failed {method}: {last_line}")
        self.rank = rank
        self.method = method
        self.detail = detail


# Raised by torch_backend.py.
class TrainerOffloadedError(TrainingError, RuntimeError):
    """A step, a save or a weight read while the trainer's memory is in host memory
    (``TorchTrainerBackend.offload``): ``reload`` first. ``operation`` names what was called."""

    def __init__(self, operation: str) -> None:
        super().__init__(f"{operation}: the trainer's memory is offloaded (its accelerator lent); reload first")
        self.operation = operation


# Raised by warm_start.py.
class ConversationError(TrainingError, ValueError):
    """A conversation that cannot be one supervised sequence: no assistant turn, not ending with
    one, or an assistant turn whose written text does not parse back into its own tool calls."""

    def __init__(self, reason: str, *, message_index: int | None = None) -> None:
        where = f" (message {message_index})" if message_index is not None else ""
        super().__init__(f"{reason}{where}")
        self.reason = reason
        self.message_index = message_index


# Raised by megatron_checkpoint.py.
class UnmappableModelError(TrainingError, CheckpointWriteError):
    """An HF model the Megatron maps cannot express exactly: ``field`` is the HF config field
    (e.g. ``attention_bias``, ``mlp_only_layers``) whose value no Megatron checkpoint of the
    family reproduces through ``export_to_hf``."""

    def __init__(self, reason: str, *, model_type: str, field: str, path: str) -> None:
        super().__init__(f"{model_type}: {field}: {reason}", path=path)
        self.model_type = model_type
        self.field = field


class StateDictMismatchError(TrainingError, CheckpointWriteError):
    """The state dict is not the model's: HF tensors it lacks (``missing``) or that no Megatron
    tensor would keep (``unexpected``; dropping them would save a different model)."""

    def __init__(self, *, missing: list[str], unexpected: list[str], path: str) -> None:
        super().__init__(f"state dict does not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}",
                         path=path)
        self.missing = missing
        self.unexpected = unexpected


class ConflictingArgsError(TrainingError, CheckpointWriteError):
    """``extra_args`` set architecture arguments (``names``) to other values than the model's."""

    def __init__(self, *, names: list[str], path: str) -> None:
        super().__init__(f"extra_args contradict the model's arguments: {', '.join(names)}", path=path)
        self.names = names
