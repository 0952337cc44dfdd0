"""fastgrpo.kernels.FusedLinearGRPOLoss against Liger-Kernel 0.8's definitions, and its shape errors.

``liger_grpo_reference`` below writes Liger's definitions out in
plain torch (full logits, float64): its per-token terms, its normalisers and its two metrics, as
``LigerFusedLinearGRPOLoss`` documents them. The grid crosses loss types, importance levels, beta, bias
correction, temperature, an lm_head bias, delta and the vLLM ratio, with old log-probs far enough from the
current ones that clipping binds.
"""

import itertools

import pytest
import torch

from fastgrpo.kernels import FusedLinearGRPOLoss
from fastgrpo.kernels.module import padded_grpo_loss

B, T, H, V = 3, 5, 16, 37


def liger_grpo_reference(x, w, ids, mask, adv, *, bias=None, ref=None, old=None, is_ratio=None, beta=0.04,
                         eps_low=0.2, eps_high=0.2, loss_type="dapo", max_len=None, level="token",
                         tau_pos=1.0, tau_neg=1.05, temperature=1.0, delta=None, bias_corr=False):
    """Liger's GRPO loss on a padded batch: ``(loss, [kl_mean if beta, clip_ratio])``."""
    logits = x @ w.T
    if bias is not None:
        logits = logits + bias
    logp = torch.log_softmax(logits / temperature, -1).gather(-1, ids[..., None])[..., 0]  # [B, T]
    old = logp.detach() if old is None else old
    log_w = logp - old
    if level == "sequence":
        log_w = (log_w * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0)  # [B, 1]
    r = torch.exp(log_w)
    a = adv[:, None]
    if loss_type == "cispo":
        per_tok = -torch.clamp(r, max=eps_high).detach() * a * logp
        clipped = (r > eps_high) & (a > 0)
    elif loss_type == "sapo":
        tau = torch.where(a > 0, torch.full_like(a, tau_pos), torch.full_like(a, tau_neg))
        per_tok = -(torch.sigmoid(tau * (r - 1)) * 4 / tau) * a
        clipped = torch.zeros_like(r, dtype=torch.bool)
    else:
        clamped = torch.clamp(r, 1 - eps_low, 1 + eps_high)
        unclipped = r if delta is None else torch.clamp(r, max=delta)
        per_tok = -torch.min(unclipped * a, clamped * a)
        clipped = ((r < 1 - eps_low) & (a < 0)) | ((r > 1 + eps_high) & (a > 0))
    if is_ratio is not None:
        per_tok = per_tok * is_ratio
    per_tok = per_tok.expand_as(mask) if per_tok.shape != mask.shape else per_tok
    if beta != 0.0:
        kl = torch.exp(ref - logp) - (ref - logp) - 1
        if bias_corr:
            kl = kl * r
        per_tok = per_tok + beta * kl
    n_tok = mask.sum().clamp(min=1.0)
    if loss_type in ("grpo", "sapo"):
        loss = ((per_tok * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).sum() / mask.shape[0]
    elif loss_type == "bnpo":
        loss = (per_tok * mask).sum() / n_tok
    elif loss_type == "dr_grpo":
        loss = (per_tok * mask).sum() / (mask.shape[0] * max_len)
    else:  # dapo, cispo: one rank, no num_items_in_batch
        loss = (per_tok * mask).sum() / n_tok
    metrics = [(kl * mask).sum() / n_tok] if beta != 0.0 else []
    metrics.append((clipped.expand_as(mask) * mask).sum() / n_tok)
    return loss, metrics


def _batch(seed, bias=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, H, generator=g, dtype=torch.float64)
    w = torch.randn(V, H, generator=g, dtype=torch.float64) * 0.5
    b = torch.randn(V, generator=g, dtype=torch.float64) if bias else None
    ids = torch.randint(0, V, (B, T), generator=g)
    lengths = torch.tensor([T, 2, 4])  # ragged, with padding
    mask = (torch.arange(T)[None] < lengths[:, None]).double()
    adv = torch.tensor([1.0, -0.7, 0.4], dtype=torch.float64)
    with torch.no_grad():
        logits = x @ w.T + (b if bias else 0)
    # old log-probs of the same head moved far enough that ratios leave [0.8, 1.2] (clipping binds)
    logp = torch.log_softmax(logits, -1).gather(-1, ids[..., None])[..., 0]
    # (per sequence as well: the sequence-level ratio averages the per-token noise out)
    shift = torch.tensor([[-0.4], [0.4], [0.0]], dtype=torch.float64)
    old = logp + shift + 0.6 * torch.randn(B, T, generator=g, dtype=torch.float64)
    ref = logp + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)
    is_ratio = torch.rand(B, T, generator=g, dtype=torch.float64) + 0.5
    return dict(x=x, w=w, b=b, ids=ids, mask=mask, adv=adv, old=old, ref=ref, is_ratio=is_ratio)


