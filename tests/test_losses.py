"""Loss types as token weights, and the GRPO objective, on small hand-computed cases.

The model is V=2, H=1 with weight [[1], [0]]: the logits of hidden x are [x, 0], so for target 0
logp = x - log(1 + e^x) and d logp / dx = 1 - sigmoid(x). Everything below is worked out by hand from that.
"""

import math

import pytest
import torch

from fastgrpo.kernels import linear_grpo_loss
from fastgrpo.algorithms.losses import GlobalCounts, token_weights, truncated_importance_weights

W = torch.tensor([[1.0], [0.0]])


def _logp(x: float) -> float:
    return x - math.log1p(math.exp(x))


def _dlogp(x: float) -> float:
    return 1 - 1 / (1 + math.exp(-x))


LENGTHS = torch.tensor([1, 3])
COUNTS = GlobalCounts(num_sequences=2, num_tokens=4, max_completion_length=4)


@pytest.mark.parametrize("loss_type,expected", [
    ("grpo", [1 / 2, 1 / 6, 1 / 6, 1 / 6]),
    ("dapo", [1 / 4] * 4),
    ("bnpo", [1 / 4] * 4),
    ("dr_grpo", [1 / 8] * 4),
])
def test_token_weights_by_loss_type(loss_type, expected):
    w = token_weights(loss_type, LENGTHS, COUNTS)
    assert torch.allclose(w, torch.tensor(expected))


def test_global_counts_not_local_ones_set_the_scale():
    # This rank holds 2 of 4 global sequences: its weights are halved relative to owning everything.
    w = token_weights("grpo", LENGTHS, GlobalCounts(num_sequences=4, num_tokens=8, max_completion_length=4))
    assert torch.allclose(w, torch.tensor([1 / 4, 1 / 12, 1 / 12, 1 / 12]))


def test_unknown_loss_type():
    with pytest.raises(ValueError, match="loss_type"):
        token_weights("ppo", LENGTHS, COUNTS)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
def test_policy_gradient_value_and_grad_by_hand(loss_type):
    xs = [0.3, -1.2, 0.7, 2.0]
    adv = [1.5, -0.5, -0.5, -0.5]  # sequence 0 has A=1.5, sequence 1 (3 tokens) A=-0.5
    w = token_weights(loss_type, LENGTHS, COUNTS)
    hidden = torch.tensor(xs).view(4, 1).requires_grad_(True)
    loss, _ = linear_grpo_loss(hidden, W, torch.zeros(4, dtype=torch.long), torch.tensor(adv), w)
    # old = logp.detach(): r = 1, no clipping, l_n = -A_n, dl/dx_n = -A_n * dlogp/dx_n
    assert loss.item() == pytest.approx(sum(-a * wn for a, wn in zip(adv, w.tolist())), rel=1e-6)
    loss.backward()
    expect = [-a * wn * _dlogp(x) for a, wn, x in zip(adv, w.tolist(), xs)]
    assert torch.allclose(hidden.grad.view(-1), torch.tensor(expect), rtol=1e-5, atol=1e-7)


def test_kl_k3_value_and_grad_by_hand():
    x, ref, beta = 0.4, -0.9, 0.1
    hidden = torch.tensor([[x]], requires_grad=True)
    loss, stats = linear_grpo_loss(hidden, W, torch.tensor([0]), torch.tensor([0.0]), torch.tensor([1.0]),
                                   ref_logprobs=torch.tensor([ref]), beta=beta)
    d = ref - _logp(x)
    assert loss.item() == pytest.approx(beta * (math.exp(d) - d - 1), rel=1e-5)
    loss.backward()
    # d/dlogp [exp(ref-logp) - (ref-logp) - 1] = -exp(d) + 1
    assert hidden.grad.item() == pytest.approx(beta * (1 - math.exp(d)) * _dlogp(x), rel=1e-5)


@pytest.mark.parametrize("adv,old_shift,clipped", [
    (1.0, -1.0, True),    # r = e > 1 + eps with A > 0: clipped, no gradient
    (1.0, +1.0, False),   # r = 1/e < 1 - eps with A > 0: min picks the unclipped term, gradient flows
    (-1.0, +1.0, True),   # r < 1 - eps with A < 0: clipped
    (-1.0, -1.0, False),  # r > 1 + eps with A < 0: unclipped (pessimistic) term, gradient flows
])
def test_clipping_by_hand(adv, old_shift, clipped):
    x = 0.2
    old = _logp(x) + old_shift
    hidden = torch.tensor([[x]], requires_grad=True)
    loss, _ = linear_grpo_loss(hidden, W, torch.tensor([0]), torch.tensor([adv]), torch.tensor([1.0]),
                               old_logprobs=torch.tensor([old]), epsilon_low=0.2, epsilon_high=0.2)
    r = math.exp(-old_shift)
    clip_r = min(max(r, 0.8), 1.2)
    assert loss.item() == pytest.approx(-min(r * adv, clip_r * adv), rel=1e-5)
    loss.backward()
    if clipped:
        assert hidden.grad.abs().item() < 1e-8
    else:
        assert hidden.grad.item() == pytest.approx(-adv * r * _dlogp(x), rel=1e-5)


def test_delta_caps_the_unclipped_ratio():
    x = 0.2
    old = _logp(x) - 2.0  # r = e^2 ~ 7.4, A < 0: unclipped branch, capped at delta
    hidden = torch.tensor([[x]], requires_grad=True)
    loss, _ = linear_grpo_loss(hidden, W, torch.tensor([0]), torch.tensor([-1.0]), torch.tensor([1.0]),
                               old_logprobs=torch.tensor([old]), delta=3.0)
    assert loss.item() == pytest.approx(3.0, rel=1e-5)  # -min(3 * -1, 1.2 * -1) = 3


def test_truncated_importance_weights():
    old = torch.tensor([0.0, -1.0, -2.0])
    sampler = torch.tensor([0.0, -2.0, -0.5])
    w = truncated_importance_weights(old, sampler, cap=2.0)
    assert torch.allclose(w, torch.tensor([1.0, 2.0, math.exp(-1.5)]))
