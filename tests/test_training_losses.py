"""The policy losses (rollmesh.training.losses) against hand-computed examples: PPO-clip and GRPO
aggregation, the dual clip, the masks (prompt/tool tokens, infra-failed samples, stale tokens),
decoupled PPO with truncated importance weights, k3 KL and entropy, gradients, and the default
configuration against the loss the trainer used before (a verbatim copy below). Plain torch."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from rollmesh.config import ModelConfig, TrainerConfig
from rollmesh.training.grpo import PolicyBatch, PolicySample
from rollmesh.training.losses import (
    LossInputsError,
    LossSettings,
    k3_kl,
    policy_loss,
    tempered,
    token_entropy,
    token_logprobs,
)
from rollmesh.training.torch_backend import TorchTrainerBackend

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

PAD_ID = 0  # any valid embedding row pads (torch_backend.training_pad_id)
PPO = LossSettings(loss="ppo_clip", clip_eps=0.2, dual_clip=3.0)
GRPO = LossSettings(loss="grpo", clip_eps=0.2, dual_clip=3.0)


def batch_of(mask, behaviour, advantages, *, versions=None, infra_failed=None) -> PolicyBatch:
    mask = torch.tensor(mask, dtype=torch.float32)
    return PolicyBatch(
        inputs=torch.zeros(mask.shape, dtype=torch.long), targets=torch.zeros(mask.shape, dtype=torch.long),
        mask=mask, behaviour_logprobs=torch.tensor(behaviour), advantages=torch.tensor(advantages),
        versions=None if versions is None else torch.tensor(versions),
        infra_failed=None if infra_failed is None else torch.tensor(infra_failed),
    )


# Two samples x three tokens. Sample 0 (A = +1): its third token is a tool token (mask 0).
# Sample 1 (A = -1): all three tokens trained.
NEW = [[-1.0, -0.5, -2.0], [-0.2, -1.0, -3.0]]
BEHAVIOUR = [[-1.0, -0.8, -0.3], [-0.2, -0.9, -1.0]]
MASK = [[1, 1, 0], [1, 1, 1]]
ADVANTAGES = [1.0, -1.0]
# Per-token loss -min(r A, clip(r, 0.8, 1.2) A), floored by the dual clip at -3 A when A < 0:
#   sample 0: r = e^0 = 1 -> -1;  r = e^0.3 = 1.3499 -> clipped to 1.2 -> -1.2
#   sample 1: r = 1 -> +1;  r = e^-0.1 = 0.904837 (inside) -> +0.904837;
#             r = e^-2 = 0.135335 -> min(-0.1353, -0.8) = -0.8 -> +0.8 (the floor -3 is not hit)
SAMPLE_0 = [-1.0, -1.2]
SAMPLE_1 = [1.0, math.exp(-0.1), 0.8]


def hand_example() -> tuple[torch.Tensor, PolicyBatch]:
    return torch.tensor(NEW, requires_grad=True), batch_of(MASK, BEHAVIOUR, ADVANTAGES)


# --- the two aggregations ----------------------------------------------------------------------

def test_ppo_clip_is_the_token_mean_of_the_clipped_surrogate_over_the_batch():
    new, batch = hand_example()
    loss, stats = policy_loss(new, batch, PPO)
    # (-1 - 1.2 + 1 + 0.904837 + 0.8) / 5 = 0.504837 / 5 = 0.1009675
    assert float(loss.detach()) == pytest.approx(sum(SAMPLE_0 + SAMPLE_1) / 5, rel=1e-6)
    assert float(loss.detach()) == pytest.approx(0.1009675, rel=1e-6)
    # Clipped: e^0.3 and e^-2 (|r - 1| > 0.2) of five trained tokens.
    assert stats["clip_fraction"] == pytest.approx(2 / 5)
    ratios = [1.0, math.exp(0.3), 1.0, math.exp(-0.1), math.exp(-2.0)]
    assert stats["mean_ratio"] == pytest.approx(sum(ratios) / 5, rel=1e-6)
    assert (stats["trained_tokens"], stats["samples_trained"]) == (5.0, 2.0)


def test_grpo_averages_within_each_sample_then_over_samples():
    new, batch = hand_example()
    loss, _ = policy_loss(new, batch, GRPO)
    # Sample 0: (-1 - 1.2) / 2 = -1.1; sample 1: 2.704837 / 3 = 0.901612; mean: -0.099194.
    expected = (sum(SAMPLE_0) / 2 + sum(SAMPLE_1) / 3) / 2
    assert float(loss.detach()) == pytest.approx(expected, rel=1e-6)
    assert float(loss.detach()) == pytest.approx(-0.0991938, rel=1e-5)


@pytest.mark.parametrize("settings", [PPO, GRPO], ids=["ppo_clip", "grpo"])
def test_gradients_reach_every_unclipped_trained_token_and_no_masked_one(settings):
    new, batch = hand_example()
    policy_loss(new, batch, settings)[0].backward()
    grad = new.grad
    # Unclipped trained tokens: (0,0), (1,0), (1,1). Clipped ones have zero gradient; so has
    # the tool token (0,2).
    assert all(float(grad[i, j]) != 0.0 for i, j in [(0, 0), (1, 0), (1, 1)])
    assert all(float(grad[i, j]) == 0.0 for i, j in [(0, 1), (1, 2), (0, 2)])
    # PPO-clip: d/d logpi of -r A / 5 at (0,0) is -1 x 1 / 5; GRPO: -1 / 2 / 2 (sample of two).
    expected = -1 / 5 if settings.loss == "ppo_clip" else -1 / 4
    assert float(grad[0, 0]) == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("settings", [PPO, GRPO], ids=["ppo_clip", "grpo"])
def test_a_batch_with_no_trained_tokens_has_zero_loss(settings):
    new, batch = hand_example()
    empty = batch_of([[0, 0, 0], [0, 0, 0]], BEHAVIOUR, ADVANTAGES)
    loss, stats = policy_loss(new, empty, settings)
    assert float(loss.detach()) == 0.0 and stats["clip_fraction"] == 0.0 and stats["trained_tokens"] == 0.0


def test_dual_clip_bounds_a_large_ratio_under_a_negative_advantage():
    # One trained token whose ratio is e^3 (about 20): PPO-clip alone leaves -20 x A.
    batch = batch_of([[1]], [[-4.0]], [-1.0])
    new = torch.tensor([[-1.0]])
    plain, _ = policy_loss(new, batch, LossSettings(clip_eps=0.2))
    bounded, _ = policy_loss(new, batch, LossSettings(clip_eps=0.2, dual_clip=3.0))
    assert float(plain) == pytest.approx(math.exp(3.0), rel=1e-6)
    assert float(bounded) == pytest.approx(3.0)
    # A positive advantage is untouched by the dual clip: min(e^3, 1.2) x 1 -> loss -1.2.
    positive = batch_of([[1]], [[-4.0]], [1.0])
    assert float(policy_loss(new, positive, LossSettings(clip_eps=0.2, dual_clip=3.0))[0]) == pytest.approx(-1.2)


def test_token_logprobs_pick_the_target_log_softmax():
    logits = torch.tensor([[[0.0, math.log(3.0)]]])
    assert float(token_logprobs(logits, torch.tensor([[1]]))[0, 0]) == pytest.approx(math.log(0.75))


# --- masks -------------------------------------------------------------------------------------

@pytest.mark.parametrize("settings", [PPO, GRPO, LossSettings(is_cap=2.0, kl_coef=0.1)],
                         ids=["ppo_clip", "grpo", "decoupled_with_kl"])
def test_prompt_and_tool_tokens_change_nothing_whatever_their_values(settings):
    new, batch = hand_example()
    reference = torch.tensor(NEW)
    loss, _ = policy_loss(new, batch, settings, reference_logprobs=reference)
    loss.backward()

    wild_new = torch.tensor(NEW)
    wild_new[0, 2] = 7.0  # the tool token's logprob, behaviour logprob and reference: garbage
    wild_new.requires_grad_(True)
    behaviour = torch.tensor(BEHAVIOUR)
    behaviour[0, 2] = float("nan")
    wild_reference = reference.clone()
    wild_reference[0, 2] = float("inf")
    wild_batch = batch_of(MASK, behaviour.tolist(), ADVANTAGES)
    wild_loss, _ = policy_loss(wild_new, wild_batch, settings, reference_logprobs=wild_reference)
    wild_loss.backward()

    assert torch.equal(wild_loss.detach(), loss.detach())
    assert torch.equal(wild_new.grad, new.grad)
    assert float(wild_new.grad[0, 2]) == 0.0


@pytest.mark.parametrize("settings", [PPO, GRPO], ids=["ppo_clip", "grpo"])
def test_an_infra_failed_sample_contributes_nothing_and_counts_in_no_normalisation(settings):
    new, batch = hand_example()
    loss, _ = policy_loss(new, batch, settings)
    loss.backward()

    # A third sample, flagged infra-failed, with garbage everywhere and every token "trained".
    with_failed = torch.tensor([*NEW, [5.0, float("nan"), -9.0]], requires_grad=True)
    failed_batch = batch_of([*MASK, [1, 1, 1]], [*BEHAVIOUR, [float("-inf"), 0.0, float("nan")]],
                            [*ADVANTAGES, float("nan")], infra_failed=[False, False, True])
    failed_loss, stats = policy_loss(with_failed, failed_batch, settings)
    failed_loss.backward()

    assert torch.equal(failed_loss.detach(), loss.detach())
    assert torch.equal(with_failed.grad[:2], new.grad)
    assert torch.equal(with_failed.grad[2], torch.zeros(3))
    assert (stats["infra_failed_samples"], stats["trained_tokens"], stats["samples_trained"]) == (1.0, 5.0, 2.0)


def test_collate_carries_versions_and_the_infra_failed_flag_shifted_like_the_tokens():
    fresh = PolicySample([1, 2, 3], [0, 1, 1], [0.0, -0.1, -0.2], 1.0, versions=[-1, 4, 5])
    failed = PolicySample([4, 5, 6, 7], [0, 1, 1, 1], [0.0] * 4, -1.0, infra_failed=True)
    batch = PolicyBatch.collate([fresh, failed], pad_id=PAD_ID)
    assert batch.versions.tolist() == [[4, 5, -1], [-1, -1, -1]]  # no versions: unknown, -1
    assert batch.infra_failed.tolist() == [False, True]

    assert batch.temperatures is None  # every sample at temperature 1: nothing to scale


def test_tempered_divides_each_row_by_its_temperature_and_leaves_greedy_and_blank_rows_alone():
    logits = torch.tensor([[[2.0, -1.0]], [[2.0, -1.0]], [[2.0, -1.0]]])
    samples = [PolicySample([1, 2], [0, 1], [0.0, -0.1], 1.0, temperature=t) for t in (2.0, 0.0, 1.0)]
    temperatures = PolicyBatch.collate(samples, pad_id=PAD_ID).temperatures
    assert temperatures.tolist() == [2.0, 0.0, 1.0]
    # Greedy (0) trains at 1, as does a blank padding row (megatron pads microbatches with zeros).
    assert tempered(logits, temperatures).tolist() == [[[1.0, -0.5]], [[2.0, -1.0]], [[2.0, -1.0]]]
    assert tempered(logits, None) is logits


# --- decoupled PPO with truncated importance sampling ------------------------------------------

# One sample (A = +1), three trained tokens, made by versions 5, 3, 5.
IS_BEHAVIOUR = [[-1.0, -2.0, -0.5]]
IS_PROXIMAL = [[-1.0, -1.0, -0.7]]
IS_NEW = [[-0.9, -1.0, -0.7]]
IS_VERSIONS = [[5, 3, 5]]
# Behaviour weights exp(proximal - behaviour) = e^0, e^1, e^-0.2 = 1, 2.71828, 0.818731, capped
# at 2 -> 1, 2, 0.818731. Ratios exp(new - proximal) = e^0.1 = 1.105171 (inside 1.2), 1, 1.
IS_WEIGHTED = [math.exp(0.1), 2.0, math.exp(-0.2)]


def test_decoupled_ppo_clips_against_the_proximal_policy_and_weights_by_the_capped_behaviour_ratio():
    new = torch.tensor(IS_NEW, requires_grad=True)
    batch = batch_of([[1, 1, 1]], IS_BEHAVIOUR, [1.0])
    loss, stats = policy_loss(new, batch, LossSettings(is_cap=2.0), proximal_logprobs=torch.tensor(IS_PROXIMAL))
    # -(1.105171 + 2 + 0.818731) / 3 = -1.307967
    assert float(loss.detach()) == pytest.approx(-sum(IS_WEIGHTED) / 3, rel=1e-6)
    assert stats["is_capped_fraction"] == pytest.approx(1 / 3)
    assert stats["is_weight_mean"] == pytest.approx((1 + 2 + math.exp(-0.2)) / 3, rel=1e-6)
    assert stats["mean_ratio"] == pytest.approx((math.exp(0.1) + 2) / 3, rel=1e-6)
    loss.backward()
    # d/d logpi of -w r A / 3 at token 0: -1 x e^0.1 / 3; the weight carries no gradient.
    assert float(new.grad[0, 0]) == pytest.approx(-math.exp(0.1) / 3, rel=1e-6)
    assert float(new.grad[0, 1]) == pytest.approx(-2 / 3, rel=1e-6)


def test_a_token_older_than_max_token_lag_is_masked_out_of_numerator_and_denominator():
    new = torch.tensor(IS_NEW, requires_grad=True)
    batch = batch_of([[1, 1, 1]], IS_BEHAVIOUR, [1.0], versions=IS_VERSIONS)
    settings = LossSettings(is_cap=2.0, max_token_lag=1)
    loss, stats = policy_loss(new, batch, settings, proximal_logprobs=torch.tensor(IS_PROXIMAL),
                              current_version=5)
    # Token 1 (version 3, lag 2 > 1) is dropped: -(1.105171 + 0.818731) / 2 = -0.961951
    assert float(loss.detach()) == pytest.approx(-(IS_WEIGHTED[0] + IS_WEIGHTED[2]) / 2, rel=1e-6)
    assert (stats["stale_tokens"], stats["trained_tokens"]) == (1.0, 2.0)
    loss.backward()
    assert float(new.grad[0, 1]) == 0.0
    # At lag 2 allowed, nothing is stale.
    _, within = policy_loss(new, batch, LossSettings(is_cap=2.0, max_token_lag=2),
                            proximal_logprobs=torch.tensor(IS_PROXIMAL), current_version=5)
    assert within["stale_tokens"] == 0.0


def test_decoupled_ppo_equals_plain_ppo_clip_when_behaviour_equals_proximal():
    generator = torch.Generator().manual_seed(1)
    new = -torch.rand(4, 9, generator=generator) * 3
    behaviour = new + torch.randn(4, 9, generator=generator) * 0.3
    batch = batch_of((torch.rand(4, 9, generator=generator) > 0.3).int().tolist(), behaviour.tolist(),
                     torch.randn(4, generator=generator).tolist())
    plain, _ = policy_loss(new, batch, PPO)
    decoupled, stats = policy_loss(new, batch, LossSettings(clip_eps=0.2, dual_clip=3.0, is_cap=2.0),
                                   proximal_logprobs=batch.behaviour_logprobs)
    assert torch.equal(plain, decoupled)  # weight e^0 = 1 exactly, the same ratio: bit for bit
    assert stats["is_weight_mean"] == 1.0


def test_max_token_lag_without_the_current_version_is_refused():
    batch = batch_of([[1, 1, 1]], IS_BEHAVIOUR, [1.0], versions=IS_VERSIONS)
    with pytest.raises(LossInputsError) as raised:
        policy_loss(torch.tensor(IS_NEW), batch, LossSettings(max_token_lag=1))
    assert raised.value.missing == "current_version"


# --- KL and entropy ----------------------------------------------------------------------------

def test_k3_kl_by_hand():
    # ref - new = ln 0.25 - ln 0.5 = -ln 2: e^(-ln 2) + ln 2 - 1 = 0.5 + 0.693147 - 1 = 0.193147
    kl = k3_kl(torch.tensor([math.log(0.5), math.log(0.5)]), torch.tensor([math.log(0.25), math.log(0.5)]))
    assert kl.tolist() == pytest.approx([0.5 + math.log(2) - 1, 0.0], abs=1e-7)


def test_kl_term_adds_kl_coef_times_the_token_mean_k3():
    # A = 0: the surrogate is 0, so the loss is the KL term alone: 0.1 x (0.193147 + 0) / 2.
    new = torch.tensor([[math.log(0.5), math.log(0.5)]], requires_grad=True)
    batch = batch_of([[1, 1]], [[math.log(0.5), math.log(0.5)]], [0.0])
    reference = torch.tensor([[math.log(0.25), math.log(0.5)]])
    loss, stats = policy_loss(new, batch, LossSettings(kl_coef=0.1), reference_logprobs=reference)
    assert float(loss.detach()) == pytest.approx(0.1 * (0.5 + math.log(2) - 1) / 2, rel=1e-6)
    assert stats["kl"] == pytest.approx((0.5 + math.log(2) - 1) / 2, rel=1e-6)
    loss.backward()
    # d k3 / d logpi = 1 - e^(ref - new) = 1 - 0.5: x 0.1 / 2 = 0.025; at ref == new it is 0.
    assert new.grad[0].tolist() == pytest.approx([0.025, 0.0], abs=1e-7)


def test_entropy_bonus_uses_the_full_distribution_of_trained_tokens_only():
    # Vocabulary of two. Position 0: p = (0.75, 0.25), H = -(0.75 ln 0.75 + 0.25 ln 0.25) = 0.562335.
    # Position 1: p = (0.5, 0.5), H = ln 2 = 0.693147, but a tool token (mask 0).
    logits = torch.tensor([[[math.log(3.0), 0.0], [0.0, 0.0]]], requires_grad=True)
    h0 = -(0.75 * math.log(0.75) + 0.25 * math.log(0.25))
    assert token_entropy(logits)[0].tolist() == pytest.approx([h0, math.log(2)], abs=1e-6)

    batch = batch_of([[1, 0]], [[0.0, 0.0]], [0.0])
    new = token_logprobs(logits, batch.targets)
    loss, stats = policy_loss(new, batch, LossSettings(entropy_coef=0.01), logits=logits)
    assert stats["entropy"] == pytest.approx(h0, rel=1e-6)
    assert float(loss.detach()) == pytest.approx(-0.01 * h0, rel=1e-5)  # A = 0: the bonus alone
    loss.backward()
    assert logits.grad[0, 0].abs().sum() > 0 and float(logits.grad[0, 1].abs().sum()) == 0.0


@pytest.mark.parametrize(("settings", "missing"), [(LossSettings(kl_coef=0.1), "reference_logprobs"),
                                                   (LossSettings(entropy_coef=0.1), "logits")])
def test_a_term_without_its_inputs_is_refused(settings, missing):
    new, batch = hand_example()
    with pytest.raises(LossInputsError) as raised:
        policy_loss(new, batch, settings)
    assert raised.value.missing == missing


# --- the default configuration is the old loss -------------------------------------------------

def legacy_clipped_policy_loss(new_logprobs, batch, *, clip_eps, dual_clip=None):
    """rollmesh.training.grpo.clipped_policy_loss as of commit c181653, verbatim."""
    ratio = torch.exp(new_logprobs - batch.behaviour_logprobs)
    advantages = batch.advantages[:, None]
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps) * advantages
    objective = torch.minimum(unclipped, clipped)
    if dual_clip is not None:
        objective = torch.where(advantages < 0, torch.maximum(objective, dual_clip * advantages), objective)
    per_token = -objective
    trained = batch.mask.sum().clamp(min=1.0)
    loss = (per_token * batch.mask).sum() / trained
    with torch.no_grad():
        clip_fraction = (((ratio - 1).abs() > clip_eps).float() * batch.mask).sum() / trained
        mean_ratio = (ratio * batch.mask).sum() / trained
    return loss, {"clip_fraction": float(clip_fraction), "mean_ratio": float(mean_ratio)}


def random_samples(seed: int, count: int = 6) -> list[PolicySample]:
    generator = torch.Generator().manual_seed(seed)
    samples = []
    for _ in range(count):
        length = int(torch.randint(4, 12, (1,), generator=generator))
        tokens = torch.randint(3, 250, (length,), generator=generator).tolist()
        mask = [0] * 2 + (torch.rand(length - 2, generator=generator) > 0.2).int().tolist()
        behaviour = [0.0, 0.0] + (-torch.rand(length - 2, generator=generator) * 8).tolist()
        advantage = float(torch.randn(1, generator=generator))
        samples.append(PolicySample(tokens, mask, behaviour, advantage, versions=[-1, -1] + [0] * (length - 2)))
    return samples


def test_default_config_gives_the_old_loss_and_gradients_bit_for_bit():
    config = TrainerConfig()
    batch = PolicyBatch.collate(random_samples(0), pad_id=PAD_ID)
    generator = torch.Generator().manual_seed(2)
    logits = torch.randn(*batch.targets.shape, 260, generator=generator) * 3

    old_logits = logits.clone().requires_grad_(True)
    old_loss, old_stats = legacy_clipped_policy_loss(token_logprobs(old_logits, batch.targets), batch,
                                                     clip_eps=config.clip_eps, dual_clip=config.dual_clip)
    old_loss.backward()
    new_logits = logits.clone().requires_grad_(True)
    loss, stats = policy_loss(token_logprobs(new_logits, batch.targets), batch,
                              LossSettings.from_config(config), current_version=7)
    loss.backward()

    assert torch.equal(loss, old_loss)
    assert torch.equal(new_logits.grad, old_logits.grad)
    assert stats["clip_fraction"] == old_stats["clip_fraction"] and stats["clip_fraction"] > 0
    assert stats["mean_ratio"] == old_stats["mean_ratio"]


def legacy_policy_step(backend: TorchTrainerBackend, samples: list[PolicySample]) -> None:
    """TorchTrainerBackend.policy_step as of commit c181653, on the legacy loss."""
    batch = PolicyBatch.collate(samples, pad_id=PAD_ID)
    for _ in range(backend.config.ppo_epochs):
        new_logprobs = token_logprobs(backend.model(batch.inputs), batch.targets)
        loss, _ = legacy_clipped_policy_loss(new_logprobs, batch, clip_eps=backend.config.clip_eps,
                                             dual_clip=backend.config.dual_clip)
        backend.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(backend.model.parameters(), backend.config.grad_clip)
        backend.optimizer.step()


def test_default_config_trains_the_same_weights_as_the_old_backend_bit_for_bit(demo_model_dir: Path):
    torch.set_num_threads(1)
    config = TrainerConfig(lr=1e-2)  # ppo_epochs 2, dual clip 3: the defaults
    model = ModelConfig(path=str(demo_model_dir))
    old, new = TorchTrainerBackend(model, config), TorchTrainerBackend(model, config)
    for step in range(3):
        samples = random_samples(10 + step)
        legacy_policy_step(old, samples)
        new.policy_step(samples, current_version=step)
    old_weights, new_weights = old.state_dict(), new.state_dict()
    assert all(torch.equal(old_weights[name], new_weights[name]) for name in old_weights)
    untrained = TorchTrainerBackend(model, config).state_dict()
    assert any(not torch.equal(untrained[name], new_weights[name]) for name in untrained)  # it trained


def test_trainer_config_defaults_select_ppo_clip_without_correction_kl_or_entropy():
    settings = LossSettings.from_config(TrainerConfig())
    assert settings == LossSettings(loss="ppo_clip", clip_eps=0.2, dual_clip=3.0)
    assert not settings.decoupled
    assert not LossSettings.from_config(TrainerConfig(is_cap=0.0)).decoupled  # 0 also means off
    assert LossSettings.from_config(TrainerConfig(is_cap=2.0, policy_loss="grpo")).decoupled


# --- the backend -------------------------------------------------------------------------------

def on_policy(backend: TorchTrainerBackend, tokens: list[int], mask: list[int], advantage: float,
              *, versions: list[int] | None = None) -> PolicySample:
    """A sample whose behaviour logprobs are the backend's own, as if it had generated the tokens."""
    batch = PolicyBatch.collate([PolicySample(tokens, mask, [0.0] * len(tokens), 0.0)], pad_id=PAD_ID)
    with torch.no_grad():
        logprobs = token_logprobs(backend.model(batch.inputs), batch.targets)[0].tolist()
    return PolicySample(tokens, mask, [0.0, *logprobs], advantage, versions=versions)


