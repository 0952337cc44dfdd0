"""``torch.ops.fastgrpo.varlen_attn`` (the attention of compiled blocks): the op's registration is sound
(``torch.library.opcheck``: schema, fake implementation, autograd), its gradients are right (gradcheck in float64),
and in float32 and bf16 it equals causal sdpa run on each sequence, grouped-query heads and empty (padding) segments
included; the ``varlen_op`` backend refuses what it cannot run."""

import pytest
import torch

from fastgrpo.models.attention import _varlen_op
from fastgrpo.models.varlen_op import varlen_attn


def _inputs(rng, dtype, *, hq=4, hkv=2, d=8, requires_grad=False):
    lengths = [rng.randint(1, 9) for _ in range(rng.randint(1, 4))]
    t = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist(), t, t], dtype=torch.int32)  # 2 empty segments
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    q, k, v = (torch.randn(t, h, d, generator=gen, dtype=torch.float64).to(dtype).requires_grad_(requires_grad)
               for h in (hq, hkv, hkv))
    return q, k, v, cu, lengths


def _reference(q, k, v, lengths, scale):
    outs = [torch.nn.functional.scaled_dot_product_attention(
        qs.transpose(0, 1)[None], ks.transpose(0, 1)[None], vs.transpose(0, 1)[None], is_causal=True, scale=scale,
        enable_gqa=True)[0].transpose(0, 1) for qs, ks, vs in zip(q.split(lengths), k.split(lengths), v.split(lengths))]
    return torch.cat(outs)


def test_the_op_registration_passes_opcheck(rng):
    q, k, v, cu, _ = _inputs(rng, torch.float32, requires_grad=True)
    torch.library.opcheck(torch.ops.fastgrpo.varlen_attn.default, (q, k, v, cu, 16, 0.3))


def test_the_gradients_pass_gradcheck(rng):
    q, k, v, cu, _ = _inputs(rng, torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda q, k, v: varlen_attn(q, k, v, cu, 16, 0.35), (q, k, v))


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_it_equals_sdpa_per_sequence_values_and_gradients(rng, dtype, tol):
    q, k, v, cu, lengths = _inputs(rng, dtype, requires_grad=True)
    grad = torch.randn(q.shape, dtype=torch.float64).to(dtype)
    got = varlen_attn(q, k, v, cu, 16, 0.3)
    got_grads = torch.autograd.grad(got, (q, k, v), grad)
    ref = _reference(q, k, v, lengths, 0.3)
    ref_grads = torch.autograd.grad(ref, (q, k, v), grad)
    torch.testing.assert_close(got, ref, rtol=tol, atol=tol)
    for name, g, r in zip("qkv", got_grads, ref_grads):
        torch.testing.assert_close(g.float(), r.float(), rtol=tol, atol=tol, msg=f"d{name}")


def test_the_backend_refuses_rows_without_boundaries_and_sliding_windows():
    x = torch.zeros(1, 2, 4, 8)
    with pytest.raises(ValueError, match="varlen_op runs packed rows only"):
        _varlen_op(None, x, x, x, None)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="sliding-window"):
        _varlen_op(None, x, x, x, None, sliding_window=2, cu_seq_lens_q=cu, max_length_q=4)


def test_under_autocast_it_takes_float32_queries_with_bf16_values_as_sdpa_would(rng):
    """Under autocast q and k come out of the rotary embedding in float32 while v comes out of its projection in
    bf16 (the dtypes of the first GPU run's failure); the op casts all three to bf16, eager and compiled alike."""
    q, k, v, cu, lengths = _inputs(rng, torch.float32, requires_grad=True)
    vb = v.detach().bfloat16().requires_grad_()
    with pytest.raises(RuntimeError, match="same dtype"):  # what the op gets without the autocast rule
        varlen_attn(q, k, vb, cu, 16, 0.3)
    ref = _reference(q.bfloat16(), k.bfloat16(), vb, lengths, 0.3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = varlen_attn(q, k, vb, cu, 16, 0.3)
        compiled = torch.compile(lambda q, k, v: varlen_attn(q, k, v, cu, 16, 0.3), backend="aot_eager",
                                 fullgraph=True)(q, k, vb)
    assert got.dtype == compiled.dtype == torch.bfloat16
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
    torch.testing.assert_close(compiled, ref, rtol=0, atol=0)
    dq, dv = torch.autograd.grad(got.float().sum(), (q, vb))
    assert dq.dtype == torch.float32 and dv.dtype == torch.bfloat16  # each input's own dtype, as autograd casts back
