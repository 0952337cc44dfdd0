"""The objectives TRL 1.16 has beside PPO's clip: cispo and sapo terms, the bias-corrected KL, the KL's own token
weights and an lm_head bias. Each against a reference written from TRL's definitions (kernels/reference.py, and a
padded-batch one here), closed-form gradients against autograd, and the fused paths on the torch backend (the
Triton and cublas paths: interpret_cases.py)."""

import pytest
import torch
from _cases import assert_small, grpo_errors

from benchmarks.harness import Shape, make_inputs, rel_err
from fastgrpo.kernels import (
    POLICY_LOSSES,
    TokenObjective,
    linear_grpo_loss,
    linear_logprobs,
    reference_linear_grpo_loss,
    reference_linear_logprobs,
)

SHAPE = Shape(n=53, h=24, v=75)
TOL = 1e-5


def _rows(n=3000, seed=0, old=True, beta=0.0):
    gen = torch.Generator().manual_seed(seed)
    logp = -torch.rand(n, generator=gen) * 5
    adv = torch.randn(n, generator=gen)
    adv[::7] = 0.0
    w = torch.rand(n, generator=gen)
    w[::11] = 0.0
    old_lp = (logp + 0.3 * torch.randn(n, generator=gen)) if old else None
    ref = (logp + 0.2 * torch.randn(n, generator=gen)) if beta else None
    kl_w = torch.rand(n, generator=gen)
    kl_w[::13] = 0.0
    return dict(logp=logp, adv=adv, w=w, old=old_lp, ref=ref, kl_w=kl_w)


# Settings of the per-token objective: every term, with and without old log-probs, the bias-corrected KL and the
# KL's own weights. epsilon_high 1.1 makes cispo's truncation bind on these ratios (TRL's advice is 5.0).
TERMS = [
    dict(policy_loss="cispo", epsilon_high=1.1),
    dict(policy_loss="cispo", epsilon_high=1.1, old=False),
    dict(policy_loss="sapo"),
    dict(policy_loss="sapo", old=False, sapo_temperature_pos=0.5, sapo_temperature_neg=2.0),
    dict(policy_loss="clip", beta=0.1, use_bias_correction_kl=True),
    dict(policy_loss="clip", beta=0.1, use_bias_correction_kl=True, old=False),
    dict(policy_loss="clip", beta=0.1, kl_weights=True, delta=1.3),
    dict(policy_loss="sapo", beta=0.05, kl_weights=True, use_bias_correction_kl=True),
    dict(policy_loss="cispo", epsilon_high=1.1, beta=0.05, kl_weights=True, old=False),
    dict(policy_loss="clip", kl_weights=True),  # beta 0: the KL's weights change nothing but the counted rows
]
TERM_IDS = ["cispo", "cispo-old-none", "sapo", "sapo-old-none-temps", "clip-biascorr", "clip-biascorr-old-none",
            "clip-klweights-delta", "sapo-klweights-biascorr", "cispo-klweights-old-none", "clip-klweights-beta0"]


def _objective(case, rows):
    case = dict(case)
    old, beta, kl_weights = case.pop("old", True), case.pop("beta", 0.0), case.pop("kl_weights", False)
    return TokenObjective(advantages=rows["adv"], old_logprobs=rows["old"] if old else None,
                          ref_logprobs=rows["ref"], beta=beta, kl_token_weights=rows["kl_w"] if kl_weights else None,
                          **case)


