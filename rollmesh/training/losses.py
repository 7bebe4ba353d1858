"""Policy losses on a PolicyBatch: PPO-clip or GRPO, off-policy correction, KL and entropy terms.

Knows torch and the batch layout of ``grpo.py``; nothing of models, optimizers, Ray or NATS (the
backend runs the forward passes and hands in logprobs and logits). Per trained token t of sample i,
with advantage A_i, new logprob log pi, behaviour logprob log mu (the inference engine's, at the
token's weight version) and proximal logprob log pi_prox (the trainer's own before this update):

  ratio     r = exp(log pi - log mu)                          correction off (is_cap None or 0)
            r = exp(log pi - log pi_prox),                    correction on: decoupled PPO
            w = min(exp(log pi_prox - log mu), is_cap)         (Hilton et al. 2021, AReaL 2025) with
                                                               truncated IS (Yao et al. 2025, "TIS")
  clip      o = min(r A, clip(r, 1 - eps, 1 + eps) A)          PPO (Schulman et al. 2017)
            o = max(o, dual_clip A)  when A < 0                dual-clip PPO (Ye et al. 2020)
  KL        k3 = exp(log ref - log pi) - (log ref - log pi) - 1    Schulman 2020, DeepSeekMath eq. 4
  entropy   H = -sum_v p_v log p_v over the full vocabulary at the token's position
  per token l = -w o + kl_coef k3 - entropy_coef H                 (w = 1 with correction off)

  "ppo_clip": L = sum_it m_it l_it / sum_it m_it             token mean over the batch (DAPO 2025)
  "grpo":     L = mean over samples i with a trained token of (sum_t m_it l_it / sum_t m_it)
                                                             (DeepSeekMath 2024, eq. 3)

m_it is 1 only where the loss mask is 1 (never a prompt or tool token), the sample is not an
infrastructure failure, and the token's version lag (trainer version - token version) is at most
``max_token_lag``: masked tokens count in neither the numerator nor the denominator.

Stat ``logprob_mismatch``: mean |log pi_first - log mu| over the trained tokens the engine
generated (version >= 0; every trained token of a sample that carries no versions), where log pi_first
is the trainer's logprob at the step's first epoch (before any update). The first thing to check
after an engine, kernel or precision change: it is the train-versus-rollout gap of the same
weights plus the off-policy gap of older versions, never what this step's update moved.

Why decoupled PPO: behaviour logprobs come from older weights (asynchronous RL) and from another
engine (numerically different kernels), so clipping against them mixes "how far did this update
move the policy" with "how off-policy was the data". Clipping against the trainer's own logprobs
before the update bounds the update alone; the off-policy gap becomes an importance weight,
truncated at ``is_cap`` so one stale token cannot dominate. With behaviour == proximal the weight
is 1 and the ratio is today's, so both forms agree on on-policy data. Why mask stale tokens rather
than trust the weight: admission (``admission.py``) excludes tool waits, so an admitted long
rollout's first turns can be many versions old; past ``max_token_lag`` their logprobs say little
about the current policy and they are dropped, not down-weighted.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

from rollmesh.config import TrainerConfig
from rollmesh.training.errors import LossInputsError
from rollmesh.training.grpo import PolicyBatch

LossName = Literal["grpo", "ppo_clip"]


@dataclass(frozen=True)
class LossSettings:
    """The loss's slice of TrainerConfig; the defaults are today's loss without the dual clip."""

    loss: LossName = "ppo_clip"
    clip_eps: float = 0.2
    dual_clip: float | None = None
    is_cap: float | None = None  # None: no decoupling, the ratio is against the behaviour logprobs
    max_token_lag: int | None = None  # None: no token is masked for its age
    kl_coef: float = 0.0
    entropy_coef: float = 0.0

    @classmethod
    def from_config(cls, config: TrainerConfig) -> "LossSettings":
        return cls(loss=config.policy_loss, clip_eps=config.clip_eps, dual_clip=config.dual_clip,
                   is_cap=config.is_cap or None, max_token_lag=config.max_token_lag,
                   kl_coef=config.kl_coef, entropy_coef=config.entropy_coef)

    @property
    def decoupled(self) -> bool:
        """Whether the clip is against proximal logprobs, with truncated behaviour weights."""
        return self.is_cap is not None


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, targets[..., None])[..., 0]


def tempered(logits: torch.Tensor, temperatures: torch.Tensor | None) -> torch.Tensor:
    """``logits`` [B, T, V] divided by each row's sampling temperature ([B]; None: all 1), so
    that their logprobs, ratios, KL and entropy are of the distribution the engine sampled from
    (engine/sampling.py: its behaviour logprobs are the tempered ones). A temperature of 0
    (greedy) or a blank padding row's counts as 1. Top-p is not applied: a token the engine drew
    from a truncated distribution has a behaviour logprob above the full distribution's, which
    the clipped ratio bounds; RL sampling usually keeps top_p = 1 for that reason."""
    if temperatures is None:
        return logits
    scale = temperatures.to(device=logits.device, dtype=logits.dtype)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return logits / scale[:, None, None]


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the next-token distribution at each position, from the full logits."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    return -(logprobs.exp() * logprobs).sum(-1)


def k3_kl(new_logprobs: torch.Tensor, reference_logprobs: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(pi || ref) per token: unbiased, never negative."""
    log_ratio = reference_logprobs - new_logprobs
    return torch.exp(log_ratio) - log_ratio - 1


