"""``torch.ops.fastgrpo.varlen_attn``: causal attention over the sequences of a packed row as one registered op.

Why an op: a compiled block (``fullgraph=True, dynamic=False``) must not see the row's boundaries as Python values
(each new set would be a guard failure and a recompile) nor read them on the host inside the graph (a graph break).
A custom op is opaque to dynamo: the graph holds one node whose inputs are the boundary tensor ``cu_seqlens`` and the
fixed int ``max_seqlen``, and its fake implementation gives the output shape without running anything, so the same
graph traces whatever the boundaries (and on any device). The implementation here runs anywhere (the CPU
implementation; on CUDA with bfloat16/float16, ``fastgrpo.models.attention`` calls torch's FlashAttention varlen op
instead, itself a traceable custom op); it reads ``cu_seqlens`` on the host, which is free on a CPU.

Forward: sdpa with ``is_causal`` on each sequence (the arithmetic of the ``sdpa_varlen`` backend, so compiled and
eager forwards agree). Backward, per sequence, from the saved q, k, v and output (flash-attention's recompute):
``S = scale q k^T`` (causal), ``P = softmax(S)``, ``dV = P^T dO``, ``dP = dO V^T``, ``dS = P * (dP - rowsum(dO * O))``,
``dQ = scale dS K``, ``dK = scale dS^T Q``; with grouped-query attention (Hq = g Hkv) the g query heads' dK and dV of
a key head add up. Computed in float32 and returned in the input dtype.

Under autocast the op is a lower-precision op, as sdpa is (``torch.library.register_autocast``, CUDA and CPU, to
bfloat16, the only autocast dtype fastgrpo trains with): q and k leave the rotary embedding in float32 (its cos / sin
follow the float32 residual stream) while v leaves its projection in bfloat16, and the op gets all three in bfloat16,
as sdpa would cast them itself. (The op's own implementation runs below the autocast key: without this rule it would
see the mixed dtypes, which sdpa refuses.)

Legend: T tokens in the row, Hq query heads, Hkv key/value heads, d head size, C entries of ``cu_seqlens``,
L one sequence's length.
"""

from __future__ import annotations

import torch

__all__ = ["varlen_attn"]


def _lengths(cu_seqlens: torch.Tensor) -> list[int]:
    bounds = cu_seqlens.tolist()  # C host ints: free on a CPU (on an accelerator the caller uses torch's op)
    return [b - a for a, b in zip(bounds[:-1], bounds[1:])]


@torch.library.custom_op("fastgrpo::varlen_attn", mutates_args=())
def varlen_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
                scale: float) -> torch.Tensor:
    """Causal attention within each sequence: q ``[T, Hq, d]``, k / v ``[T, Hkv, d]``, cu_seqlens ``[C]`` int32
    (last entry T; repeated entries are empty sequences) -> ``[T, Hq, d]``. ``max_seqlen`` (>= every length) is
    what the CUDA kernels need; the implementation here does not read it."""
    lengths = _lengths(cu_seqlens)
    if sum(lengths) != q.shape[0]:
        raise ValueError(f"varlen_attn: cu_seqlens ends at {sum(lengths)}, the row has {q.shape[0]} tokens")
    gqa = q.shape[1] != k.shape[1]
    outs = []
    for qs, ks, vs in zip(*(t.split(lengths) for t in (q, k, v))):  # [L, H, d] each
        if qs.shape[0] == 0:
            continue
        o = torch.nn.functional.scaled_dot_product_attention(
            qs.transpose(0, 1)[None], ks.transpose(0, 1)[None], vs.transpose(0, 1)[None], is_causal=True,
            scale=scale, enable_gqa=gqa)  # [1, Hq, L, d]
        outs.append(o[0].transpose(0, 1))  # [L, Hq, d]
    return torch.cat(outs).contiguous() if outs else torch.empty_like(q)


@varlen_attn.register_fake
def _(q, k, v, cu_seqlens, max_seqlen, scale):
    return torch.empty_like(q)


@torch.library.custom_op("fastgrpo::varlen_attn_backward", mutates_args=())
def varlen_attn_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                         cu_seqlens: torch.Tensor, max_seqlen: int,
                         scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients ``(dq [T, Hq, d], dk [T, Hkv, d], dv [T, Hkv, d])`` of :func:`varlen_attn` (module doc)."""
    lengths = _lengths(cu_seqlens)
    g = q.shape[1] // k.shape[1]
    dqs, dks, dvs = [], [], []
    parts = (t.float().split(lengths) for t in (grad, q, k, v, out))
    for do, qs, ks, vs, o in zip(*parts):  # [L, H, d] each, float32
        n = qs.shape[0]
        kk, vv = (t.repeat_interleave(g, dim=1) for t in (ks, vs))  # [L, Hq, d]
        s = torch.einsum("qhd,khd->hqk", qs, kk) * scale  # [Hq, L, L]
        causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril_()
        p = s.masked_fill(~causal, float("-inf")).softmax(-1)  # [Hq, L, L]
        dv = torch.einsum("hqk,qhd->khd", p, do)  # [L, Hq, d]
        dp = torch.einsum("qhd,khd->hqk", do, vv)  # [Hq, L, L]
        ds = p * (dp - (do * o).sum(-1).transpose(0, 1)[:, :, None])  # [Hq, L, L]
        dqs.append(torch.einsum("hqk,khd->qhd", ds, kk) * scale)
        dk = torch.einsum("hqk,qhd->khd", ds, qs) * scale  # [L, Hq, d]
        dks.append(dk.unflatten(1, (-1, g)).sum(2))  # the g query heads of each key head: [L, Hkv, d]
        dvs.append(dv.unflatten(1, (-1, g)).sum(2))
    return tuple(torch.cat(parts).to(t.dtype) if parts else torch.zeros_like(t)
                 for parts, t in ((dqs, q), (dks, k), (dvs, v)))


@varlen_attn_backward.register_fake
def _(grad, q, k, v, out, cu_seqlens, max_seqlen, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, cu_seqlens, max_seqlen, scale = inputs
    ctx.save_for_backward(q, k, v, output, cu_seqlens)
    ctx.max_seqlen, ctx.scale = max_seqlen, scale


def _backward(ctx, grad):
    q, k, v, out, cu_seqlens = ctx.saved_tensors
    dq, dk, dv = torch.ops.fastgrpo.varlen_attn_backward(grad.contiguous(), q, k, v, out, cu_seqlens,
                                                         ctx.max_seqlen, ctx.scale)
    return dq, dk, dv, None, None, None


varlen_attn.register_autograd(_backward, setup_context=_setup_context)

AUTOCAST_DTYPE = torch.bfloat16
"""What the op computes in under autocast (module doc): the floating inputs are cast to it."""
for _device_type in ("cuda", "cpu"):
    torch.library.register_autocast("fastgrpo::varlen_attn", _device_type, AUTOCAST_DTYPE)
