"""The few CUDA calls megatron-core makes unconditionally, answered on a machine without CUDA.

Knows torch and megatron-core's RNG tracker. megatron-core (0.16) builds models, runs their
forward and saves ``torch_dist`` checkpoints on CPU under a gloo process group, but:
- its checkpoint saver calls ``torch.cuda.synchronize()`` and puts a status tensor on
  ``torch.cuda.current_device()``: the first becomes a no-op, the second names the CPU;
- its forward forks the CUDA RNG tracker's "model-parallel-rng" state around dropout, a state
  that only a CUDA seed can register: forking becomes a no-op (CPU runs here are deterministic
  evaluations with no dropout);
- its activation recompute (``tensor_parallel.checkpoint``) saves and restores the CUDA RNG
  state around each recomputed layer: with no CUDA generator there is none to keep, so getting
  it gives None and setting it does nothing (the CPU generator is still saved and restored);
- its MoE router's gating (``moe_utils.RouterGatingLinearFunction``) tests ``te_general_gemm``,
  a name only bound when Transformer Engine imports: without TE it raises NameError, so the
  name is bound to None (the plain ``torch.mm`` path).
Installed only when CUDA is absent: on a GPU machine ``install_cpu_shims`` changes nothing.
(Callers pass an explicit attention mask: the default causal mask is built on "cuda".)
"""

from __future__ import annotations

import contextlib

import torch


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