GRID = [
    dict(loss_type=lt, level=lv, beta=be, bias_corr=bc, temperature=te, bias=bi, delta=de, is_ratio=ir)
    for lt, lv, (be, bc), te, bi, de, ir in itertools.product(
        ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo"], ["token", "sequence"],
        [(0.0, False), (0.1, False), (0.1, True)], [1.0, 0.7], [False, True], [None, 1.5], [False, True])
    if not (lv == "sequence" and lt in ("cispo", "sapo"))
    and not (de is not None and lt in ("cispo", "sapo"))
    # keep the grid small: temperature, bias, delta and the ratio vary on the token level with beta 0.1 only
    and (te == 1.0 or (lv == "token" and be == 0.1 and not bc))
    and (not bi or (lv == "token" and be == 0.1))
    and (de is None or (lv == "token" and be == 0.0))
    and (not ir or (be == 0.1 and te == 1.0 and not bi))
]


def _case_id(c):
    return "-".join(f"{k}={v}" for k, v in c.items() if v not in (None, False))


# CUDA: the default backend there (cublas, or triton for the sequence level), where a GPU is present
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", GRID, ids=_case_id)
def test_matches_liger_definitions(case, device):
    d = _batch(seed=len(_case_id(case)), bias=case["bias"])
    opts = dict(beta=case["beta"], loss_type=case["loss_type"], importance_sampling_level=case["level"],
                temperature=case["temperature"], delta=case["delta"], use_bias_correction_kl=case["bias_corr"],
                max_completion_length=T + 2, epsilon_low=0.2, epsilon_high=0.28 if case["loss_type"] != "cispo"
                else 1.1, sapo_temperature_pos=1.0, sapo_temperature_neg=1.05)
    module = FusedLinearGRPOLoss(**opts, backend="torch" if device == "cpu" else "auto")
    on = lambda t: t.float().to(device)  # noqa: E731
    x32 = on(d["x"]).requires_grad_()
    w32 = on(d["w"]).requires_grad_()
    b32 = on(d["b"]).requires_grad_() if case["bias"] else None
    args = (x32, w32, d["ids"].to(device), on(d["mask"]), on(d["adv"]))
    kwargs = dict(bias=b32, ref_per_token_logps=on(d["ref"]), old_per_token_logps=on(d["old"]),
                  vllm_is_ratio=on(d["is_ratio"]) if case["is_ratio"] else None)
    loss, metrics = module(*args, **kwargs)

    x64, w64 = d["x"].clone().requires_grad_(), d["w"].clone().requires_grad_()
    b64 = d["b"].clone().requires_grad_() if case["bias"] else None
    ref_loss, ref_metrics = liger_grpo_reference(
        x64, w64, d["ids"], d["mask"], d["adv"], bias=b64, ref=d["ref"], old=d["old"],
        is_ratio=d["is_ratio"] if case["is_ratio"] else None, beta=case["beta"], eps_low=0.2,
        eps_high=opts["epsilon_high"], loss_type=case["loss_type"], max_len=T + 2, level=case["level"],
        temperature=case["temperature"], delta=case["delta"], bias_corr=case["bias_corr"])
    assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-5, abs=1e-6)
    assert len(metrics) == len(ref_metrics)
    for got, want in zip(metrics, ref_metrics):
        assert got.item() == pytest.approx(want.item(), rel=1e-5, abs=1e-6)
    if case["loss_type"] != "sapo" and case["beta"] == 0.0:
        assert ref_metrics[-1].item() > 0, "the case must make clipping bind"
    leaves32 = [t for t in (x32, w32, b32) if t is not None]
    leaves64 = [t for t in (x64, w64, b64) if t is not None]
    grads = torch.autograd.grad(loss, leaves32)
    grads_ref = torch.autograd.grad(ref_loss, leaves64)
    for got, want in zip(grads, grads_ref):
        got = got.double().cpu()
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-6), (got - want).abs().max()


