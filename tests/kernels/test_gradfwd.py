"""The "cublas" loss path's pieces that run without Triton's interpreter: its closed-form token-loss derivative
against autograd, and backend selection / errors. (Its kernels run in interpret_cases.py and test_gpu.py.)"""

import pytest
import torch

from benchmarks.harness import Shape, make_inputs
from fastgrpo.kernels import linear_grpo_loss, linear_logprobs, resolve_backend
from fastgrpo.kernels.grpo_loss import grpo_token_loss

_gradfwd = pytest.importorskip("fastgrpo.kernels._gradfwd", reason="needs triton")


def _autograd_coefficient(logp, adv, w, **kw):
    leaf = logp.clone().requires_grad_()
    per_token, _, _ = grpo_token_loss(leaf, adv, **kw)
    (grad,) = torch.autograd.grad((w * per_token).sum(), leaf)
    return grad


@pytest.mark.parametrize(
    "case",
    [dict(), dict(old=True), dict(old=True, delta=1.25), dict(old=True, beta=0.05), dict(beta=0.2, delta=1.1),
     dict(old=True, epsilon_low=0.0, epsilon_high=0.0)],
    ids=["old-none", "old", "old-delta", "old-beta", "old-none-beta-delta", "zero-epsilon"],
)
def test_closed_form_coefficient_equals_autograd(case):
    gen = torch.Generator().manual_seed(0)
    n = 4000
    logp = -torch.rand(n, generator=gen) * 5
    adv = torch.randn(n, generator=gen)
    adv[::7] = 0.0  # groups with equal rewards
    w = torch.rand(n, generator=gen)
    old = (logp + 0.3 * torch.randn(n, generator=gen)) if case.get("old") else None
    ref = (logp + 0.2 * torch.randn(n, generator=gen)) if case.get("beta") else None
    kw = dict(old_logprobs=old, ref_logprobs=ref, epsilon_low=case.get("epsilon_low", 0.2),
              epsilon_high=case.get("epsilon_high", 0.28), delta=case.get("delta"), beta=case.get("beta", 0.0))
    ours = _gradfwd.grpo_logp_grad(logp, adv, w, **kw)
    torch.testing.assert_close(ours, _autograd_coefficient(logp, adv, w, **kw), rtol=1e-6, atol=1e-7)
    if old is not None:  # both clip branches and the unclipped one were exercised
        ratio = torch.exp(logp - old)
        assert ((ratio > 1.28) & (adv > 0)).any() and ((ratio < 0.8) & (adv < 0)).any()


def test_backend_selection_and_errors():
    inp = make_inputs(Shape(n=8, h=16, v=40), dtype=torch.float32, seed=1)
    h, w = inp["hidden"], inp["weight"]
    assert resolve_backend("auto", h.device, needs_grad=True) == "torch"  # CPU
    assert resolve_backend("auto", h.device, needs_grad=False) == "torch"
    args = [inp[k] for k in ("hidden", "weight", "targets", "advantages", "token_weights")]
    if not _gradfwd.INTERPRET:
        with pytest.raises(ValueError, match="cublas.*CUDA"):
            linear_grpo_loss(*args, backend="cublas")
    with pytest.raises(ValueError, match="backend must be one of"):
        linear_grpo_loss(*args, backend="cuda")
    with pytest.raises(ValueError, match="no backward"):
        linear_logprobs(h, w, inp["targets"], backend="cublas")  # differentiable inputs
    if not _gradfwd.INTERPRET:
        with torch.no_grad(), pytest.raises(ValueError, match="cublas.*CUDA"):
            linear_logprobs(h, w, inp["targets"], backend="cublas")
