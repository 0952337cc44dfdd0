"""Sequence-level importance sampling (GSPO) in linear_grpo_loss: a hand-computed case, and the torch path
against the float64 reference (the Triton path runs the same comparison in interpret_cases.py)."""

import math

import pytest
import torch
from _cases import assert_small, grpo_errors

from benchmarks.harness import Shape
from fastgrpo.kernels import linear_grpo_loss, reference_linear_grpo_loss


def _hand_case():
    # V = 2, H = 1, weight rows [0] and [1]: logits [0, h], target 1, so logp = h - log(1 + e^h) and
    # d logp / d h = 1 - sigmoid(h). Tokens 0, 1 are sequence 0; token 2 is sequence 1.
    h = torch.tensor([[0.4], [-0.3], [1.1]], dtype=torch.float64, requires_grad=True)
    weight = torch.tensor([[0.0], [1.0]], dtype=torch.float64)
    targets = torch.tensor([1, 1, 1])
    logp = (h[:, 0] - torch.log1p(torch.exp(h[:, 0]))).detach()
    old = logp - torch.tensor([0.3, 0.1, -0.5], dtype=torch.float64)  # log ratios 0.3, 0.1 | -0.5
    adv = torch.tensor([1.0, 1.0, -1.0], dtype=torch.float64)
    tw = torch.tensor([0.5, 0.25, 0.25], dtype=torch.float64)
    seq = torch.tensor([0, 0, 1])
    return h, weight, targets, adv, tw, old, seq


@pytest.mark.parametrize("fn", ["reference", "torch"])
def test_gspo_loss_and_gradient_by_hand(fn):
    h, weight, targets, adv, tw, old, seq = _hand_case()
    kw = dict(old_logprobs=old, epsilon_low=0.3, epsilon_high=0.3, sequence_index=seq)
    if fn == "reference":
        loss, stats = reference_linear_grpo_loss(h, weight, targets, adv, tw, **kw)
    else:  # the fused op in float32
        h = h.detach().float().requires_grad_()
        loss, stats = linear_grpo_loss(h, weight.float(), targets, adv.float(), tw.float(), backend="torch",
                                       **{**kw, "old_logprobs": old.float()})
    # sequence 0: s = exp(mean(0.3, 0.1)) = e^0.2 = 1.221 inside [0.7, 1.3] -> each token -s * A = -e^0.2;
    # sequence 1: s = e^-0.5 = 0.607 < 0.7 with A = -1 -> clipped: -min(-0.607, -0.7) = 0.7, no gradient.
    s0 = math.exp(0.2)
    assert loss.item() == pytest.approx(-(0.5 + 0.25) * s0 + 0.25 * 0.7, rel=1e-6)
    assert stats["clip_low_frac"].item() == pytest.approx(1 / 3)
    loss.backward()
    # d loss / d logp_t for t in sequence 0: sum over its tokens u of -w_u * A * s * (1 / 2) = -(0.75 / 2) * s,
    # the same for both tokens (a token-level ratio would give -0.5 * r_0 and -0.25 * r_1 instead).
    sig = torch.sigmoid(h.detach()[:, 0].double())
    expected = torch.stack([-(0.75 / 2) * s0 * (1 - sig[0]), -(0.75 / 2) * s0 * (1 - sig[1]),
                            torch.tensor(0.0, dtype=torch.float64)])
    assert torch.allclose(h.grad[:, 0].double(), expected, rtol=1e-5, atol=1e-7)


def test_gspo_with_one_token_per_sequence_equals_token_level():
    h, weight, targets, adv, tw, old, _ = _hand_case()
    a, _ = reference_linear_grpo_loss(h, weight, targets, adv, tw, old_logprobs=old)
    b, _ = reference_linear_grpo_loss(h, weight, targets, adv, tw, old_logprobs=old, sequence_index=torch.arange(3))
    assert a.item() == pytest.approx(b.item())


@pytest.mark.parametrize("case", [dict(), dict(beta=0.1, delta=1.3), dict(old=False)],
                         ids=["old", "beta-delta", "no-old"])
def test_torch_gspo_matches_float64_reference(case):
    errs = grpo_errors(Shape(n=53, h=24, v=75), dtype=torch.float32, backend="torch", zero_weight_frac=0.3,
                       chunk_size=16, seed=4, sequences=6, **case)
    assert_small(errs, 1e-5)