def test_dapo_uses_num_items_in_batch():
    d = _batch(seed=1)
    module = FusedLinearGRPOLoss(beta=0.0, loss_type="dapo", backend="torch")
    args = (d["x"].float(), d["w"].float(), d["ids"], d["mask"].float(), d["adv"].float())
    a, _ = module(*args, old_per_token_logps=d["old"].float())
    b, _ = module(*args, old_per_token_logps=d["old"].float(), num_items_in_batch=4 * d["mask"].sum())
    assert b.item() == pytest.approx(a.item() / 4, rel=1e-6)


def test_reference_head_from_ref_input_when_no_ref_logps():
    d = _batch(seed=2)
    module = FusedLinearGRPOLoss(beta=0.1, loss_type="bnpo", backend="torch")
    x, w = d["x"].float(), d["w"].float()
    w_ref = w + 0.2 * torch.randn(w.shape, generator=torch.Generator().manual_seed(5))
    loss_a, m_a = module(x, w, d["ids"], d["mask"].float(), d["adv"].float(), ref_input=x, ref_weight=w_ref)
    ref_logp = torch.log_softmax(x @ w_ref.T, -1).gather(-1, d["ids"][..., None])[..., 0]
    loss_b, m_b = module(x, w, d["ids"], d["mask"].float(), d["adv"].float(), ref_per_token_logps=ref_logp)
    assert loss_a.item() == pytest.approx(loss_b.item(), rel=1e-5)
    assert m_a[0].item() == pytest.approx(m_b[0].item(), rel=1e-5) and m_a[0].item() > 0


@pytest.mark.parametrize("bad, message", [
    (dict(_input=torch.zeros(B * T, H)), r"_input must be \[B, T, H\]"),
    (dict(selected_token_ids=torch.zeros(B * T, dtype=torch.long)), r"selected_token_ids must be \[B, T\]"),
    (dict(attention_mask=torch.ones(B, T + 1)), r"attention_mask must be \[B, T\]"),
    (dict(advantages=torch.zeros(B, T + 1)), r"advantages must be \[B, T\] or \[B\]"),
    (dict(old_per_token_logps=torch.zeros(B * T)), r"old_per_token_logps must be \[B, T\]"),
    (dict(vllm_is_ratio=torch.ones(B, 2)), r"vllm_is_ratio must be \[B, T\] or \[B, 1\]"),
])
def test_wrong_shapes_name_the_argument_and_layout(bad, message):
    args = dict(_input=torch.zeros(B, T, H), lin_weight=torch.zeros(V, H),
                selected_token_ids=torch.zeros(B, T, dtype=torch.long), attention_mask=torch.ones(B, T),
                advantages=torch.zeros(B))
    args.update(bad)
    with pytest.raises(ValueError, match=message):
        FusedLinearGRPOLoss(beta=0.0)(**args)