@pytest.fixture
def backend_with(demo_model_dir: Path):
    """``backend_with(**trainer_config)``: a torch backend on the demo model."""

    def build(**config) -> TorchTrainerBackend:
        torch.set_num_threads(1)
        return TorchTrainerBackend(ModelConfig(path=str(demo_model_dir)),
                                   TrainerConfig(**{"lr": 1e-2, "ppo_epochs": 1, "seed": 0, **config}))

    return build


def test_kl_reference_is_the_weights_at_the_first_policy_step_after_the_warm_start(backend_with):
    backend = backend_with(kl_coef=0.1)
    backend.sft_step([([1, 5, 6, 7], [0, 1, 1, 1])], lr=1e-2)

    def samples() -> list[PolicySample]:
        return [on_policy(backend, [1, 10, 20, 30], [0, 1, 1, 1], 1.0),
                on_policy(backend, [1, 11, 21, 31], [0, 1, 1, 1], -1.0)]

    first = backend.policy_step(samples())
    assert first["kl"] == 0.0  # the reference is the weights being trained
    second = backend.policy_step(samples())
    assert second["kl"] > 0.0  # the first step moved the policy away from its reference
    backend.sft_step([([1, 5, 6, 7], [0, 1, 1, 1])], lr=1e-2)
    assert backend.policy_step(samples())["kl"] == 0.0  # supervised steps move the reference on


