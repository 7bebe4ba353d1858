"""The CUDA calls megatron-core makes unconditionally, answered on a machine without CUDA: the
process-wide shims (``install_cpu_shims``) and a torch function mode entered around megatron's
own calls (``megatron_cuda_on_cpu``). Both do nothing where CUDA is available.

Knows torch and the few megatron-core internals named below; nothing of models, losses or Ray.
Why: megatron-core (0.16) builds models, runs its schedules, DDP, optimizers and ``torch_dist``
checkpoint saves on CPU under a gloo process group, except for these calls.

Process-wide (``install_cpu_shims``, once per rank process):
- its checkpoint saver and pipeline p2p call ``torch.cuda.synchronize()`` and put tensors on
  ``torch.cuda.current_device()``: the first becomes a no-op, the second names the CPU;
- its forward forks the CUDA RNG tracker's "model-parallel-rng" state around dropout, a state
  that only a CUDA seed can register: forking becomes a no-op (no dropout here);
- its activation recompute (``tensor_parallel.checkpoint``) saves and restores the CUDA RNG
  state around each recomputed layer: with no CUDA generator there is none to keep, so getting
  it gives None and setting it does nothing (the CPU generator is still saved and restored);
- its MoE router's gating (``moe_utils.RouterGatingLinearFunction``) tests ``te_general_gemm``,
  a name only bound when Transformer Engine imports: without TE it raises NameError, so the
  name is bound to None (the plain ``torch.mm`` path).

Around a call (``megatron_cuda_on_cpu``): megatron writes ``device="cuda"`` into bookkeeping
tensors (the schedules' token counter, the grad-norm all-reduce, ``found_inf``,
``_dummy_overflow_buf``), moves tensors with ``.cuda()`` (the tied-embedding copy of a
pipeline's last stage, at model construction) and tests ``param.type() ==
"torch.cuda.FloatTensor"`` to tell fp32 parameters from half ones (the distributed optimizer's
shard builder, clip_grads). A torch function mode builds such tensors on the CPU, makes
``.cuda()`` return the tensor and names a CPU tensor's type as its CUDA twin's. Safe: on one CPU
"device" placement cannot differ, and the type string is only read to pick the fp32 branch,
never to convert. It costs a Python call per torch op: fine for CPU tests, never entered with
CUDA. (The core attention is ``megatron_attention.SdpaAttention``, which builds no default causal
mask: megatron's own builds it on "cuda".) On CUDA none of this applies: megatron's CUDA RNG
tracker is seeded instead (``megatron_devices.seed_model_parallel_rng``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.overrides import TorchFunctionMode


def install_cpu_shims() -> bool:
    """True when the shims were installed (no CUDA here)."""
    if torch.cuda.is_available():
        return False
    torch.cuda.synchronize = lambda *args, **kwargs: None  # type: ignore[assignment]
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    from megatron.core.tensor_parallel import random as megatron_random

    megatron_random.CudaRNGStatesTracker.fork = lambda self, name=None: contextlib.nullcontext()
    megatron_random._get_cuda_rng_state = lambda *args, **kwargs: None
    megatron_random._set_cuda_rng_state = lambda *args, **kwargs: None
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    return True


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
    docstring); with CUDA, nothing changes. Yields whether the mode is active."""
    if torch.cuda.is_available():
        yield False
        return
    with _CudaOnCpu():
        yield True
