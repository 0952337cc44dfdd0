"""TokenObjective, the per-token GRPO loss every backend reads: its closed-form gradient against autograd, the facts
the backends skip work by, its validation; and the backend rule for the sequence-level ratio (check_backend)."""

import importlib.util

import pytest
import torch

from fastgrpo.kernels import TokenObjective, check_backend, linear_grpo_loss, resolve_backend


def _case(case, n=4000, seed=0):
    gen = torch.Generator().manual_seed(seed)
    logp = -torch.rand(n, generator=gen) * 5
    adv = torch.randn(n, generator=gen)
    adv[::7] = 0.0  # groups with equal rewards
    w = torch.rand(n, generator=gen)
    w[::11] = 0.0  # dropped tokens
    old = (logp + 0.3 * torch.randn(n, generator=gen)) if case.get("old") else None
    ref = (logp + 0.2 * torch.randn(n, generator=gen)) if case.get("beta") else None
    objective = TokenObjective(advantages=adv, old_logprobs=old, ref_logprobs=ref,
                               epsilon_low=case.get("epsilon_low", 0.2), epsilon_high=case.get("epsilon_high", 0.28),
                               delta=case.get("delta"), beta=case.get("beta", 0.0))
    return objective, logp, w


CASES = [dict(), dict(old=True), dict(old=True, delta=1.25), dict(old=True, beta=0.05), dict(beta=0.2, delta=1.1),
         dict(old=True, epsilon_low=0.0, epsilon_high=0.0)]
IDS = ["old-none", "old", "old-delta", "old-beta", "old-none-beta-delta", "zero-epsilon"]


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_closed_form_gradient_equals_autograd(case):
    objective, logp, w = _case(case)
    leaf = logp.clone().requires_grad_()
    per_token, _, _ = objective.token_loss(leaf, w != 0)
    (expected,) = torch.autograd.grad((w * per_token).sum(), leaf)
    torch.testing.assert_close(objective.logp_grad(logp, w), expected, rtol=1e-6, atol=1e-7)
    if objective.old_logprobs is not None:  # both clip branches and the unclipped one were exercised
        ratio, adv = torch.exp(logp - objective.old_logprobs), objective.advantages
        assert ((ratio > 1.28) & (adv > 0)).any() and ((ratio < 0.8) & (adv < 0)).any()


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_skip_facts_hold_for_any_logp(case):
    # The backends skip rows outside moving() and form g once when not grad_depends_on_logp: both must hold for
    # every log-prob, so two unrelated draws must agree.
    objective, logp, w = _case(case)
    other = -torch.rand(logp.shape, generator=torch.Generator().manual_seed(9)) * 8
    g, g_other = objective.logp_grad(logp, w), objective.logp_grad(other, w)
    still = ~objective.moving(w != 0)
    assert still.any() and (g[still] == 0).all() and (g_other[still] == 0).all()
    assert objective.grad_depends_on_logp == (not torch.equal(g, g_other))


def test_rows_restricts_every_row_vector():
    objective, logp, w = _case(dict(old=True, beta=0.1), n=50)
    idx = torch.tensor([3, 17, 41])
    by_index = objective.rows(idx).logp_grad(logp[idx], w[idx])
    by_slice = objective.rows(slice(3, 6)).logp_grad(logp[3:6], w[3:6])
    full = objective.logp_grad(logp, w)
    assert torch.equal(by_index, full[idx]) and torch.equal(by_slice, full[3:6])


@pytest.mark.parametrize("kw, message", [
    (dict(beta=0.1), "beta != 0 needs ref_logprobs"),
    (dict(epsilon_low=-0.1), "epsilon_low / epsilon_high must be >= 0"),
    (dict(delta=0.0), "delta must be > 0"),
    (dict(old_logprobs=torch.zeros(3)), r"old_logprobs must be \[N\]=4, got \(3,\)"),
    (dict(sequence_index=torch.zeros(4, 1, dtype=torch.long)), r"sequence_index must be \[N\]=4"),
])
def test_linear_grpo_loss_rejects_bad_settings_by_name(kw, message):
    with pytest.raises(ValueError, match=message):
        linear_grpo_loss(torch.randn(4, 3), torch.randn(5, 3), torch.zeros(4, dtype=torch.long), torch.ones(4),
                         torch.ones(4), **kw)


def test_check_backend_refuses_sequence_level_only_where_no_recompute_path():
    for name in ("auto", "cublas", "triton", "torch"):
        check_backend(name, sequence_level=False)
    for name in ("auto", "triton", "torch"):
        check_backend(name, sequence_level=True)
    with pytest.raises(ValueError, match="'cublas' has no sequence-level importance sampling"):
        check_backend("cublas", sequence_level=True)
    with pytest.raises(ValueError, match="backend must be one of"):
        check_backend("cuda", sequence_level=False)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="auto picks triton paths only with Triton")
def test_auto_on_cuda_runs_the_sequence_level_ratio_on_a_recompute_path():
    # "auto" touches no CUDA state, so this runs on a CPU machine too
    assert resolve_backend("auto", "cuda", needs_grad=True) == "cublas"
    assert resolve_backend("auto", "cuda", needs_grad=True, sequence_level=True) == "triton"
    assert resolve_backend("auto", "cuda", needs_grad=False, sequence_level=True) == "triton"
