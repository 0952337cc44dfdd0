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

``torch.ops.fastgrpo.varlen_attn_kv`` is the same with keys of their own layout (a row with a shared prefix,
:mod:`fastgrpo.models.packing`: query segment i attends key segment i, whose keys are its prefix's, then its own),
causal aligned bottom-right as in FlashAttention: query j of a segment of Lq queries and Lk keys sees keys
0 .. j + Lk - Lq; the backward is the one above on that mask.

Legend: T tokens in the row, Hq query heads, Hkv key/value heads, d head size, C entries of ``cu_seqlens``,
L one sequence's length.
"""

from __future__ import annotations

import torch

__all__ = ["bottom_right_causal", "varlen_attn", "varlen_attn_kv"]


def _lengths(cu_seqlens: torch.Tensor) -> list[int]:
    bounds = cu_seqlens.tolist()  # C host ints: free on a CPU (on an accelerator the caller uses torch's op)
    return [b - a for a, b in zip(bounds[:-1], bounds[1:])]


def bottom_right_causal(n_q: int, n_k: int, device: torch.device) -> torch.Tensor:
    """[n_q, n_k] bool, causal aligned bottom-right: query i sees keys j <= i + n_k - n_q (the last query the last
    key), as FlashAttention aligns it; n_q = n_k is the plain causal mask."""
    return torch.ones(n_q, n_k, dtype=torch.bool, device=device).tril_(n_k - n_q)


def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths_q: list[int], lengths_k: list[int],
             scale: float) -> torch.Tensor:
    """Causal attention of each query segment on its key segment (bottom-right aligned): q ``[Tq, Hq, d]``, k / v
    ``[Tk, Hkv, d]`` -> ``[Tq, Hq, d]``."""
    if sum(lengths_q) != q.shape[0] or sum(lengths_k) != k.shape[0]:
        raise ValueError(f"varlen_attn: the boundaries end at {sum(lengths_q)} queries and {sum(lengths_k)} keys, "
                         f"the row has {q.shape[0]} and {k.shape[0]}")
    gqa = q.shape[1] != k.shape[1]
    outs = []
    for qs, ks, vs in zip(q.split(lengths_q), k.split(lengths_k), v.split(lengths_k)):  # [L, H, d] each
        if qs.shape[0] == 0:
            continue
        same = qs.shape[0] == ks.shape[0]
        o = torch.nn.functional.scaled_dot_product_attention(
            qs.transpose(0, 1)[None], ks.transpose(0, 1)[None], vs.transpose(0, 1)[None], is_causal=same,
            attn_mask=None if same else bottom_right_causal(qs.shape[0], ks.shape[0], q.device), scale=scale,
            enable_gqa=gqa)  # [1, Hq, L, d]
        outs.append(o[0].transpose(0, 1))  # [L, Hq, d]
    return torch.cat(outs).contiguous() if outs else torch.empty_like(q)


def _backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
              lengths_q: list[int], lengths_k: list[int],
              scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients ``(dq [Tq, Hq, d], dk [Tk, Hkv, d], dv [Tk, Hkv, d])`` of :func:`_forward` (module doc)."""
    g = q.shape[1] // k.shape[1]
    dqs, dks, dvs = [], [], []
    for do, qs, o, ks, vs in zip(*(t.float().split(lengths_q) for t in (grad, q, out)),
                                 *(t.float().split(lengths_k) for t in (k, v))):  # [L, H, d] each, float32
        kk, vv = (t.repeat_interleave(g, dim=1) for t in (ks, vs))  # [Lk, Hq, d]
        s = torch.einsum("qhd,khd->hqk", qs, kk) * scale  # [Hq, Lq, Lk]
        causal = bottom_right_causal(qs.shape[0], ks.shape[0], q.device)
        p = s.masked_fill(~causal, float("-inf")).softmax(-1)  # [Hq, Lq, Lk]
        dv = torch.einsum("hqk,qhd->khd", p, do)  # [Lk, Hq, d]
        dp = torch.einsum("qhd,khd->hqk", do, vv)  # [Hq, Lq, Lk]
        ds = p * (dp - (do * o).sum(-1).transpose(0, 1)[:, :, None])  # [Hq, Lq, Lk]
        dqs.append(torch.einsum("hqk,khd->qhd", ds, kk) * scale)
        dk = torch.einsum("hqk,qhd->khd", ds, qs) * scale  # [Lk, Hq, d]
        dks.append(dk.unflatten(1, (-1, g)).sum(2))  # the g query heads of each key head: [Lk, Hkv, d]
        dvs.append(dv.unflatten(1, (-1, g)).sum(2))
    return tuple(torch.cat(parts).to(t.dtype) if parts else torch.zeros_like(t)
                 for parts, t in ((dqs, q), (dks, k), (dvs, v)))


@torch.library.custom_op("fastgrpo::varlen_attn", mutates_args=())
def varlen_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
                scale: float) -> torch.Tensor:
    """Causal attention within each sequence: q ``[T, Hq, d]``, k / v ``[T, Hkv, d]``, cu_seqlens ``[C]`` int32
    (last entry T; repeated entries are empty sequences) -> ``[T, Hq, d]``. ``max_seqlen`` (>= every length) is
    what the CUDA kernels need; the implementation here does not read it."""
    lengths = _lengths(cu_seqlens)
    return _forward(q, k, v, lengths, lengths, scale)


