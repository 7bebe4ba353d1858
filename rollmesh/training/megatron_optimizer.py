"""megatron-core's data-parallel wrapper (``DistributedDataParallel``) and optimizer
(``get_megatron_optimizer``: AdamW, optionally the distributed optimizer that shards the fp32
moments over data-parallel ranks), set up to step as ``torch.optim.AdamW`` does, on GPUs or on
CPU under gloo, and each rank's part of the optimizer's state for an exact resume.

Knows megatron-core's distributed and optimizer packages and torch; nothing of losses, HF names,
Ray or NATS. Every function but the state ones is a collective over the model's parallel groups
(all ranks call it). Without CUDA every megatron call runs inside
``megatron_cpu_shims.megatron_cuda_on_cpu``; without Transformer Engine or Apex megatron itself
falls back to ``torch.optim.AdamW`` (its "adam" is decoupled-weight-decay Adam, as Apex's
FusedAdam) and to plain-torch ``multi_tensor_applier``/l2-norm/scale, which run on CPU unchanged.
Verified on CPU under gloo (the megatron backend's tests): both optimizers at TP, PP, DP and EP
layouts step as torch's AdamW with torch's clip, and resume bit for bit from ``optimizer_state``.

bf16 (``trainer.precision = "bf16"``): bf16 parameters, fp32 gradient buffers and megatron's
mixed-precision optimizer (fp32 main parameters and moments; ``Float16OptimizerWithFloat16Params``,
or the distributed optimizer's fp32 shards). With ``trainer.optimizer_offload`` the optimizer is
``megatron_offload.MegatronOffloadAdamW`` instead (bf16 gradient buffers, fp32 state in host
memory); the functions below take either.
"""

from __future__ import annotations

from typing import Any

import torch

from rollmesh.training.errors import MegatronOptimizerError
from rollmesh.training.megatron_cpu_shims import megatron_cuda_on_cpu

# torch.optim.AdamW's defaults: the torch backend steps with them.
ADAMW_BETAS = (0.9, 0.999)
ADAMW_EPS = 1e-8


def wrap_data_parallel(model: torch.nn.Module, *, distributed_optimizer: bool = True,
                       grad_reduce_in_fp32: bool = True):
    """``model`` (a GPTModel stage) in megatron's ``DistributedDataParallel``: gradients go to
    one contiguous fp32 buffer (experts' to one of their own), reduced after the backward over
    the data-parallel ranks (experts': the expert-data-parallel ranks) by
    ``finalize_model_grads``, which megatron's schedules call: a reduce-scatter with the
    distributed optimizer, an all-reduce without. No overlap of the reduction with the backward
    (``overlap_grad_reduce`` needs CUDA streams), one bucket. ``grad_reduce_in_fp32`` False: the
    buffers in the parameters' dtype (bf16 for the offload optimizer, which takes bf16 gradients)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=grad_reduce_in_fp32, overlap_grad_reduce=False, overlap_param_gather=False,
        use_distributed_optimizer=distributed_optimizer)
    with megatron_cuda_on_cpu():
        return DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model)


def build_adamw(ddp_models: list, *, lr: float, weight_decay: float, clip_grad: float,
                distributed_optimizer: bool = True, betas: tuple[float, float] = ADAMW_BETAS,
                eps: float = ADAMW_EPS, dtype: torch.dtype = torch.float32):
    """megatron's fp32 Adam(W) over ``ddp_models`` (the chunks ``wrap_data_parallel`` made),
    stepping as ``torch.optim.AdamW(lr, betas, eps, weight_decay)`` with
    ``clip_grad_norm_(clip_grad)`` before it: weight decay on every parameter (megatron's default
    skips biases and 1-D weights; the torch backend decays them all), a constant learning rate
    (no scheduler), the clip over the gradient norm of the whole model (every TP/PP/DP/EP shard).
    An MoE model gets megatron's chain of two: the dense parameters' and the experts'.
    ``dtype`` bf16: the model's parameters are bf16 and megatron keeps fp32 main parameters."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    config = OptimizerConfig(
        optimizer="adam", lr=lr, min_lr=lr, weight_decay=weight_decay, adam_beta1=betas[0],
        adam_beta2=betas[1], adam_eps=eps, clip_grad=clip_grad, bf16=dtype == torch.bfloat16, fp16=False,
        params_dtype=dtype, use_distributed_optimizer=distributed_optimizer)
    with megatron_cuda_on_cpu():
        # config_overrides={} (not None): no per-parameter weight-decay exceptions.
        return get_megatron_optimizer(config, ddp_models, config_overrides={})


def zero_grads(ddp_models: list, optimizer) -> None:
    """Clear the gradient buffers before a forward/backward (megatron accumulates into them)."""
    with megatron_cuda_on_cpu():
        for model in ddp_models:
            model.zero_grad_buffer()
        optimizer.zero_grad()  # the offload optimizer's too: it drops its .grad views