@pytest.mark.parametrize("case", TERMS, ids=TERM_IDS)
def test_closed_form_gradient_equals_autograd(case):
    rows = _rows(beta=case.get("beta", 0.0))
    objective = _objective(case, rows)
    leaf = rows["logp"].clone().requires_grad_()
    loss, _, _, _ = objective.weighted_loss(leaf, rows["w"])
    (expected,) = torch.autograd.grad(loss, leaf)
    torch.testing.assert_close(objective.logp_grad(rows["logp"], rows["w"]), expected, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("case", TERMS, ids=TERM_IDS)
def test_skip_facts_hold_for_any_logp(case):
    rows = _rows(beta=case.get("beta", 0.0))
    objective = _objective(case, rows)
    other = -torch.rand(rows["logp"].shape, generator=torch.Generator().manual_seed(9)) * 8
    g, g_other = objective.logp_grad(rows["logp"], rows["w"]), objective.logp_grad(other, rows["w"])
    still = ~objective.moving(rows["w"])
    assert still.any() and (g[still] == 0).all() and (g_other[still] == 0).all()
    assert objective.grad_depends_on_logp == (not torch.equal(g, g_other))
    assert not (objective.moving(rows["w"]) & ~objective.active(rows["w"])).any()


@pytest.mark.parametrize("case", TERMS, ids=TERM_IDS)
def test_weighted_loss_equals_the_trl_reference(case):
    # The objective on the reference's own float64 log-probs of a small head, against the reference loss
    # (kernels/reference.py, written from TRL's definitions): value, gradient through the head, statistics.
    n = 40
    rows = _rows(n=n, beta=case.get("beta", 0.0))
    objective = _objective(case, rows)
    inp = make_inputs(Shape(n=n, h=8, v=30), dtype=torch.float64, seed=5)
    hidden, weight, targets = inp["hidden"], inp["weight"], inp["targets"]
    kw = {k: v for k, v in case.items() if k not in ("old", "kl_weights")}
    kw.update(old_logprobs=objective.old_logprobs, ref_logprobs=objective.ref_logprobs,
              kl_token_weights=objective.kl_token_weights)
    ref_loss, ref_stats = reference_linear_grpo_loss(hidden, weight, targets, rows["adv"].double(),
                                                     rows["w"].double(), **kw)
    ref_grad = torch.autograd.grad(ref_loss, hidden)[0]
    logp = reference_linear_logprobs(hidden, weight, targets)
    ours, ratio, kl, counted = objective.weighted_loss(logp, rows["w"])
    ours_grad = torch.autograd.grad(ours, hidden)[0]
    assert ours.item() == pytest.approx(ref_loss.item(), rel=1e-6, abs=1e-9)
    torch.testing.assert_close(ours_grad, ref_grad, rtol=1e-5, atol=1e-8)
    stats = objective.stats(ratio, kl, counted)
    assert stats.keys() == ref_stats.keys() - {"logprobs"}
    for key in stats:
        assert stats[key].item() == pytest.approx(ref_stats[key].item(), abs=1e-6), key
    if case["policy_loss"] == "cispo" and case.get("old", True):  # the truncation binds on these rows
        assert stats["cispo_clip_frac"].item() > 0


def _trl_padded_loss(logp, old, ref, adv, mask, entropy_mask, is_ratio, *, loss_type, beta, eps_low, eps_high,
                     bias_corr, tau_pos=1.0, tau_neg=1.05):
    """TRL 1.16 ``_compute_loss`` on one padded micro-batch ``[B, T]`` (token level, no gradient accumulation),
    written from its definitions: the entropy mask and the vLLM ratio multiply the policy term only."""
    coef = torch.exp(logp - old)  # [B, T]
    if loss_type == "cispo":
        per_token = -torch.clamp(coef, max=eps_high).detach() * adv[:, None] * logp
    elif loss_type == "sapo":
        tau = torch.where(adv[:, None] > 0, tau_pos, tau_neg)
        per_token = -torch.sigmoid(tau * (coef - 1)) * 4 / tau * adv[:, None]
    else:
        clipped = torch.clamp(coef, 1 - eps_low, 1 + eps_high)
        per_token = -torch.min(coef * adv[:, None], clipped * adv[:, None])
    per_token = per_token * entropy_mask * is_ratio
    if beta:
        kl = torch.exp(ref - logp) - (ref - logp) - 1
        per_token = per_token + beta * (kl * coef if bias_corr else kl)
    if loss_type == "sapo":  # grpo's normaliser: sequence means, then the batch mean
        return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)).mean()
    return (per_token * mask).sum() / mask.sum()  # dapo's, with one micro-batch per step


