"""The few CUDA calls megatron-core makes unconditionally, answered on a machine without CUDA.

Knows torch only. megatron-core (0.16) builds models and saves ``torch_dist`` checkpoints on CPU
under a gloo process group, but its checkpoint saver calls ``torch.cuda.synchronize()`` and puts
a status tensor on ``torch.cuda.current_device()``. ``install_cpu_shims`` makes the first a no-op
and the second name the CPU, and only when CUDA is absent: on a GPU machine it changes nothing.
"""

from __future__ import annotations

import torch


def install_cpu_shims() -> bool:
    """True when the shims were installed (no CUDA here)."""
    if torch.cuda.is_available():
        return False
    torch.cuda.synchronize = lambda *args, **kwargs: None  # type: ignore[assignment]
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    return True