def test_backend_decoupled_ppo_on_on_policy_samples_has_unit_weights_and_ratios(backend_with):
    backend = backend_with(is_cap=2.0, ppo_epochs=2, entropy_coef=0.01, policy_loss="grpo")
    stats = backend.policy_step([on_policy(backend, [1, 2, 3, 4], [0, 1, 1, 1], 1.0),
                                 on_policy(backend, [1, 5, 6], [0, 1, 1], -1.0)])
    assert stats["is_weight_mean"] == pytest.approx(1.0, abs=1e-5)
    assert stats["is_capped_fraction"] == 0.0
    assert stats["entropy"] > 0.0
    assert set(stats) >= {"loss", "grad_norm", "clip_fraction", "mean_ratio"}


@pytest.mark.parametrize("temperature", [0.6, 1.7])
def test_backend_ratios_are_one_on_tokens_the_engine_sampled_at_the_rollouts_temperature(backend_with, temperature):
    """The engine's behaviour logprobs are of the tempered distribution (engine/sampling.py); a
    sample carrying that temperature has ratio 1 on its first epoch, and one without it does not."""
    from rollmesh.engine.sampling import sample_tokens

    backend = backend_with(ppo_epochs=1)
    generator = torch.Generator().manual_seed(0)
    tokens, logprobs = [1, 5, 6], [0.0, 0.0, 0.0]
    with torch.no_grad():
        for _ in range(6):  # what the engine would generate, one token at a time
            last = backend.model(torch.tensor([tokens]))[:, -1]
            chosen, logprob = sample_tokens(last, torch.tensor([temperature]), torch.tensor([1.0]), generator)
            tokens.append(int(chosen[0]))
            logprobs.append(float(logprob[0]))
    mask = [0, 0, 0] + [1] * 6

    def mean_ratio(sample_temperature: float) -> float:
        fresh = backend_with(ppo_epochs=1)  # the same seed: the same weights as ``backend``
        return fresh.policy_step([PolicySample(tokens, mask, logprobs, 1.0, temperature=sample_temperature),
                                  PolicySample(tokens, mask, logprobs, -1.0, temperature=sample_temperature)])["mean_ratio"]

    assert mean_ratio(temperature) == pytest.approx(1.0, abs=1e-5)
    assert abs(mean_ratio(1.0) - 1.0) > 1e-2