@pytest.mark.parametrize("loss_type", ["cispo", "sapo", "dapo"])
@pytest.mark.parametrize("bias_corr", [False, True])
def test_kl_token_weights_express_trls_policy_only_masks(loss_type, bias_corr):
    # A padded batch as TRL holds it, flattened: token_weights = normaliser * entropy mask * vLLM ratio,
    # kl_token_weights = the normaliser alone. Loss and log-prob gradient equal TRL's.
    gen = torch.Generator().manual_seed(3)
    b, t = 4, 7
    lengths = torch.tensor([7, 3, 5, 1])
    mask = (torch.arange(t)[None, :] < lengths[:, None]).float()  # [B, T]
    logp = -torch.rand(b, t, generator=gen) * 3
    old = logp + 0.3 * torch.randn(b, t, generator=gen)
    ref = logp + 0.2 * torch.randn(b, t, generator=gen)
    adv = torch.randn(b, generator=gen)
    entropy_mask = (torch.rand(b, t, generator=gen) > 0.4).float()
    is_ratio = torch.rand(b, t, generator=gen) * 1.5 + 0.25
    settings = dict(beta=0.1, eps_low=0.2, eps_high=1.1 if loss_type == "cispo" else 0.28, bias_corr=bias_corr)
    leaf = logp.clone().requires_grad_()
    trl = _trl_padded_loss(leaf, old, ref, adv, mask, entropy_mask, is_ratio, loss_type=loss_type, **settings)
    (trl_grad,) = torch.autograd.grad(trl, leaf)

    sel = mask.bool()
    if loss_type == "sapo":
        norm = (1.0 / (b * lengths.float()))[:, None].expand(b, t)[sel]  # [N]
    else:
        norm = torch.full((int(mask.sum()),), 1.0 / mask.sum().item())
    objective = TokenObjective(
        advantages=adv[:, None].expand(b, t)[sel], old_logprobs=old[sel], ref_logprobs=ref[sel],
        beta=settings["beta"], epsilon_low=0.2, epsilon_high=settings["eps_high"],
        policy_loss="clip" if loss_type == "dapo" else loss_type, use_bias_correction_kl=bias_corr,
        kl_token_weights=norm)
    w = norm * entropy_mask[sel] * is_ratio[sel]
    flat = logp[sel].clone().requires_grad_()
    ours, _, _, _ = objective.weighted_loss(flat, w)
    (ours_grad,) = torch.autograd.grad(ours, flat)
    assert ours.item() == pytest.approx(trl.item(), rel=1e-5)
    torch.testing.assert_close(ours_grad, trl_grad[sel], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(objective.logp_grad(logp[sel], w), trl_grad[sel], rtol=1e-5, atol=1e-7)


def test_bias_correction_changes_the_kl_gradient_even_on_policy():
    # TRL's note: with r == 1 the value is unchanged but d(k3 r) = dk3 + k3 (r differentiable)
    rows = _rows(n=200, beta=0.1, old=False)
    plain = TokenObjective(advantages=rows["adv"], ref_logprobs=rows["ref"], beta=0.1)
    corrected = TokenObjective(advantages=rows["adv"], ref_logprobs=rows["ref"], beta=0.1,
                               use_bias_correction_kl=True)
    lp = rows["logp"].clone().requires_grad_()
    v_plain, v_corr = plain.weighted_loss(lp, rows["w"])[0], corrected.weighted_loss(lp, rows["w"])[0]
    assert v_plain.item() == pytest.approx(v_corr.item(), rel=1e-6)
    diff = corrected.logp_grad(rows["logp"], rows["w"]) - plain.logp_grad(rows["logp"], rows["w"])
    k3 = torch.exp(rows["ref"] - rows["logp"]) - (rows["ref"] - rows["logp"]) - 1
    torch.testing.assert_close(diff, 0.1 * k3 * rows["w"], rtol=1e-4, atol=1e-6)  # a float32 difference


@pytest.mark.parametrize("case", [
    dict(policy_loss="cispo", epsilon_high=1.1),
    dict(policy_loss="sapo", beta=0.1, use_bias_correction_kl=True, kl_weights=True),
    dict(policy_loss="clip", beta=0.1, delta=1.3, bias=True, kl_weights=True),
    dict(policy_loss="cispo", epsilon_high=1.1, bias=True, temperature=0.7, entropy=True),
    dict(policy_loss="sapo", bias=True, old=False),
], ids=["cispo", "sapo-biascorr-klweights", "clip-bias-klweights", "cispo-bias-temperature", "sapo-bias-old-none"])
@pytest.mark.parametrize("sequences", [None, 6], ids=["token", "gspo"])
def test_torch_backend_matches_the_reference(case, sequences):
    # token level: the gradient-in-forward pass (_chunked.loss_pass); GSPO: the recompute op
    errs = grpo_errors(SHAPE, dtype=torch.float32, backend="torch", chunk_size=16, seed=11, sequences=sequences,
                       **case)
    assert_small(errs, TOL)


def test_bf16_bias_on_the_torch_backend():
    errs = grpo_errors(SHAPE, dtype=torch.bfloat16, backend="torch", seed=12, bias=True, beta=0.05,
                       use_bias_correction_kl=True)
    assert_small(errs, 2e-2, grad_tol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_logprobs_with_bias(dtype):
    inp = make_inputs(SHAPE, dtype=dtype, seed=13)
    bias = (torch.randn(SHAPE.v) * 2).to(dtype).requires_grad_()
    logp, ent = linear_logprobs(inp["hidden"], inp["weight"], inp["targets"], bias=bias, return_entropy=True,
                                temperature=0.8, chunk_size=16)
    leaves64 = [x.detach().double().requires_grad_() for x in (inp["hidden"], inp["weight"], bias)]
    ref, ref_ent = reference_linear_logprobs(*leaves64[:2], inp["targets"], bias=leaves64[2], return_entropy=True,
                                             temperature=0.8)
    up = torch.randn(SHAPE.n, generator=torch.Generator().manual_seed(1))
    grads = torch.autograd.grad((logp * up).sum() + ent.sum(), (inp["hidden"], inp["weight"], bias))
    grads64 = torch.autograd.grad((ref * up.double()).sum() + ref_ent.sum(), leaves64)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert rel_err(logp, ref) <= tol and rel_err(ent, ref_ent) <= tol
    for g, g64 in zip(grads, grads64):
        assert rel_err(g, g64) <= tol
    assert grads[2].dtype == dtype


def test_a_frozen_bias_gets_no_gradient_and_changes_the_result():
    inp = make_inputs(SHAPE, dtype=torch.float32, seed=14)
    bias = torch.randn(SHAPE.v)
    args = (inp["hidden"], inp["weight"], inp["targets"], inp["advantages"], inp["token_weights"])
    with_bias, _ = linear_grpo_loss(*args, bias=bias, old_logprobs=torch.full((SHAPE.n,), -4.0))
    without, _ = linear_grpo_loss(*args, old_logprobs=torch.full((SHAPE.n,), -4.0))
    assert not bias.requires_grad and with_bias.item() != pytest.approx(without.item(), rel=1e-3)


@pytest.mark.parametrize("kw, message", [
    (dict(policy_loss="ppo"), r"policy_loss must be one of \['cispo', 'clip', 'sapo'\], got 'ppo'"),
    (dict(policy_loss="cispo", epsilon_high=0.0), "truncates the ratio at epsilon_high"),
    (dict(policy_loss="sapo", sapo_temperature_neg=0.0), "sapo_temperature_pos / sapo_temperature_neg must be > 0"),
    (dict(kl_token_weights=torch.ones(3)), r"kl_token_weights must be \[N\]=4, got \(3,\)"),
    (dict(bias=torch.zeros(4)), r"bias must be \[V\]=5 in the weight's dtype torch.float32, got \(4,\)"),
    (dict(bias=torch.zeros(5, dtype=torch.float64)), r"bias must be \[V\]=5 .* torch.float64"),
])
def test_bad_objective_settings_are_refused_by_name(kw, message):
    with pytest.raises(ValueError, match=message):
        linear_grpo_loss(torch.randn(4, 3), torch.randn(5, 3), torch.zeros(4, dtype=torch.long), torch.ones(4),
                         torch.ones(4), **kw)


def test_the_registry_is_the_one_list_of_terms():
    assert sorted(POLICY_LOSSES) == ["cispo", "clip", "sapo"]
