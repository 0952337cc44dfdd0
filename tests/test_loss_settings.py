"""The policy loss's settings as one type from config to kernel, and the loss-type table as the one place a loss
type is declared for fastgrpo's trainer, the TRL adapter and the Liger-shaped module."""

import types

import pytest
import torch

import fastgrpo.algorithms.tokens as tokens
from fastgrpo.algorithms.losses import GlobalCounts, token_weights
from fastgrpo.algorithms.tokens import PolicyObjective
from fastgrpo.config import ConfigError, GRPOConfig, RolloutConfig, load_config
from fastgrpo.kernels import (FusedLinearGRPOLoss, LossSettingError, LossSettings, fused_grpo_loss,
                              linear_grpo_loss)
from fastgrpo.kernels.loss_types import LOSS_TYPES, LossType, add_loss_type, sequence_sum
from fastgrpo.kernels.module import padded_grpo_loss


def _padded(seed=0, b=3, t=5, h=8, v=11):
    g = torch.Generator().manual_seed(seed)
    mask = (torch.arange(t)[None] < torch.tensor([t, 2, 4])[:, None]).float()  # [B, T], ragged
    return dict(x=torch.randn(b, t, h, generator=g), w=torch.randn(v, h, generator=g),
                ids=torch.randint(0, v, (b, t), generator=g), mask=mask, adv=torch.tensor([1.0, -0.5, 0.3]),
                old=-2.0 - torch.rand(b, t, generator=g))


def test_a_new_loss_type_is_one_row_for_the_trainer_trl_and_liger():
    # a combination no built-in type has: sapo's gate under luspo's normaliser (sequence sums, mean over sequences)
    add_loss_type("sapo_sums", LossType("sapo", sequence_sum, trl=sequence_sum, liger=sequence_sum))
    try:
        cfg = load_config(None, ["grpo.loss_type=sapo_sums"])
        assert cfg.grpo.loss_settings().policy_loss == "sapo"
        w = token_weights("sapo_sums", torch.tensor([2, 3]), GlobalCounts(num_sequences=4, num_tokens=5))
        assert w.tolist() == [0.25] * 5  # 1 / S for every token
        d = _padded()
        loss, _ = FusedLinearGRPOLoss(beta=0.0, loss_type="sapo_sums", backend="torch")(
            d["x"], d["w"], d["ids"], d["mask"], d["adv"], old_per_token_logps=d["old"])
        want, _ = padded_grpo_loss(d["x"], d["w"], d["ids"], d["mask"], d["adv"], d["mask"] / 3,
                                   LossSettings(policy_loss="sapo"), old_logprobs=d["old"], backend="torch")
        assert loss.item() == pytest.approx(want.item(), rel=1e-6)
        trl = pytest.importorskip("fastgrpo.integrations.trl")
        trl._refuse_config(types.SimpleNamespace(loss_type="sapo_sums", entropy_coef=0.0, use_adaptive_entropy=False))
    finally:
        LOSS_TYPES.pop("sapo_sums", None)


def test_a_row_with_an_unknown_term_is_refused():
    with pytest.raises(ValueError, match="policy_loss must be one of"):
        add_loss_type("bad", LossType("ppo", sequence_sum))
    assert "bad" not in LOSS_TYPES


@pytest.mark.parametrize("field, value", [("sapo_temperature_pos", 0.0), ("sapo_temperature_neg", -1.0),
                                          ("delta", 0.0), ("epsilon_low", -0.1), ("epsilon_high", -0.1),
                                          ("beta", -0.5)])
def test_each_setting_is_checked_by_the_type_wherever_it_is_set(field, value):
    with pytest.raises(LossSettingError, match=field) as err:
        LossSettings(**{field: value})
    assert err.value.field == field
    d = _padded()
    with pytest.raises(ValueError, match=field):  # the kernel's keyword interface
        linear_grpo_loss(d["x"][0], d["w"], d["ids"][0], torch.ones(5), torch.ones(5), **{field: value})
    with pytest.raises(ValueError, match=field):  # Liger's constructor options
        FusedLinearGRPOLoss(**{field: value})
    with pytest.raises(ConfigError, match=f"grpo[.]{field}"):  # the config, under its own key
        load_config(None, [f"grpo.{field}={value}"])


def test_the_sequence_level_needs_the_rows_sequences_and_the_token_level_refuses_them():
    d = _padded()
    args = (d["x"][0], d["w"], d["ids"][0], torch.ones(5), torch.ones(5))
    with pytest.raises(ValueError, match="importance_sampling_level='sequence' needs sequence_index"):
        fused_grpo_loss(*args, LossSettings(importance_sampling_level="sequence"))
    with pytest.raises(ValueError, match="importance_sampling_level='token' takes no sequence_index"):
        fused_grpo_loss(*args, LossSettings(), sequence_index=torch.zeros(5, dtype=torch.long))


@pytest.mark.parametrize("grpo, want", [
    (dict(loss_type="sapo", beta=0.04, sapo_temperature_neg=2.0),
     dict(policy_loss="sapo", beta=0.04, sapo_temperature_neg=2.0, epsilon_low=0.2)),
    (dict(loss_type="grpo", importance_sampling_level="sequence", sequence_epsilon_low=0.01),
     dict(policy_loss="clip", importance_sampling_level="sequence", epsilon_low=0.01, epsilon_high=4e-4)),
    (dict(loss_type="cispo", importance_sampling_level="sequence", epsilon_high=5.0),  # cispo's bound: one eps_max
     dict(policy_loss="cispo", epsilon_low=3e-4, epsilon_high=5.0)),
])
def test_the_trainer_passes_its_one_settings_object_to_the_kernel(grpo, want, monkeypatch):
    cfg = GRPOConfig(**grpo)
    objective = PolicyObjective.from_config(cfg, RolloutConfig(temperature=0.9), "cpu")
    assert objective.settings == cfg.loss_settings(temperature=0.9)
    assert {k: getattr(objective.settings, k) for k in want} == want and objective.settings.temperature == 0.9
    seen = []

    def spy(*args, **kwargs):
        seen.append(args[5])
        return fused_grpo_loss(*args, **kwargs)

    monkeypatch.setattr(tokens, "fused_grpo_loss", spy)
    d = _padded()
    n = 5
    rows = dict(targets=d["ids"][0], advantages=torch.full((n,), 0.7), weights=torch.full((n,), 0.2),
                old_logprobs=d["old"][0], ref_logprobs=d["old"][0] + 0.1)
    if objective.sequence_level:
        rows["sequence_index"] = torch.zeros(n, dtype=torch.long)
    loss, _ = objective.compute_loss(d["x"][0], d["w"], **rows)
    assert seen == [objective.settings] and seen[0] is objective.settings
    # the keyword interface is a thin layer over the same settings
    s = objective.settings
    kw = dict(policy_loss=s.policy_loss, epsilon_low=s.epsilon_low, epsilon_high=s.epsilon_high, delta=s.delta,
              beta=s.beta, temperature=s.temperature, sapo_temperature_pos=s.sapo_temperature_pos,
              sapo_temperature_neg=s.sapo_temperature_neg, use_bias_correction_kl=s.use_bias_correction_kl)
    same, _ = linear_grpo_loss(d["x"][0], d["w"], rows["targets"], rows["advantages"], rows["weights"],
                               old_logprobs=rows["old_logprobs"], ref_logprobs=rows["ref_logprobs"] if s.beta else None,
                               sequence_index=rows.get("sequence_index"), backend=objective.backend, **kw)
    assert loss.item() == same.item()