@pytest.mark.parametrize("opts, name", [
    (dict(loss_type="vespo"), "loss_type"),
    (dict(loss_type="luspo", importance_sampling_level="sequence", beta=0.1, use_bias_correction_kl=True),
     "use_bias_correction_kl"),
    (dict(loss_type="dr_grpo"), "max_completion_length"),
    (dict(importance_sampling_level="seq"), "importance_sampling_level"),
    (dict(loss_type="cispo", importance_sampling_level="sequence"), "importance_sampling_level"),
    (dict(sapo_temperature_neg=0.0), "sapo_temperature"), (dict(delta=0.0), "delta"),
])
def test_bad_options_fail_at_construction(opts, name):
    with pytest.raises(ValueError, match=name):
        FusedLinearGRPOLoss(**opts)


def test_padded_loss_equals_flat_kernel_on_the_masked_rows():
    from fastgrpo.kernels import linear_grpo_loss

    d = _batch(seed=3)
    x, w = d["x"].float(), d["w"].float()
    tw = d["mask"].float() * 0.1
    a, sa = padded_grpo_loss(x, w, d["ids"], d["mask"], d["adv"].float(), tw, old_logprobs=d["old"].float(),
                             backend="torch")
    keep = d["mask"].bool()
    b, sb = linear_grpo_loss(x[keep], w, d["ids"][keep], d["adv"].float()[:, None].expand(B, T)[keep], tw[keep],
                             old_logprobs=d["old"].float()[keep], backend="torch")
    assert a.item() == pytest.approx(b.item(), rel=1e-6)
    assert torch.equal(sa["logprobs"][keep], sb["logprobs"]) and (sa["logprobs"][~keep] == 0).all()


@pytest.mark.parametrize("case", GRID[::7], ids=_case_id)
def test_matches_liger_itself_where_installed(case):
    # the reference above pins Liger's definitions in CI; where Liger-Kernel is installed (fastgrpo[liger]), its own
    # module (eager, on CPU) is the oracle too. Seen once over the whole GRID against Liger 0.8.5: 1.5e-5 at worst.
    chunked = pytest.importorskip("liger_kernel.chunked_loss")
    d = _batch(seed=len(_case_id(case)), bias=case["bias"])
    opts = dict(beta=case["beta"], loss_type=case["loss_type"], importance_sampling_level=case["level"],
                temperature=case["temperature"], delta=case["delta"], use_bias_correction_kl=case["bias_corr"],
                max_completion_length=T + 2, epsilon_high=0.28 if case["loss_type"] != "cispo" else 1.1)
    results = []
    for module in (chunked.LigerFusedLinearGRPOLoss(**opts, compiled=False, chunk_size=2),
                   FusedLinearGRPOLoss(**opts, backend="torch")):
        x, w = d["x"].float().requires_grad_(), d["w"].float().requires_grad_()
        b = d["b"].float().requires_grad_() if case["bias"] else None
        loss, metrics = module(x, w, d["ids"], d["mask"].float(), d["adv"].float(), bias=b,
                               ref_per_token_logps=d["ref"].float(), old_per_token_logps=d["old"].float(),
                               vllm_is_ratio=d["is_ratio"].float() if case["is_ratio"] else None)
        results.append((loss, metrics, torch.autograd.grad(loss, [t for t in (x, w, b) if t is not None])))
    (la, ma, ga), (lb, mb, gb) = results
    assert lb.item() == pytest.approx(la.item(), rel=1e-4, abs=1e-6)
    assert [m.item() for m in mb] == pytest.approx([m.item() for m in ma], rel=1e-4, abs=1e-6)
    for want, got in zip(ga, gb):
        assert (got - want).abs().max() <= 1e-4 * want.abs().max()


