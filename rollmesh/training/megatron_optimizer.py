"""megatron-core's data-parallel wrapper (``DistributedDataParallel``) and optimizer
(``get_megatron_optimizer``: AdamW, optionally the distributed optimizer that shards the fp32
moments over data-parallel ranks), set up to step as ``torch.optim.AdamW`` does, on GPUs or on
CPU under gloo.

Knows megatron-core's distributed and optimizer packages and torch; nothing of losses, HF names,
Ray or NATS. Every function is a collective over the model's parallel groups (all ranks call it).

What CPU needs (``megatron_cuda_on_cpu``): megatron (0.16) writes ``device="cuda"`` into its
bookkeeping tensors (the schedules' token counter, the grad-norm all-reduce, ``found_inf``,
``_dummy_overflow_buf``), moves tensors with ``.cuda()`` (the tied-embedding copy of a pipeline's
last stage, at model construction) and tests ``param.type() == "torch.cuda.FloatTensor"`` to
tell fp32 parameters from half ones (the distributed optimizer's shard builder, clip_grads).
Without CUDA a torch function mode, active only around megatron's own calls, builds such
tensors on the CPU, makes ``.cuda()`` return the tensor and names a CPU tensor's type as its
CUDA twin's. Safe: on one CPU "device" placement cannot differ, and the type string is only
read to pick the fp32 branch, never to convert. On a machine with CUDA the mode is not entered.
Without Transformer Engine or Apex megatron itself falls back to ``torch.optim.AdamW`` (its
"adam" is decoupled-weight-decay Adam, as Apex's FusedAdam) and to plain-torch
``multi_tensor_applier``/l2-norm/scale, which run on CPU unchanged.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.overrides import TorchFunctionMode

# torch.optim.AdamW's defaults: the torch backend steps with them.
ADAMW_BETAS = (0.9, 0.999)
ADAMW_EPS = 1e-8


class MegatronOptimizerError(RuntimeError):
    """megatron's optimizer refused a step: ``reason`` says why (e.g. non-finite gradients)."""

    def __init__(self, reason: str, *, grad_norm: float | None) -> None:
        super().__init__(f"{reason} (grad norm {grad_norm})")
        self.reason = reason
        self.grad_norm = grad_norm


class _CudaOnCpu(TorchFunctionMode):
    """Module docstring: CUDA placements and type names answered on the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "cuda":
            kwargs = {**kwargs, "device": "cpu"}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            # Only the no-argument form (a query); .type(dtype) converts and is left alone.
            name = func(*args)
            return name if ".cuda." in name else name.replace("torch.", "torch.cuda.", 1)
        return func(*args, **kwargs)


@contextlib.contextmanager
def megatron_cuda_on_cpu() -> Iterator[bool]:
    """Around a megatron-core call: without CUDA, its CUDA placements land on the CPU (module
    docstring); with CUDA, nothing changes. Yields whether the shim is active."""
    if torch.cuda.is_available():
        yield False
        return
    with _CudaOnCpu():
        yield True


def wrap_data_parallel(model: torch.nn.Module, *, distributed_optimizer: bool = True):
    """``model`` (a GPTModel stage) in megatron's ``DistributedDataParallel``: gradients go to
    one contiguous fp32 buffer, reduced over data-parallel ranks after the backward (a
    reduce-scatter with the distributed optimizer, an all-reduce without) by
    ``finalize_model_grads``, which megatron's schedules call. No overlap of the reduction with
    the backward (``overlap_grad_reduce`` needs CUDA streams), one bucket."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, overlap_param_gather=False,
        use_distributed_optimizer=distributed_optimizer)
    with megatron_cuda_on_cpu():
        return DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model)


def build_adamw(ddp_models: list, *, lr: float, weight_decay: float, clip_grad: float,
                distributed_optimizer: bool = True, betas: tuple[float, float] = ADAMW_BETAS,
                eps: float = ADAMW_EPS):
    """megatron's fp32 Adam(W) over ``ddp_models`` (the chunks ``wrap_data_parallel`` made),
    stepping as ``torch.optim.AdamW(lr, betas, eps, weight_decay)`` with
    ``clip_grad_norm_(clip_grad)`` before it: weight decay on every parameter (megatron's default
    skips biases and 1-D weights; the torch backend decays them all), a constant learning rate
    (no scheduler), the clip over the gradient norm of the whole model (every TP/PP/DP shard)."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    config = OptimizerConfig(
        optimizer="adam", lr=lr, min_lr=lr, weight_decay=weight_decay, adam_beta1=betas[0],
        adam_beta2=betas[1], adam_eps=eps, clip_grad=clip_grad, bf16=False, fp16=False,
        params_dtype=torch.float32, use_distributed_optimizer=distributed_optimizer)
    with megatron_cuda_on_cpu():
        # config_overrides={} (not None): no per-parameter weight-decay exceptions.
        return get_megatron_optimizer(config, ddp_models, config_overrides={})


def zero_grads(ddp_models: list, optimizer) -> None:
    """Clear the gradient buffers before a forward/backward (megatron accumulates into them)."""
    with megatron_cuda_on_cpu():
        for model in ddp_models:
            model.zero_grad_buffer()
        optimizer.zero_grad()


def step(optimizer) -> float:
    """One optimizer step on the reduced gradients (clipped first); the gradient norm before
    clipping. With the distributed optimizer each rank steps its shard of the fp32 weights and
    the updated parameters are all-gathered back into every rank's model."""
    with megatron_cuda_on_cpu():
        succeeded, grad_norm, _ = optimizer.step()
    if not succeeded:
        raise MegatronOptimizerError("megatron skipped the step", grad_norm=grad_norm)
    return float(grad_norm)


def describe(optimizer) -> dict[str, object]:
    """What this rank's optimizer holds: megatron's optimizer classes, the torch optimizer under
    them, and how many fp32 elements its Adam moments cover (the distributed optimizer: this
    rank's shard, about 1/DP of the stage's parameters)."""
    parts = getattr(optimizer, "chained_optimizers", [optimizer])
    inner = [part.optimizer for part in parts]
    moments = sum(state["exp_avg"].numel() for torch_optimizer in inner for state in torch_optimizer.state.values()
                  if "exp_avg" in state)
    return {"classes": [type(part).__name__ for part in parts],
            "torch_optimizers": [type(torch_optimizer).__name__ for torch_optimizer in inner],
            "moment_elements": moments}