@varlen_attn.register_fake
def _(q, k, v, cu_seqlens, max_seqlen, scale):
    return torch.empty_like(q)


@torch.library.custom_op("fastgrpo::varlen_attn_backward", mutates_args=())
def varlen_attn_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                         cu_seqlens: torch.Tensor, max_seqlen: int,
                         scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients ``(dq [T, Hq, d], dk [T, Hkv, d], dv [T, Hkv, d])`` of :func:`varlen_attn` (module doc)."""
    lengths = _lengths(cu_seqlens)
    return _backward(grad, q, k, v, out, lengths, lengths, scale)


@varlen_attn_backward.register_fake
def _(grad, q, k, v, out, cu_seqlens, max_seqlen, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, cu_seqlens, max_seqlen, scale = inputs
    ctx.save_for_backward(q, k, v, output, cu_seqlens)
    ctx.max_seqlen, ctx.scale = max_seqlen, scale


def _grad(ctx, grad):
    q, k, v, out, cu_seqlens = ctx.saved_tensors
    dq, dk, dv = torch.ops.fastgrpo.varlen_attn_backward(grad.contiguous(), q, k, v, out, cu_seqlens,
                                                         ctx.max_seqlen, ctx.scale)
    return dq, dk, dv, None, None, None


varlen_attn.register_autograd(_grad, setup_context=_setup_context)


@torch.library.custom_op("fastgrpo::varlen_attn_kv", mutates_args=())
def varlen_attn_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                   cu_seqlens_k: torch.Tensor, max_seqlen: int, scale: float) -> torch.Tensor:
    """:func:`varlen_attn` with keys of their own layout (a row with a shared prefix: each segment's keys are its
    prefix's, gathered, then its own): q ``[Tq, Hq, d]``, k / v ``[Tk, Hkv, d]``, ``cu_seqlens_q`` and
    ``cu_seqlens_k`` ``[C]`` int32 -> ``[Tq, Hq, d]``; query segment i attends key segment i, causal aligned
    bottom-right (its last query sees all its keys)."""
    return _forward(q, k, v, _lengths(cu_seqlens_q), _lengths(cu_seqlens_k), scale)


@varlen_attn_kv.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen, scale):
    return torch.empty_like(q)


@torch.library.custom_op("fastgrpo::varlen_attn_kv_backward", mutates_args=())
def varlen_attn_kv_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                            cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen: int,
                            scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients ``(dq [Tq, Hq, d], dk [Tk, Hkv, d], dv [Tk, Hkv, d])`` of :func:`varlen_attn_kv`."""
    return _backward(grad, q, k, v, out, _lengths(cu_seqlens_q), _lengths(cu_seqlens_k), scale)


@varlen_attn_kv_backward.register_fake
def _(grad, q, k, v, out, cu_seqlens_q, cu_seqlens_k, max_seqlen, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context_kv(ctx, inputs, output) -> None:
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen, scale = inputs
    ctx.save_for_backward(q, k, v, output, cu_seqlens_q, cu_seqlens_k)
    ctx.max_seqlen, ctx.scale = max_seqlen, scale


def _grad_kv(ctx, grad):
    q, k, v, out, cu_q, cu_k = ctx.saved_tensors
    dq, dk, dv = torch.ops.fastgrpo.varlen_attn_kv_backward(grad.contiguous(), q, k, v, out, cu_q, cu_k,
                                                            ctx.max_seqlen, ctx.scale)
    return dq, dk, dv, None, None, None, None


varlen_attn_kv.register_autograd(_grad_kv, setup_context=_setup_context_kv)

AUTOCAST_DTYPE = torch.bfloat16
"""What the op computes in under autocast (module doc): the floating inputs are cast to it."""
for _device_type in ("cuda", "cpu"):
    for _op in ("fastgrpo::varlen_attn", "fastgrpo::varlen_attn_kv"):
        torch.library.register_autocast(_op, _device_type, AUTOCAST_DTYPE)