def test_sequence_level_with_empty_sequences_and_more_sequences_than_tokens():
    # sequences 0 and 2 have no token: GSPO's sequence numbers must still stay below N (here N = 2 < B = 4)
    g = torch.Generator().manual_seed(7)
    x, w = torch.randn(4, 3, H, generator=g, dtype=torch.float64), torch.randn(V, H, generator=g, dtype=torch.float64)
    ids = torch.randint(0, V, (4, 3), generator=g)
    mask = torch.zeros(4, 3, dtype=torch.float64)
    mask[1, 0] = mask[3, 2] = 1
    adv = torch.tensor([0.5, 1.0, -1.0, -2.0], dtype=torch.float64)
    old = torch.full((4, 3), -3.0, dtype=torch.float64)
    opts = dict(beta=0.0, loss_type="grpo", importance_sampling_level="sequence")
    loss, _ = FusedLinearGRPOLoss(**opts, backend="torch")(x.float(), w.float(), ids, mask.float(), adv.float(),
                                                          old_per_token_logps=old.float())
    want, _ = liger_grpo_reference(x, w, ids, mask, adv, old=old, beta=0.0, loss_type="grpo", level="sequence")
    assert loss.item() == pytest.approx(want.item(), rel=1e-5)


# -- against Liger-Kernel 0.8.5 itself (requirements/cpu.txt installs it; its chunked loss runs eagerly on a CPU) ------


def _liger_pair(opts, d, **call):
    """(loss, metrics, grads of _input / weight / bias) of Liger's module and of ours on the same batch ``d``."""
    chunked = pytest.importorskip("liger_kernel.chunked_loss")
    out = []
    for module in (chunked.LigerFusedLinearGRPOLoss(**opts, compiled=False, chunk_size=2),
                   FusedLinearGRPOLoss(**opts, backend="torch")):
        x, w = d["x"].float().requires_grad_(), d["w"].float().requires_grad_()
        b = d["b"].float().requires_grad_() if d.get("b") is not None else None
        loss, metrics = module(x, w, d["ids"], d["mask"].float(), d["adv"].float(), bias=b, **call)
        out.append((loss, metrics, torch.autograd.grad(loss, [t for t in (x, w, b) if t is not None])))
    return out


def _assert_same(pair, rel=1e-4):
    (la, ma, ga), (lb, mb, gb) = pair
    assert lb.item() == pytest.approx(la.item(), rel=rel, abs=1e-6)
    assert [m.item() for m in mb] == pytest.approx([m.item() for m in ma], rel=rel, abs=1e-6)
    for want, got in zip(ga, gb):
        assert (got - want).abs().max() <= rel * want.abs().max() + 1e-7, (got - want).abs().max()


def _scattered_mask(d, seed):
    # Liger's own grid masks random positions, not only a suffix: padding inside a sequence too
    g = torch.Generator().manual_seed(seed)
    mask = (torch.rand(B, T, generator=g) > 0.35).double()
    mask[0] = 1.0
    return dict(d, mask=mask)


LIGER_GRID = [
    dict(loss_type=lt, level=lv, beta=be, bias_corr=bc, ratio=ra, scattered=sc)
    for lt, lv, (be, bc), ra, sc in itertools.product(
        ["luspo", "grpo", "dapo", "cispo", "sapo", "dr_grpo", "bnpo"], ["token", "sequence"],
        [(0.0, False), (0.1, False), (0.1, True)], [None, "BT", "B1", "B"], [False, True])
    if not (lv == "sequence" and lt in ("cispo", "sapo"))
    and not (lt == "luspo" and lv == "sequence" and bc)  # refused (test_bad_options_fail_at_construction)
    and (lt == "luspo" or (ra in (None, "B") and not sc))  # the other types: the [B] ratio is the new case
]