def trained_token_mask(batch: PolicyBatch, *, max_token_lag: int | None,
                       current_version: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(trained, stale), both bool [B, T-1]: the tokens the loss counts, and the loss-mask
    tokens of healthy samples dropped because their version lag exceeds ``max_token_lag``."""
    trained = batch.mask > 0
    if batch.infra_failed is not None:
        trained = trained & ~batch.infra_failed[:, None]
    stale = torch.zeros_like(trained)
    if max_token_lag is not None and batch.versions is not None:
        if current_version is None:
            raise LossInputsError("max_token_lag needs the trainer's current version",
                                  missing="current_version")
        generated = batch.versions >= 0  # forced or unknown-version tokens are never stale
        stale = trained & generated & (current_version - batch.versions > max_token_lag)
        trained = trained & ~stale
    return trained, stale


def clipped_objective(ratio: torch.Tensor, advantages: torch.Tensor, *, clip_eps: float,
                      dual_clip: float | None) -> torch.Tensor:
    """PPO-clip per token, with the dual clip's floor under negative advantages.

    With a negative advantage the PPO clip leaves a large ratio unbounded, and tokens made by
    much older versions (admitted long rollouts) can have one; their objective is floored at
    dual_clip x advantage."""
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps) * advantages
    objective = torch.minimum(unclipped, clipped)
    if dual_clip is not None:
        objective = torch.where(advantages < 0, torch.maximum(objective, dual_clip * advantages), objective)
    return objective


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, loss: LossName) -> torch.Tensor:
    """Average masked per-token values: over all tokens ("ppo_clip") or per sample ("grpo")."""
    if loss == "ppo_clip":
        return (per_token * mask).sum() / mask.sum().clamp(min=1.0)
    tokens_per_sample = mask.sum(dim=1)
    per_sample = (per_token * mask).sum(dim=1) / tokens_per_sample.clamp(min=1.0)
    return per_sample.sum() / (tokens_per_sample > 0).sum().clamp(min=1)


def policy_loss(
    new_logprobs: torch.Tensor,
    batch: PolicyBatch,
    settings: LossSettings,
    *,
    proximal_logprobs: torch.Tensor | None = None,
    reference_logprobs: torch.Tensor | None = None,
    logits: torch.Tensor | None = None,
    current_version: int | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The selected loss (module docstring) and its statistics.

    ``proximal_logprobs``: the trainer's logprobs before this update (detached; the first
    epoch's); defaults to ``new_logprobs`` detached, which is right at the first epoch. Besides
    the decoupled loss, they give the ``logprob_mismatch`` stat (module docstring), so a backend
    passes them at every epoch, decoupled or not. ``reference_logprobs``: needed
    when ``kl_coef`` > 0; ``logits`` (full vocabulary): needed when ``entropy_coef`` > 0;
    ``current_version``: needed when ``max_token_lag`` is set."""
    trained, stale = trained_token_mask(batch, max_token_lag=settings.max_token_lag,
                                        current_version=current_version)
    mask = trained.float()
    # Masked entries may hold anything (an infra-failed sample's logprobs can be NaN or inf):
    # every logprob there is set to 0 before any arithmetic, as 0 * inf would put NaN into the
    # loss and the gradient. At masked entries the ratio is then 1, the weight 1 and the KL 0.
    zeros = torch.zeros_like(mask)
    new_logprobs = torch.where(trained, new_logprobs, zeros)
    behaviour = torch.where(trained, batch.behaviour_logprobs, zeros)
    advantages = batch.advantages
    if batch.infra_failed is not None:
        advantages = torch.where(batch.infra_failed, torch.zeros_like(advantages), advantages)
    advantages = advantages[:, None]

    stats: dict[str, float] = {}
    proximal = new_logprobs.detach() if proximal_logprobs is None else torch.where(trained, proximal_logprobs, zeros)
    generated = trained
    if batch.versions is not None:
        # A sample without any version (collated from one that carries none) is all unknown:
        # all its trained tokens count; otherwise only those the engine generated.
        unknown = ~(batch.versions >= 0).any(dim=1, keepdim=True)
        generated = trained & ((batch.versions >= 0) | unknown)
    stats["logprob_mismatch"] = _token_mean((proximal - behaviour).abs(), generated.float())
    if settings.decoupled:
        ratio = torch.exp(new_logprobs - proximal)
        raw_weight = torch.exp(proximal - behaviour)
        weight = torch.clamp(raw_weight, max=settings.is_cap)
        objective = weight * clipped_objective(ratio, advantages, clip_eps=settings.clip_eps,
                                               dual_clip=settings.dual_clip)
        stats["is_weight_mean"] = _token_mean(weight, mask)
        stats["is_capped_fraction"] = _token_mean((raw_weight > settings.is_cap).float(), mask)
    else:
        ratio = torch.exp(new_logprobs - behaviour)
        objective = clipped_objective(ratio, advantages, clip_eps=settings.clip_eps,
                                      dual_clip=settings.dual_clip)
    per_token = -objective
    stats["surrogate"] = float(aggregate(per_token.detach(), mask, settings.loss))

    if settings.kl_coef > 0:
        if reference_logprobs is None:
            raise LossInputsError("kl_coef > 0 needs reference logprobs", missing="reference_logprobs")
        kl = k3_kl(new_logprobs, torch.where(trained, reference_logprobs, zeros))
        per_token = per_token + settings.kl_coef * kl
        stats["kl"] = _token_mean(kl, mask)
    if settings.entropy_coef > 0:
        if logits is None:
            raise LossInputsError("entropy_coef > 0 needs the full logits", missing="logits")
        # Only trained positions: the full-vocabulary softmax is the memory hazard here.
        entropy = torch.zeros_like(mask).masked_scatter(trained, token_entropy(logits[trained]))
        per_token = per_token - settings.entropy_coef * entropy
        stats["entropy"] = _token_mean(entropy, mask)

    loss = aggregate(per_token, mask, settings.loss)
    with torch.no_grad():
        clipped = ((ratio - 1).abs() > settings.clip_eps).float()
        stats.update(
            clip_fraction=_token_mean(clipped, mask), mean_ratio=_token_mean(ratio, mask),
            trained_tokens=float(mask.sum()), stale_tokens=float(stale.sum()),
            samples_trained=float((mask.sum(dim=1) > 0).sum()),
            infra_failed_samples=float(batch.infra_failed.sum()) if batch.infra_failed is not None else 0.0,
        )
    return loss, stats


def policy_epochs(batch: PolicyBatch, settings: LossSettings, *, epochs: int,
                  logits: Callable[[], torch.Tensor], update: Callable[[torch.Tensor], float],
                  reference_logprobs: torch.Tensor | None = None,
                  current_version: int | None = None) -> dict[str, float]:
    """``epochs`` full-batch updates of ``policy_loss``, the loop every backend shares.

    ``logits()`` is the backend's forward on ``batch.inputs``; ``update(loss)`` its backward,
    gradient clipping and optimizer step, returning the gradient norm. The first epoch's forward
    runs on the weights before this step's update: the proximal policy of the decoupled loss,
    for free (full-batch updates; minibatches would need a pass of their own)."""
    proximal: torch.Tensor | None = None
    stats: dict[str, float] = {}
    for _ in range(epochs):
        step_logits = tempered(logits(), batch.temperatures)
        new_logprobs = token_logprobs(step_logits, batch.targets)
        if proximal is None:  # the first epoch's: decoupled PPO's proximal, logprob_mismatch's
            proximal = new_logprobs.detach()
        loss, stats = policy_loss(
            new_logprobs, batch, settings, proximal_logprobs=proximal, reference_logprobs=reference_logprobs,
            logits=step_logits if settings.entropy_coef > 0 else None, current_version=current_version)
        grad_norm = update(loss)
        stats = {**stats, "loss": float(loss.detach()), "grad_norm": float(grad_norm)}
    return stats


def _token_mean(values: torch.Tensor, mask: torch.Tensor) -> float:
    with torch.no_grad():
        return float((values * mask).sum() / mask.sum().clamp(min=1.0))
