"""The chunked optimizer offload (``optimizer_offload.ChunkedOffloadAdamW``) under the megatron
backend (``trainer.optimizer_offload`` with ``trainer.precision = "bf16"``): the rank's bf16
parameters stay on its device, their fp32 master weights and Adam moments live in host memory
and visit the device in chunks during the step.

Knows megatron-core's DDP (gradients reduced into each parameter's ``main_grad``), its parallel
groups and parameter attributes, and the offload optimizer; nothing of losses, Ray or NATS.

How a step runs: megatron's DDP (``megatron_optimizer.wrap_data_parallel`` with bf16 gradient
buffers: the optimizer takes bf16 gradients, as the torch backend's bf16 path does) reduces the
gradients over DP into ``main_grad``; they become the parameters' ``.grad`` for the step; the
clip factor comes from the global gradient norm over the whole model (every TP and PP shard,
each tensor once: megatron's own filters for TP duplicates and a tied embedding's last-stage
copy), computed in fp32 from the bf16 gradients as ``optimizer_adamw.clip_scale`` does, and
all-reduced over megatron's model-parallel group; then the offload optimizer steps. Hand-rolled
rather than megatron's ``optimizer_cpu_offload`` (``HybridDeviceOptimizer``): that one needs the
distributed optimizer and runs Adam on the CPU, where ours keeps the arithmetic on the device and
is the torch backend's, bit for bit per element.

Dense models only: an MoE model's experts are reduced over other groups (expert data parallel),
whose norm megatron combines with a second optimizer of its chain; refused
(``megatron_backend``), not approximated.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from rollmesh.training.errors import OptimizerSetupError
from rollmesh.training.megatron_cpu_shims import megatron_cuda_on_cpu
from rollmesh.training.optimizer_adamw import AdamWConfig
from rollmesh.training.optimizer_offload import ChunkedOffloadAdamW


class MegatronOffloadAdamW(ChunkedOffloadAdamW):
    """``ChunkedOffloadAdamW`` over one DDP-wrapped megatron stage, stepping on DDP's reduced
    gradients with the model-wide clip (module docstring). ``megatron_step`` is what
    ``megatron_optimizer.step`` calls."""

    def __init__(self, ddp_model, *, lr: float, weight_decay: float, clip_grad: float,
                 device: torch.device | str, chunk_bytes: int | None = None) -> None:
        from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
        from megatron.core.transformer.module import param_is_not_shared

        named = [(name, param) for name, param in ddp_model.module.named_parameters() if param.requires_grad]
        for name, param in named:
            if not getattr(param, "allreduce", True):  # megatron marks expert parameters so
                raise OptimizerSetupError("an expert parameter: optimizer_offload takes dense models only",
                                          parameter=name)
        super().__init__(named, config=AdamWConfig(lr=lr, weight_decay=weight_decay), device=device,
                         chunk_bytes=chunk_bytes)
        self.clip_grad = clip_grad
        self._for_norm = [param for _, param in named
                          if param_is_not_shared(param) and param_is_not_tensor_parallel_duplicate(param)]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """DDP's buffers are zeroed by ``zero_grad_buffer``; the ``.grad`` views are dropped."""
        for _, param in self._named:
            param.grad = None

    def clip_grad_norm(self, max_norm: float) -> float:
        """The model-wide gradient norm (module docstring); the next ``step`` scales the
        gradients so it is at most ``max_norm`` (``optimizer_adamw.clip_scale``'s rule)."""
        from megatron.core import parallel_state

        squares = torch.zeros((), dtype=torch.float32, device=self.device)
        for param in self._for_norm:
            squares += param.main_grad.detach().float().pow(2).sum()
        dist.all_reduce(squares, group=parallel_state.get_model_parallel_group())
        norm = math.sqrt(float(squares))
        self._grad_scale = min(max_norm / (norm + 1e-6), 1.0)
        return norm

    def megatron_step(self) -> tuple[bool, float, None]:
        """One step on DDP's reduced gradients, clipped to ``clip_grad``; megatron's optimizer
        answer (succeeded, grad norm, zeros counted: None). A non-finite norm skips the step,
        as megatron's does."""
        with megatron_cuda_on_cpu():
            norm = self.clip_grad_norm(self.clip_grad)
        if not math.isfinite(norm):
            return False, norm, None
        for _, param in self._named:
            param.grad = param.main_grad  # a view of DDP's bf16 buffer, the parameter's shape
        try:
            self.step()
        finally:
            self.zero_grad()
        return True, norm, None


def peak_device_bytes(device: torch.device) -> int | None:
    """The device's peak allocated bytes since the last reset (CUDA's allocator), else None."""
    if device.type != "cuda":
        return None
    return int(torch.cuda.max_memory_allocated(device))
