"""Mixed-precision AdamW: the per-element update both optimizers share, and the plain reference.

Precision is that of large-scale training: parameters and gradients in bf16 on the device, fp32
master weights and Adam moments. The plain optimizer keeps all of it on the device; the chunked
offload variant (``optimizer_offload``) keeps the fp32 state in host memory and runs the very same
``adamw_update_`` on chunks of it, which is what makes the two bit-identical.
Knows torch and the device-memory account; nothing of models, Ray or NATS.

Hand-rolled rather than ``torch.optim.AdamW`` because bit-exactness across chunkings needs each
element's bits not to depend on where it sits in a tensor. torch's ``lerp_``/``addcmul_``/
``addcdiv_`` are fused kernels with separate vectorised and scalar-tail code, and whether each is
contracted into FMA is up to the compiler; a chunk boundary moves elements between the two. (On
torch 2.13 for x86 CPU they happen to agree, tested; nothing promises it elsewhere.) Plain
``mul``/``add``/``sqrt``/``div`` round once per element, as IEEE requires, on CPU and CUDA alike.
The price: 14 passes over the state instead of torch's 8.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Annotated, NamedTuple

import msgspec
import torch

from rollmesh.training.device_memory import DeviceMemoryAccount
from rollmesh.training.errors import MissingGradientError, OptimizerSetupError


class AdamWConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    lr: Annotated[float, msgspec.Meta(gt=0)] = 1e-4
    beta1: Annotated[float, msgspec.Meta(ge=0, lt=1)] = 0.9
    beta2: Annotated[float, msgspec.Meta(ge=0, lt=1)] = 0.999
    eps: Annotated[float, msgspec.Meta(gt=0)] = 1e-8
    weight_decay: Annotated[float, msgspec.Meta(ge=0)] = 0.01


class AdamWState(NamedTuple):
    """One parameter's fp32 state, flat (``numel`` elements), wherever it lives."""

    master: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor


def adamw_update_(master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                  grad: torch.Tensor, scratch: torch.Tensor, *, step: int, config: AdamWConfig) -> None:
    """One AdamW step, in place, on fp32 tensors of one shape: decoupled weight decay, then
    Adam with bias correction. ``grad`` is consumed (overwritten); ``scratch`` is workspace.

    Every op writes into a tensor it is given, so the step allocates nothing on the device."""
    bias_correction1 = 1.0 - config.beta1 ** step
    bias_correction2_sqrt = math.sqrt(1.0 - config.beta2 ** step)
    step_size = config.lr / bias_correction1
    master.mul_(1.0 - config.lr * config.weight_decay)  # decoupled: decay the weight, not the gradient
    exp_avg.mul_(config.beta1)
    torch.mul(grad, 1.0 - config.beta1, out=scratch)
    exp_avg.add_(scratch)  # m = beta1 m + (1 - beta1) g
    exp_avg_sq.mul_(config.beta2)
    grad.mul_(grad)
    grad.mul_(1.0 - config.beta2)
    exp_avg_sq.add_(grad)  # v = beta2 v + (1 - beta2) g^2
    torch.sqrt(exp_avg_sq, out=scratch)
    scratch.div_(bias_correction2_sqrt)
    scratch.add_(config.eps)  # denominator: sqrt(v / (1 - beta2^t)) + eps, as torch computes it
    torch.div(exp_avg, scratch, out=grad)
    grad.mul_(step_size)
    master.sub_(grad)  # w -= lr / (1 - beta1^t) * m / denominator


def clip_scale(named: list[tuple[str, torch.Tensor]], max_norm: float) -> tuple[float, float]:
    """(the global gradient norm, the factor that clips it to ``max_norm``), computed in fp32 from
    the bf16 gradients: ``step(grad_scale=...)`` then applies the factor to the fp32 copies, so
    clipping rounds no bf16 gradient (torch's rule: max_norm / (norm + 1e-6), at most 1)."""
    squares = torch.zeros((), dtype=torch.float32)
    for _, param in named:
        if param.grad is not None:
            squares = squares + param.grad.detach().float().pow(2).sum().cpu()
    norm = float(squares.sqrt())
    return norm, min(max_norm / (norm + 1e-6), 1.0)


def _state_dict(state: dict[str, AdamWState], steps: int) -> dict:
    return {"steps": steps, "state": {name: [t.detach().cpu().clone() for t in parts] for name, parts in state.items()}}


def _load_state_dict(saved: dict, state: dict[str, AdamWState]) -> int:
    """Copy ``saved`` (``state_dict``'s) into ``state`` in place; returns its step count."""
    if saved["state"].keys() != state.keys():
        missing = sorted(state.keys() ^ saved["state"].keys())
        raise OptimizerSetupError("saved optimizer state has other parameters", parameter=missing[0])
    with torch.no_grad():
        for name, parts in state.items():
            for target, source in zip(parts, saved["state"][name], strict=True):
                if target.shape != source.shape:
                    raise OptimizerSetupError(f"saved state {tuple(source.shape)} != {tuple(target.shape)}",
                                              parameter=name)
                target.copy_(source)
    return int(saved["steps"])


