"""The ``"cublas"`` path of ``linear_grpo_loss``: gradient computed in forward, three large products in all.

Shapes: N rows (tokens), H hidden, V vocabulary, C rows per chunk.
Notation: ``x = hidden @ weight.T`` (raw logits), ``z = x / T`` (T = temperature), ``p = softmax(z)``.

Why a second design next to ``_triton.py``? The loss is a scalar, and every per-token quantity its gradient
needs (advantage, old and reference log-probs, token weight) is known in forward. So as soon as a chunk's
log-sum-exp is known, the gradient of the loss with respect to that chunk's logits can be formed, and the logits
are never needed again: backward does not recompute them. That is three ``N x V x H`` products, the floor,
against four for the recompute path.

Per chunk of C rows, with one ``[C, V]`` buffer in the inputs' dtype (at most ``_BUFFER_BYTES``):
  1. ``x = hidden[rows] @ weight.T``                    cuBLAS, written into the buffer          (product 1)
  2. ``_rowstats_kernel``: lse, logp, entropy           Triton, reads the buffer once
  3. ``g = token_weight * dl/dlogp``                    ``[C]`` vector ops, ``objective.logp_grad`` (closed form)
  4. ``_softmax_grad_kernel``: ``x <- g (onehot - p) / T``  Triton, in place
  5. ``grad_hidden[rows] = x @ weight``                 cuBLAS                                   (product 2)
  6. ``grad_weight += x.T @ hidden[rows]``              cuBLAS, into the gradient itself          (product 3)
Backward only scales the stored gradients by the loss's upstream gradient, in place, with a kernel that returns
at once when it is 1 (``loss.backward()``): no host sync in either direction.

Numerics: the buffer holds the logits in the inputs' dtype, exactly what ``model(...).logits`` gives and what
the bf16 torch reference (TRL) computes; the statistics and the softmax gradient are formed in float32 from it;
the gradient products accumulate in float32 inside cuBLAS. ``grad_weight`` is summed over chunks in one of two
ways (``_accumulate_grad_weight``):
  * up to ``_BF16_SUM_MAX_CHUNKS`` (16) chunks: in the weight's own dtype (``addmm_``: one rounding per chunk), no
    float32 ``[V, H]`` buffer. That buffer would be the largest extra allocation of the op (1.2 GB for a
    Qwen2.5-3B head), and with the default 768 MB ``[C, V]`` buffer 16 chunks cover 42k tokens at V = 151936.
  * more chunks: in a float32 ``[V, H]`` buffer, each chunk's product rounded once to the weight's dtype (into
    ``grad_weight``, used as scratch) and added in float32, then copied into ``grad_weight`` once. The error is
    then about two roundings whatever the chunk count.
The bf16 running sum's error grows with the chunk count: relative to the plain bf16 computation (one product
over all rows), an emulation of these numerics on CPU (N = 2048, H = 256, V = 8192, 2 seeds) gives grad_weight
errors of 1.46-1.50x at 8 chunks, 1.70-1.73x at 16 and 1.91-1.95x at 32; the H100 measured 2.01x at 32, past
the 2x criterion (tests/kernels/test_gpu.py). Hence the cut at 16. Extra memory is therefore one ``[C, V]``
buffer plus ``[N]`` vectors, and a float32 ``[V, H]`` buffer only beyond 16 chunks.

Costs against the recompute path, estimated, not measured here: one large product fewer; about 6 extra bytes of
traffic per logit (the buffer is written once by cuBLAS, read twice, written once), a few per cent of a product
at H >= 2048 on an H100; one ``[C, V]`` buffer; and the stored gradients live from forward to backward, which in
a training step is the time it takes to start the backward pass.

Zero-weight rows: their count stays on the device (no host sync), and cuBLAS needs row counts on the host, so
such rows still pass through the three products; the row kernels skip them (no softmax work) and their ``dx``
rows are zero, so they add nothing. The recompute path (``backend="triton"``) skips them entirely: prefer it
when a large share of the rows has weight 0 (e.g. prompt positions passed with weight 0).
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from . import _triton

INTERPRET = _triton.INTERPRET

_BUFFER_BYTES = 768 << 20  # the [C, V] logits / dlogits buffer: fewer chunks, fewer grad_weight roundings
_BF16_SUM_MAX_CHUNKS = 16  # above this many chunks grad_weight is summed in float32 (module docstring)
_ROW_BLOCK_V = 32 if INTERPRET else 4096
_ROW_WARPS = 8


@triton.jit
def _rowstats_kernel(x_ptr, tgt_ptr, n_active_ptr, lse_ptr, logp_ptr, ent_ptr, row_start, V, stride_x, inv_temp,
                     BLOCK_V: tl.constexpr):
    # One program per row of the [C, V] buffer: online log-sum-exp over BLOCK_V-wide slices, in float32.
    # Rows at or past the selected count (token weight 0) get zeros and no softmax work.
    row = tl.program_id(0)
    if row_start + row >= tl.load(n_active_ptr):
        tl.store(lse_ptr + row, 0.0)
        tl.store(logp_ptr + row, 0.0)
        tl.store(ent_ptr + row, 0.0)
        return
    base = x_ptr + row.to(tl.int64) * stride_x
    offs = tl.arange(0, BLOCK_V)
    m = tl.full((), float("-inf"), dtype=tl.float32)  # running max of z
    s = tl.zeros((), dtype=tl.float32)  # sum exp(z - m)
    a = tl.zeros((), dtype=tl.float32)  # sum exp(z - m) * z
    for v0 in range(0, V, BLOCK_V):
        mask = offs < V - v0
        z = tl.load(base + v0 + offs, mask=mask, other=0.0).to(tl.float32) * inv_temp
        m_new = tl.maximum(m, tl.max(tl.where(mask, z, float("-inf")), axis=0))
        alpha = tl.exp(m - m_new)
        e = tl.where(mask, tl.exp(z - m_new), 0.0)
        s = s * alpha + tl.sum(e, axis=0)
        a = a * alpha + tl.sum(e * z, axis=0)
        m = m_new
    lse = m + tl.log(s)
    tgt = tl.load(tgt_ptr + row).to(tl.int64)
    # check_targets rejects ids outside [0, V) before this runs; the mask keeps a bad id from reading another
    # row's logit (or before the buffer) even so: its log-prob is NaN.
    ok = (tgt >= 0) & (tgt < V)
    zt = tl.load(base + tl.where(ok, tgt, 0), mask=ok, other=float("nan")).to(tl.float32) * inv_temp
    tl.store(lse_ptr + row, lse)
    tl.store(logp_ptr + row, zt - lse)
    tl.store(ent_ptr + row, lse - a / s)


@triton.jit
def _softmax_grad_kernel(x_ptr, tgt_ptr, lse_ptr, g_ptr, V, stride_x, inv_temp, BLOCK_V: tl.constexpr):
    # x[row, v] <- g[row] * (onehot(target)[v] - softmax(z)[v]) / T, in place, in the buffer's dtype.
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    mask = offs < V
    ptrs = x_ptr + row.to(tl.int64) * stride_x + offs
    g = tl.load(g_ptr + row)
    if g == 0:
        dx = tl.zeros((BLOCK_V,), dtype=tl.float32)
    else:
        lse = tl.load(lse_ptr + row)
        tgt = tl.load(tgt_ptr + row).to(tl.int32)
        z = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32) * inv_temp
        p = tl.exp(z - lse)
        dx = (tl.where(offs == tgt, g, 0.0) - g * p) * inv_temp
    tl.store(ptrs, dx.to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _scale_kernel(x_ptr, s_ptr, numel, BLOCK: tl.constexpr):
    # x *= s in place, unless s == 1 (loss.backward()'s upstream gradient): then every program returns at once,
    # so the common case costs one launch and no host sync.
    s = tl.load(s_ptr)
    if s == 1.0:
        return
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    tl.store(x_ptr + offs, (x.to(tl.float32) * s).to(x_ptr.dtype.element_ty), mask=mask)


def scale_(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """``x *= s`` (``s`` a 0-d float32 device tensor) without a host sync; free when ``s == 1``."""
    block = 64 if INTERPRET else 4096
    _scale_kernel[(triton.cdiv(x.numel(), block),)](x, s.float().reshape(1), x.numel(), BLOCK=block, num_warps=8)
    return x


# ------------------------------------------------------------------------------------------------ products


@contextlib.contextmanager
def full_precision_reductions():
    """cuBLAS reductions in float32 inside the block, torch's settings restored after (even on error).

    ``torch.backends.cuda.matmul.allow_{bf16,fp16}_reduced_precision_reduction`` is on by default: cuBLAS may then
    sum split-K partial products in the 16-bit type. Product 2 has K = V (151936 for Qwen2.5), the case where
    split-K is likely and 16-bit partial sums lose most; no CPU test can see that, so the flags are cleared
    around all three products instead of trusting the defaults. The flags are process-wide (another thread's
    products inside the block also reduce in float32); reading and setting them costs no device work.
    """
    matmul = torch.backends.cuda.matmul
    saved = {}
    for name in ("bf16", "fp16"):
        getter = getattr(torch._C, f"_get_cublas_allow_{name}_reduced_precision_reduction", None)
        if getter is not None:
            saved[name] = getter()  # a bool, or (allow_reduced_precision, allow_splitk) in newer torch
            setattr(matmul, f"allow_{name}_reduced_precision_reduction", False)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(matmul, f"allow_{name}_reduced_precision_reduction", value)


def _accumulate_grad_weight(grad_weight, dx, h, *, first: bool, acc32=None) -> None:
    """``grad_weight (+)= dx.T @ h`` (``dx [c, V]``, ``h [c, H]``); cuBLAS sums each chunk's product in float32.

    ``acc32`` None: the running sum stays in the weight's dtype, rounding once per chunk. ``acc32 [V, H]`` float32:
    the chunk's product is rounded once into ``grad_weight`` (scratch) and added to ``acc32``; the caller copies
    ``acc32`` into ``grad_weight`` after the last chunk. See the module docstring for which and why.
    """
    if acc32 is None:
        if first:
            torch.mm(dx.T, h, out=grad_weight)
        else:
            grad_weight.addmm_(dx.T, h)
        return
    torch.mm(dx.T, h, out=grad_weight)
    if first:
        acc32.copy_(grad_weight)
    else:
        acc32.add_(grad_weight)


def loss_pass(hidden, weight, targets, token_weights, objective, *, inv_temp, need_grad_hidden, need_grad_weight,
              chunk_size=None, with_entropy=True, bias=None, grad_bias=None):
    """Forward of the loss with its gradients; no host sync. (The entropy comes with the row statistics at no
    cost, so ``with_entropy`` is accepted for ``_chunked.loss_pass``'s signature and ignored.)

    ``objective``: a row-local ``TokenObjective`` (``l_n``), or None when no gradient is asked (``logprobs_pass``).
    Returns ``(logp, entropy, grad_hidden, grad_weight)``: ``[N]`` float32 each (0 on rows with token weight 0),
    then the gradients of ``objective.weighted_loss`` (in the inputs' dtypes; None where not needed). ``bias [V]``
    is added to the logits in product 1 (``addmm``, one rounding, as ``nn.Linear``); ``grad_bias``, a float32
    ``[V]`` buffer or None, gets the bias's gradient (the column sums of each chunk's ``dx``) added into it.

    Rows are visited in a device-side order that puts the selected ones (token weight != 0) first. Their count
    stays on the device, so the products run over all N rows, while the row kernels skip the unselected ones:
    a zero-weight row costs its share of the three products but no softmax work, and its ``dx`` row is zero.
    """
    hidden, weight = hidden.contiguous(), weight.contiguous()
    n, h_dim = hidden.shape
    vocab = weight.shape[0]
    dev = hidden.device
    f32 = dict(dtype=torch.float32, device=dev)
    logp = torch.zeros(n, **f32)
    entropy = torch.zeros(n, **f32)
    grad_hidden = torch.zeros_like(hidden) if need_grad_hidden else None
    grad_weight = torch.empty_like(weight) if need_grad_weight else None
    if n == 0:
        return logp, entropy, grad_hidden, None if grad_weight is None else grad_weight.zero_()

    active = token_weights != 0 if objective is None else objective.active(token_weights)  # [N]
    order, n_active = _triton._compact(active, n, dev)  # [N] int32, selected rows first; [1]
    order = order.long()
    if chunk_size is None:
        chunk_size = max(1, _BUFFER_BYTES // (vocab * hidden.element_size()))
    elif chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    chunk = min(chunk_size, n)
    buf = torch.empty((chunk, vocab), dtype=hidden.dtype, device=dev)  # [C, V]
    many = need_grad_weight and weight.dtype != torch.float32 and -(-n // chunk) > _BF16_SUM_MAX_CHUNKS
    acc32 = torch.empty(weight.shape, **f32) if many else None  # [V, H] float32 running sum of grad_weight
    need_grad = need_grad_hidden or need_grad_weight or grad_bias is not None
    block_v = _ROW_BLOCK_V
    with full_precision_reductions():  # products 2 and 3 sum over V and over the chunk's rows in float32
        for start in range(0, n, chunk):
            idx = order[start:start + chunk]  # [c] rows of this chunk
            c = idx.numel()
            h = hidden.index_select(0, idx)  # [c, H]
            tgt = targets.index_select(0, idx)
            x = buf[:c]
            if bias is None:
                torch.mm(h, weight.T, out=x)  # product 1: logits [c, V]
            else:
                torch.addmm(bias, h, weight.T, out=x)
            lse_c, logp_c, ent_c = (torch.empty(c, **f32) for _ in range(3))
            _rowstats_kernel[(c,)](x, tgt, n_active, lse_c, logp_c, ent_c, start, vocab, x.stride(0), inv_temp,
                                   BLOCK_V=block_v, num_warps=_ROW_WARPS)
            logp.index_copy_(0, idx, logp_c)
            entropy.index_copy_(0, idx, ent_c)
            if not need_grad:
                continue
            g_c = objective.rows(idx).logp_grad(logp_c, token_weights.index_select(0, idx)).contiguous()  # [c]
            _softmax_grad_kernel[(c, triton.cdiv(vocab, block_v))](x, tgt, lse_c, g_c, vocab, x.stride(0), inv_temp,
                                                                    BLOCK_V=block_v, num_warps=_ROW_WARPS)
            if need_grad_hidden:
                grad_hidden.index_copy_(0, idx, x @ weight)  # product 2
            if need_grad_weight:
                _accumulate_grad_weight(grad_weight, x, h, first=start == 0, acc32=acc32)  # product 3
            if grad_bias is not None:
                grad_bias.add_(x.sum(0, dtype=torch.float32))
    del buf
    if acc32 is not None:
        grad_weight.copy_(acc32)
    return logp, entropy, grad_hidden, grad_weight


def logprobs_pass(hidden, weight, targets, *, inv_temp, chunk_size=None, bias=None):
    """``(logp, entropy)`` with the loss path's numerics (logits in the inputs' dtype from cuBLAS), no gradient.

    For old / reference log-probs that must agree with what ``loss_pass`` computes for the same rows: a ratio
    ``exp(logp - old)`` of two different numerics is not exactly 1 even when the policy has not moved.
    """
    every_row = torch.ones(hidden.shape[0], dtype=torch.float32, device=hidden.device)  # [N] token weights
    logp, entropy, _, _ = loss_pass(hidden, weight, targets, every_row, None, inv_temp=inv_temp,
                                    need_grad_hidden=False, need_grad_weight=False, chunk_size=chunk_size,
                                    bias=bias)
    return logp, entropy