def step(optimizer) -> float:
    """One optimizer step on the reduced gradients (clipped first); the gradient norm before
    clipping. With the distributed optimizer each rank steps its shard of the fp32 weights and
    the updated parameters are all-gathered back into every rank's model."""
    with megatron_cuda_on_cpu():
        succeeded, grad_norm, _ = optimizer.megatron_step() if _offloaded(optimizer) else optimizer.step()
    if not succeeded:
        raise MegatronOptimizerError("megatron skipped the step", grad_norm=grad_norm)
    return float(grad_norm)


def _offloaded(optimizer) -> bool:
    from rollmesh.training.megatron_offload import MegatronOffloadAdamW

    return isinstance(optimizer, MegatronOffloadAdamW)


def _parts(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _is_distributed(part) -> bool:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return isinstance(part, DistributedOptimizer)


def _cloned(value: Any) -> Any:
    """``value`` with every tensor in it copied: megatron hands out its live state."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {key: _cloned(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_cloned(item) for item in value)
    return value


def optimizer_state(optimizer) -> list[dict[str, Any]] | None:
    """This rank's part of ``optimizer``'s state, a copy (no collective), or None before its
    first step (nothing to keep: a fresh optimizer is the same). Per part of megatron's chain:
    its ``state_dict()`` (param groups, step) and, for the distributed optimizer, this rank's
    shard of the fp32 weights and moments (``get_parameter_state_dp_reshardable``: bucket
    space, no gather; loading checks the buckets' sizes)."""
    if _offloaded(optimizer):  # its own state dict: host tensors, a copy
        return None if optimizer.steps == 0 else [{"offload": optimizer.state_dict()}]
    parts = _parts(optimizer)
    if not any(part.optimizer.state for part in parts):
        return None
    out = []
    for part in parts:
        entry = {"state_dict": _cloned(part.state_dict())}
        if _is_distributed(part):
            entry["shards"] = _cloned(part.get_parameter_state_dp_reshardable())
        out.append(entry)
    return out


def load_optimizer_state(optimizer, state: list[dict[str, Any]] | None) -> None:
    """Restore ``optimizer_state`` into an optimizer of the same layout, built on the same
    weights (``None``: leave it fresh). No collective."""
    if state is None:
        return
    if _offloaded(optimizer) != ("offload" in state[0]):
        raise MegatronOptimizerError("an optimizer state of the offload optimizer loaded into megatron's, "
                                     "or the other way round")
    if _offloaded(optimizer):
        optimizer.load_state_dict(state[0]["offload"])
        return
    parts = _parts(optimizer)
    if len(parts) != len(state) or any(_is_distributed(part) != ("shards" in entry)
                                       for part, entry in zip(parts, state, strict=False)):
        raise MegatronOptimizerError(f"an optimizer state of {len(state)} parts loaded into {len(parts)} "
                                     "(or distributed into plain)")
    # no_grad: the fp32 shards it copies into are views of the parameters themselves.
    with megatron_cuda_on_cpu(), torch.no_grad():
        for part, entry in zip(parts, state, strict=True):
            part.load_state_dict(_cloned(entry["state_dict"]))
            # Without Apex/TE the distributed optimizer's loader gives every parameter's state
            # the SAME "step" tensor, which torch's AdamW then increments in place once per
            # parameter: each gets its own, or the bias corrections would run ahead.
            for parameter_state in part.optimizer.state.values():
                if isinstance(parameter_state.get("step"), torch.Tensor):
                    parameter_state["step"] = parameter_state["step"].clone()
            if "shards" in entry:
                shards = _cloned(entry["shards"])
                # The loader skips bucket-padding entries, which only megatron's sharded
                # checkpoint format adds ("padding": True); the getter's entries are all params.
                for key, buffers in shards.items():
                    if isinstance(key, int):
                        for buckets in buffers.values():
                            for bucket in buckets:
                                for tensors in bucket:
                                    tensors.setdefault("padding", False)
                part.load_parameter_state_from_dp_reshardable(shards)


def describe(optimizer) -> dict[str, object]:
    """What this rank's optimizer holds: megatron's optimizer classes, the torch optimizer under
    them, and how many fp32 elements its Adam moments cover (the distributed optimizer: this
    rank's shard, about 1/DP of the stage's parameters)."""
    if _offloaded(optimizer):
        return {"classes": [type(optimizer).__name__], "torch_optimizers": [],
                "moment_elements": optimizer.statistics().host_bytes // 12 if optimizer.statistics() else 0}
    inner = [part.optimizer for part in _parts(optimizer)]
    moments = sum(state["exp_avg"].numel() for torch_optimizer in inner for state in torch_optimizer.state.values()
                  if "exp_avg" in state)
    return {"classes": [type(part).__name__ for part in _parts(optimizer)],
            "torch_optimizers": [type(torch_optimizer).__name__ for torch_optimizer in inner],
            "moment_elements": moments}
