"""The oracle itself: reference_linear_grpo_loss against a case worked out by hand."""

import math

import pytest
import torch

from fastgrpo.kernels import reference_linear_grpo_loss, reference_linear_logprobs

# H=1, V=2: logits [0, ln 3] -> softmax [1/4, 3/4]; both tokens target id 1, so logp = ln(3/4) each.
# old = ln(1/2) -> r = 1.5.  Token 0: A=+1 (clipped branch, r > 1.2).  Token 1: A=-1 (unclipped branch).


def _case(dtype=torch.float64):
    hidden = torch.ones(2, 1, dtype=dtype, requires_grad=True)
    weight = torch.tensor([[0.0], [math.log(3.0)]], dtype=dtype, requires_grad=True)
    targets = torch.tensor([1, 1])
    advantages = torch.tensor([1.0, -1.0], dtype=dtype)
    token_weights = torch.tensor([0.5, 0.25], dtype=dtype)
    old = torch.full((2,), math.log(0.5), dtype=dtype)
    return hidden, weight, targets, advantages, token_weights, old


def test_reference_logprobs_and_entropy_by_hand():
    hidden, weight, targets, *_ = _case()
    logp, entropy = reference_linear_logprobs(hidden, weight, targets, return_entropy=True)
    assert torch.allclose(logp, torch.full((2,), math.log(0.75), dtype=torch.float64))
    h = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    assert torch.allclose(entropy, torch.full((2,), h, dtype=torch.float64))


def test_reference_grpo_loss_clipping_by_hand():
    hidden, weight, targets, adv, tw, old = _case()
    loss, stats = reference_linear_grpo_loss(hidden, weight, targets, adv, tw, old_logprobs=old)
    # token 0: -min(1.5*1, 1.2*1) = -1.2; token 1: -min(-1.5, -1.2) = 1.5
    assert loss.item() == pytest.approx(0.5 * -1.2 + 0.25 * 1.5)
    assert stats["clip_high_frac"].item() == pytest.approx(0.5)  # token 0: r > 1.2 and A > 0
    assert stats["clip_low_frac"].item() == 0.0
    loss.backward()
    # Token 0 sits in the flat clipped branch: no gradient reaches its hidden row.
    assert hidden.grad[0].abs().item() == 0.0
    # Token 1: l = -r*A = r, dl/dlogp = r = 1.5; dlogp/dh = w_1 - E_p[w] = ln3 - 0.75 ln3 = ln3 / 4.
    assert hidden.grad[1].item() == pytest.approx(0.25 * 1.5 * math.log(3.0) / 4)


def test_reference_grpo_loss_delta_and_kl_by_hand():
    hidden, weight, targets, adv, tw, old = _case()
    ref = torch.full((2,), math.log(0.5), dtype=torch.float64)
    loss, stats = reference_linear_grpo_loss(hidden, weight, targets, adv, tw, old_logprobs=old, ref_logprobs=ref,
                                             delta=1.3, beta=0.1)
    k3 = (2.0 / 3.0) - math.log(2.0 / 3.0) - 1.0  # exp(ref - logp) - (ref - logp) - 1
    # token 1 with delta: -min(min(1.5, 1.3) * -1, 1.2 * -1) = 1.3
    expected = 0.5 * (-1.2 + 0.1 * k3) + 0.25 * (1.3 + 0.1 * k3)
    assert loss.item() == pytest.approx(expected)
    assert stats["kl_mean"].item() == pytest.approx(k3)


def test_reference_old_none_means_ratio_one():
    hidden, weight, targets, adv, tw, _ = _case()
    loss, stats = reference_linear_grpo_loss(hidden, weight, targets, adv, tw)
    assert loss.item() == pytest.approx(-(0.5 * 1.0 + 0.25 * -1.0))
    assert stats["clip_low_frac"].item() == 0.0 and stats["clip_high_frac"].item() == 0.0