class TrainingLoopMethods:
    """What a training loop calls besides ``step``, shared by both optimizers: ``zero_grad``,
    ``clip_grad_norm`` and a ``state_dict`` of CPU tensors (exact resume)."""

    _named: list[tuple[str, torch.Tensor]]
    _grad_scale: float = 1.0

    def zero_grad(self, set_to_none: bool = True) -> None:
        for _, param in self._named:
            param.grad = None

    def clip_grad_norm(self, max_norm: float) -> float:
        """The gradients' global norm; the next ``step`` scales them so it is at most ``max_norm``."""
        norm, self._grad_scale = clip_scale(self._named, max_norm)
        return norm

    def _take_grad_scale(self) -> float:
        scale, self._grad_scale = self._grad_scale, 1.0
        return scale

    def named_state(self) -> dict[str, AdamWState]:
        return {name: self.state_of(name) for name, _ in self._named}

    def state_dict(self) -> dict:
        return _state_dict(self.named_state(), self.steps)

    def load_state_dict(self, saved: dict) -> None:
        """Restore ``state_dict``'s moments, master weights and step count; the bf16 parameters
        are set from the restored masters, as after a step."""
        self.steps = _load_state_dict(saved, self.named_state())
        with torch.no_grad():
            for name, param in self._named:
                param.detach().view(-1).copy_(self.state_of(name).master)


def checked_parameters(named_parameters: Iterable[tuple[str, torch.Tensor]],
                       device: torch.device) -> list[tuple[str, torch.Tensor]]:
    """The parameters as a list, each checked to be a contiguous float tensor on ``device``."""
    named = list(named_parameters)
    for name, param in named:
        # "cuda" means the current CUDA device, whose tensors say "cuda:0": compare the index only
        # when one is given.
        if param.device.type != device.type or device.index not in (None, param.device.index):
            raise OptimizerSetupError(f"on {param.device}, optimizer device is {device}", parameter=name)
        if not param.is_floating_point():
            raise OptimizerSetupError(f"dtype {param.dtype} is not floating point", parameter=name)
        if not param.is_contiguous():
            # Both optimizers write the updated weights through a flat view of the storage.
            raise OptimizerSetupError("not contiguous", parameter=name)
    return named


def flat_gradients(named: list[tuple[str, torch.Tensor]], *, step: int,
                   account: DeviceMemoryAccount) -> list[torch.Tensor]:
    """Each parameter's gradient as a flat view, held by ``account`` with the parameters."""
    grads = []
    for name, param in named:
        if param.grad is None:
            raise MissingGradientError(parameter=name, step=step)
        account.hold(f"param:{name}", param)
        account.hold(f"grad:{name}", param.grad)
        grads.append(param.grad.detach().reshape(-1))
    return grads


class MixedPrecisionAdamW(TrainingLoopMethods):
    """The reference: bf16 parameters and gradients, fp32 master weights and moments, all on the
    device. Each step: ``master = AdamW(master, grad.float() * grad_scale)``, then
    ``param.copy_(master)`` (``grad_scale``: the clipping factor of ``clip_grad_norm``, else 1)."""

    def __init__(self, named_parameters: Iterable[tuple[str, torch.Tensor]], *, config: AdamWConfig,
                 device: torch.device | str, account: DeviceMemoryAccount | None = None) -> None:
        self.config = config
        self.device = torch.device(device)
        self.account = account or DeviceMemoryAccount(self.device)
        self.steps = 0
        self._named = checked_parameters(named_parameters, self.device)
        self._state: dict[str, AdamWState] = {}
        with torch.no_grad():
            for name, param in self._named:
                master = self.account.allocate(f"master:{name}", param.numel(), torch.float32)
                master.copy_(param.detach().reshape(-1))
                self._state[name] = AdamWState(
                    master,
                    self.account.allocate(f"exp_avg:{name}", param.numel(), torch.float32).zero_(),
                    self.account.allocate(f"exp_avg_sq:{name}", param.numel(), torch.float32).zero_())
        self._largest = max((p.numel() for _, p in self._named), default=0)

    def state_of(self, name: str) -> AdamWState:
        return self._state[name]

    def step(self) -> None:
        grads = flat_gradients(self._named, step=self.steps + 1, account=self.account)
        self.steps += 1
        grad_scale = self._take_grad_scale()
        # Work space for the largest parameter, reused by all: the fp32 gradient and one temporary.
        grad32 = self.account.allocate("step:grad32", self._largest, torch.float32)
        scratch = self.account.allocate("step:scratch", self._largest, torch.float32)
        try:
            with torch.no_grad():
                for (name, param), grad in zip(self._named, grads):
                    numel = param.numel()
                    state = self._state[name]
                    grad32[:numel].copy_(grad)
                    if grad_scale != 1.0:
                        grad32[:numel].mul_(grad_scale)
                    adamw_update_(state.master, state.exp_avg, state.exp_avg_sq, grad32[:numel],
                                  scratch[:numel], step=self.steps, config=self.config)
                    param.detach().view(-1).copy_(state.master)  # fp32 -> bf16, round to nearest even
        finally:
            self.account.release_prefix("step:")