def test_backend_stale_tokens_steer_nothing(backend_with):
    backend = backend_with(max_token_lag=1)
    stats = backend.policy_step([on_policy(backend, [1, 2, 3, 4], [0, 1, 1, 1], 1.0, versions=[-1, 3, 3, 3]),
                                 on_policy(backend, [1, 5, 6], [0, 1, 1], -1.0, versions=[-1, 2, 4])],
                                current_version=5)
    # Lags 2, 2, 2, 3, 1: only the last token (lag 1) trains.
    assert (stats["stale_tokens"], stats["trained_tokens"]) == (4.0, 1.0)
    everything_stale = backend_with(max_token_lag=0)
    before = everything_stale.state_dict()
    stats = everything_stale.policy_step([on_policy(everything_stale, [1, 2, 3], [0, 1, 1], 1.0,
                                                    versions=[-1, 3, 3])], current_version=5)
    assert stats["trained_tokens"] == 0.0 and stats["loss"] == 0.0
    after = everything_stale.state_dict()
    assert all(torch.equal(before[name], after[name]) for name in before)


def test_logprob_mismatch_is_the_first_epochs_mean_gap_over_generated_trained_tokens():
    """By hand: trained tokens (mask 1, healthy sample) the engine generated (version >= 0);
    the gap is |proximal - behaviour| (the first epoch's logprobs), not the current epoch's."""
    new = torch.tensor([[-1.0, -0.5, -2.0], [-0.2, -1.0, -3.0]])
    proximal = torch.tensor([[-1.1, -0.4, -9.0], [-0.3, -1.5, -7.0]])
    # Sample 0's third token is masked (tool); sample 1's third was forced (version -1).
    batch = batch_of(MASK, BEHAVIOUR, ADVANTAGES, versions=[[3, 3, -1], [2, 2, -1]])
    _, stats = policy_loss(new, batch, PPO, proximal_logprobs=proximal)
    # |-1.1 - -1.0| = 0.1, |-0.4 - -0.8| = 0.4, |-0.3 - -0.2| = 0.1, |-1.5 - -0.9| = 0.6
    assert stats["logprob_mismatch"] == pytest.approx((0.1 + 0.4 + 0.1 + 0.6) / 4, rel=1e-6)
    # Without proximal logprobs (the first epoch) it is the new logprobs' gap, versions unknown:
    # every trained token counts, the forced one too (|-3 - -1| = 2).
    _, stats = policy_loss(new, batch_of(MASK, BEHAVIOUR, ADVANTAGES), PPO)
    assert stats["logprob_mismatch"] == pytest.approx((0.0 + 0.3 + 0.0 + 0.1 + 2.0) / 5, rel=1e-6)
    # A sample that carries no versions (all NO_VERSION once collated) counts all its trained tokens.
    batch = batch_of(MASK, BEHAVIOUR, ADVANTAGES, versions=[[3, 3, -1], [-1, -1, -1]])
    _, stats = policy_loss(new, batch, PPO, proximal_logprobs=proximal)
    assert stats["logprob_mismatch"] == pytest.approx((0.1 + 0.4 + 0.1 + 0.6 + 6.0) / 5, rel=1e-6)
    # An infrastructure-failed sample counts nowhere.
    _, stats = policy_loss(new, batch_of(MASK, BEHAVIOUR, ADVANTAGES, infra_failed=[False, True]), PPO)
    assert stats["logprob_mismatch"] == pytest.approx(0.3 / 2, rel=1e-6)


def test_policy_epochs_report_the_first_epochs_logprob_mismatch():
    """Two epochs whose logits the "update" moves: the stat stays the first epoch's gap."""
    from rollmesh.training.losses import policy_epochs

    batch = batch_of([[1, 1]], [[math.log(0.5), math.log(0.5)]], [1.0])
    logits = torch.zeros(1, 2, 2, requires_grad=True)  # uniform over 2 tokens: logprob log 0.5
    shift = {"value": 0.0}

    def update(loss):
        shift["value"] += 1.0  # the next epoch's logits differ: target 0's logprob changes
        return 0.0

    stats = policy_epochs(batch, PPO, epochs=2, update=update,
                          logits=lambda: logits + torch.tensor([shift["value"], 0.0]))
    assert stats["logprob_mismatch"] == 0.0 and stats["mean_ratio"] != pytest.approx(1.0)