@pytest.mark.parametrize("case", LIGER_GRID, ids=_case_id)
def test_matches_liger_itself_on_luspo_scattered_padding_and_per_sequence_ratios(case):
    d = _batch(seed=len(_case_id(case)), bias=True)
    if case["scattered"]:
        d = _scattered_mask(d, seed=len(_case_id(case)))
    ratio = {None: None, "BT": d["is_ratio"], "B1": d["is_ratio"][:, :1], "B": d["is_ratio"][:, 0]}[case["ratio"]]
    opts = dict(beta=case["beta"], loss_type=case["loss_type"], importance_sampling_level=case["level"],
                use_bias_correction_kl=case["bias_corr"], max_completion_length=T + 2,
                epsilon_high=0.28 if case["loss_type"] != "cispo" else 1.1)
    pair = _liger_pair(opts, d, ref_per_token_logps=d["ref"].float(), old_per_token_logps=d["old"].float(),
                       vllm_is_ratio=None if ratio is None else ratio.float())
    _assert_same(pair)


@pytest.mark.parametrize("loss_type", ["dapo", "luspo"])
@pytest.mark.parametrize("beta", [0.0, 0.1])
def test_use_ref_model_false_ignores_a_passed_reference_as_liger_does(loss_type, beta):
    d = _batch(seed=11, bias=False)
    opts = dict(beta=beta, loss_type=loss_type, use_ref_model=False)
    pair = _liger_pair(opts, d, ref_per_token_logps=d["ref"].float(), old_per_token_logps=d["old"].float())
    _assert_same(pair)
    if beta:  # the reference differs from the policy: read, it would give a KL term > 0
        assert pair[1][1][0].item() == 0.0


def test_beta_without_a_reference_raises_as_liger_does():
    d = _batch(seed=12)
    args = (d["x"].float(), d["w"].float(), d["ids"], d["mask"].float(), d["adv"].float())
    with pytest.raises(ValueError, match="ref_per_token_logps or ref_input"):
        FusedLinearGRPOLoss(beta=0.1, backend="torch")(*args)
    chunked = pytest.importorskip("liger_kernel.chunked_loss")
    with pytest.raises(AssertionError):
        chunked.LigerFusedLinearGRPOLoss(beta=0.1, compiled=False)(*args)


@pytest.mark.parametrize("shape", [(0, T), (B, 0), (B, T)])
@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "luspo"])
def test_empty_batches_give_a_zero_loss_and_zero_gradients(shape, loss_type):
    b, t = shape
    x = torch.randn(b, t, H, requires_grad=True)
    w = torch.randn(V, H, requires_grad=True)
    mask = torch.zeros(b, t)  # (B, T): every position is padding
    loss, metrics = FusedLinearGRPOLoss(beta=0.0, loss_type=loss_type, backend="torch")(
        x, w, torch.zeros(b, t, dtype=torch.long), mask, torch.ones(b), old_per_token_logps=torch.zeros(b, t))
    # (luspo weighs padding too, by its sequence's length: 0 here)
    assert loss.item() == 0.0 and [m.item() for m in metrics] == [0.0]
    gx, gw = torch.autograd.grad(loss, [x, w])
    assert gx.shape == x.shape and not gx.any() and not gw.any()


# -- at Liger's own test shape (its test_grpo_loss: B=8, T=128, H=128, V=1024), in bf16 and float32 -------------------

LIGER_SHAPE = (8, 128, 128, 1024)
LIGER_TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=5e-4), torch.bfloat16: dict(atol=5e-2, rtol=5e-1)}  # its own


def _liger_shaped_batch(seed, dtype, bias):
    """Liger's test inputs: a random head, a reference head 0.01 away, random padding anywhere, advantages in
    [0, 1), old and reference log-probs 0.01 from the policy's."""
    b, t, h, v = LIGER_SHAPE
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(v, h, generator=g).to(dtype)
    bias_ = torch.randn(v, generator=g).to(dtype) if bias else None
    x = torch.randn(b, t, h, generator=g).to(dtype)
    ids = torch.randint(0, v, (b, t), generator=g)
    with torch.no_grad():
        logits = x @ w.T + (bias_ if bias else 0)
        logp = torch.log_softmax(logits.float(), -1).gather(-1, ids[..., None])[..., 0]  # [B, T]
    mask = torch.ones(b, t)
    mask.view(-1)[torch.randperm(b * t, generator=g)[:b * t // 3]] = 0
    return dict(
        x=x, w=w, b=bias_, ids=ids, mask=mask, adv=torch.rand(b, generator=g).to(dtype),
        old=logp + 0.01 * torch.randn(b, t, generator=g), ref=logp + 0.01 * torch.randn(b, t, generator=g),
        ref_input=x + (0.01 * torch.randn(b, t, h, generator=g)).to(dtype),
        ref_weight=w + (0.01 * torch.randn(v, h, generator=g)).to(dtype),
        ref_bias=bias_ + (0.01 * torch.randn(v, generator=g)).to(dtype) if bias else None)


LIGER_SHAPE_GRID = [
    dict(loss_type="luspo", level=lv, dtype=dt, bias=bi, delta=de, ref=rf)
    for lv, dt, bi, de, rf in itertools.product(["token", "sequence"], [torch.float32, torch.bfloat16], [False, True],
                                                [None, 1.5], ["logps", "input"])
] + [
    dict(loss_type=lt, level=lv, dtype=dt, bias=True, delta=None, ref="input")
    for lt, lv, dt in itertools.product(["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo"], ["token", "sequence"],
                                        [torch.float32, torch.bfloat16])
    if not (lv == "sequence" and lt in ("cispo", "sapo"))
]


@pytest.mark.parametrize("case", LIGER_SHAPE_GRID, ids=_case_id)
def test_matches_liger_itself_at_its_test_shape_with_a_reference_head(case):
    # the reference from ref_input / ref_weight scores every position luspo weighs, padding included. Oracle: Liger's
    # module in float32 on float32 inputs; on bf16 inputs, Liger's module in float64 on the same values, since Liger
    # in bf16 rounds the logits to bf16 (its gradients then stray up to 22% in norm from its own float64 result,
    # fastgrpo's float32 logits 0.2%); tolerances are Liger's own per dtype.
    chunked = pytest.importorskip("liger_kernel.chunked_loss")
    d = _liger_shaped_batch(len(_case_id(case)), case["dtype"], case["bias"])
    opts = dict(beta=0.1, loss_type=case["loss_type"], importance_sampling_level=case["level"], delta=case["delta"],
                max_completion_length=LIGER_SHAPE[1], epsilon_high=0.2 if case["loss_type"] != "cispo" else 5.0)
    out = []
    for module, dtype in ((chunked.LigerFusedLinearGRPOLoss(**opts, compiled=False),
                           torch.float32 if case["dtype"] == torch.float32 else torch.float64),
                          (FusedLinearGRPOLoss(**opts, backend="torch"), case["dtype"])):
        on = lambda t: None if t is None else t.to(dtype)  # noqa: E731
        logps = lambda t: t.to(torch.float64 if dtype == torch.float64 else torch.float32)  # noqa: E731
        ref = dict(ref_per_token_logps=logps(d["ref"])) if case["ref"] == "logps" else dict(
            ref_input=on(d["ref_input"]), ref_weight=on(d["ref_weight"]), ref_bias=on(d["ref_bias"]))
        leaves = [on(t).requires_grad_() for t in (d["x"], d["w"], d["b"]) if t is not None]
        loss, metrics = module(leaves[0], leaves[1], d["ids"], on(d["mask"]), on(d["adv"]),
                               bias=leaves[2] if case["bias"] else None, old_per_token_logps=logps(d["old"]), **ref)
        out.append((loss, metrics, torch.autograd.grad(loss, leaves)))
    (la, ma, ga), (lb, mb, gb) = out
    tol = LIGER_TOLERANCE[case["dtype"]]
    torch.testing.assert_close(lb.double(), la.double(), **tol)
    for got, want in zip(mb, ma, strict=True):
        torch.testing.assert_close(got.double(), want.double(), **tol)
    for got, want in zip(gb, ga, strict=True):
        torch.testing.assert_close(got.double(), want.double(), **tol)
