"""Chunked plain-torch backend of the fused lm_head ops (CPU, or CUDA with ``backend="torch"``).

Shapes: N rows (tokens), H hidden, V vocabulary, C rows per chunk, K selected rows.
Notation: ``x = hidden @ weight.T`` (raw logits), ``z = x / T`` (T = temperature), ``p = softmax(z)``.

Two uses share one chunk step (``_chunk_logprobs``: product 1, then the softmax's exponentials in place):
  * ``forward`` / ``backward``: the op of ``logprobs.py`` (``linear_logprobs``). Forward keeps ``[N]``
    statistics only; backward recomputes each chunk's logits: four ``N x V x H`` products in all. The op returns
    a vector whose upstream gradient is unknown in forward, so nothing can be multiplied out earlier.
  * ``loss_pass``: ``linear_grpo_loss``'s path. The loss is a scalar and every per-token quantity of its gradient
    is known in forward, so each chunk's logit gradient is formed as soon as its softmax is known and multiplied
    out at once (what ``_gradfwd.py`` does with Triton on CUDA): three products, the floor. Backward only scales
    the stored gradients.

A loss-pass chunk, everything in one ``[C, V]`` float32 buffer ``x``, in place:
  1. ``x = (h * log2(e) / T) @ W.T``                   product 1 (base-2 logits: exp2 is half the cost of exp)
  2. ``x <- exp2(x - max)``; ``s = sum``; lse, logp    ``p = x / s``
  3. ``x <- x * (-g / T / s)``, ``x[target] += g / T``  ``g = token_weight * dl/dlogp`` (``objective.logp_grad``)
  4. ``grad_hidden[rows] = x @ W``                       product 2
  5. ``grad_weight += x.T @ h``                          product 3, into the gradient itself
Rows whose gradient is zero whatever their logits never enter products 2 and 3: token weight 0 (no product at
all) and rows outside ``objective.moving`` (with beta == 0, advantage 0: every token of a group with equal
rewards; forward only, for its logp).
A gradient autograd does not need is never formed, on either use: a frozen lm_head (LoRA) skips product 3 and the
``[V, H]`` gradient buffer, a frozen trunk skips product 2.
Row selection uses ``nonzero()``, a host sync: free on CPU; on CUDA this backend is only the fallback (the
Triton paths select rows on the device).

Chunk size (``_chunk_rows``): the products want many rows per chunk, because each chunk's ``grad_weight +=`` is a
rank-C update that reads and writes all of the ``[V, H]`` gradient: below a few hundred rows that traffic, not
the arithmetic, sets the time on a CPU. The memory bound wants few. C is the largest row count whose buffer stays
within both a device budget (``_budget_bytes``: 512 MiB, less on a device with under 16 GiB) and a fifth of an
``[N, V]`` float32 tensor, but at least ``_MIN_ROWS`` (below that, the ``[C, V]`` buffer is smaller than the
``[V, H]`` gradient anyway once ``C < H``); chunks are then evened out. Extra memory: the buffer, ``[C, H]`` and
``[N]`` vectors, and on the entropy paths ``[16, V]`` temporaries.

Everything is computed in float32 (bf16 inputs are upcast chunk by chunk; the weight once, which costs one
``[V, H]`` float32 copy, the size of the gradient buffer, and one that a frozen bf16 head still pays; float32
weights, the CPU default, are used as they are). On CUDA that makes every product a float32 GEMM
without tensor cores: ``linear_logprobs(backend="torch")`` measured 15-21x the bf16 three-product floor on an
H100 (benchmarks/bench_kernels.py). That is the float32 / bf16 peak ratio (67 against 989 TFLOP/s on an H100
SXM) times four products over three, not the chunking: at N = 32768, H = 2048, V = 151936 the 512 MiB budget gives
38 chunks, whose ``[V, H]`` float32 read-modify-writes add about 30 ms to the 1.7 s measured. On CUDA this backend
is the precise fallback; "auto" picks the Triton paths there.
"""

from __future__ import annotations

import functools
import os

import torch

_MAX_BUDGET_BYTES = 512 << 20
_MIN_ROWS = 256
_NV_SHARE = 5  # the buffer stays within 1 / _NV_SHARE of an [N, V] float32 tensor
_BLOCK_ROWS = 16  # rows per temporary on the entropy paths
_LOG2E = 1.4426950408889634
_LN2 = 0.6931471805599453


@functools.lru_cache(maxsize=None)
def _budget_bytes(device_type: str, index: int | None) -> int:
    """Bytes for the ``[C, V]`` buffer on this device: ``_MAX_BUDGET_BYTES``, or 1/32 of its memory if less."""
    if device_type == "cuda":
        total = torch.cuda.get_device_properties(index or 0).total_memory
    else:
        try:
            total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):  # not POSIX
            return _MAX_BUDGET_BYTES
    return min(_MAX_BUDGET_BYTES, total // 32)


def _chunk_rows(k: int, vocab: int, device: torch.device, chunk_size: int | None) -> int:
    """Rows per chunk for ``k`` selected rows (see the module docstring)."""
    if chunk_size is not None:
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        return chunk_size
    row_bytes = 4 * vocab
    budget_rows = max(1, _budget_bytes(device.type, device.index) // row_bytes)
    rows = min(budget_rows, max(_MIN_ROWS, -(-k // _NV_SHARE)))
    n_chunks = -(-k // rows) if k else 1
    return max(1, -(-k // n_chunks))  # even chunks: no short last one


def _select(mask: torch.Tensor | None, n: int, device) -> torch.Tensor:
    if mask is None:
        return torch.arange(n, device=device)
    return mask.nonzero().squeeze(1)  # [K], host sync (see module docstring)


def _logits2(x, h, w32, inv_temp, b2=None):
    """Product 1 into ``x [c, V]``: the logits in base 2, ``z * log2(e)``. The scale is applied to ``h [c, H]``
    (free), and base 2 makes every exponential an ``exp2``, half the cost of ``exp`` on a CPU. ``b2 [V]``: the
    bias in the same units (``_bias2``), or None."""
    if b2 is None:
        torch.mm(h * (inv_temp * _LOG2E), w32.T, out=x)
    else:
        torch.addmm(b2, h * (inv_temp * _LOG2E), w32.T, out=x)


def _bias2(bias, inv_temp):
    """``bias [V]`` as float32 base-2 logits (``_logits2``'s units), or None."""
    return None if bias is None else bias.float() * (inv_temp * _LOG2E)


def _chunk_logprobs(x, h, w32, tgt, inv_temp, b2=None):
    """Product 1 into ``x [c, V]``, then ``x <- exp(z - max z)`` in place. Returns ``(logp, lse, s)``: ``[c]``
    each, and ``s [c, 1]`` with ``softmax(z) = x / s``.

    Written out rather than ``torch.log_softmax`` / ``softmax`` (whose CPU kernels sum each row in order, which
    loses about 1e-5 relative over 150k entries; ``sum`` here adds pairwise, 1e-7), and cheaper: one exp2 per
    entry and five passes in all, the buffer written twice.
    """
    _logits2(x, h, w32, inv_temp, b2)  # z2 = z * log2(e)  [c, V]
    z2_t = x.gather(1, tgt[:, None])  # [c, 1]
    m2 = x.amax(1, keepdim=True)  # [c, 1]
    x.sub_(m2).exp2_()  # e = exp(z - max z), in (0, 1]
    s = x.sum(1, keepdim=True)  # [c, 1], >= 1
    lse2 = m2 + s.log2()  # [c, 1]
    return ((z2_t - lse2) * _LN2).squeeze(1), (lse2 * _LN2).squeeze(1), s


def _entropy(e, s):
    """``-sum_v p log p`` per row, from ``e [c, V] = exp(z - max z)`` and ``s [c, 1]``: ``log s - sum(e log e) / s``,
    with ``[_BLOCK_ROWS, V]`` temporaries."""
    out = torch.empty(e.shape[0], dtype=torch.float32, device=e.device)
    for r in range(0, e.shape[0], _BLOCK_ROWS):
        blk = e[r:r + _BLOCK_ROWS]
        out[r:r + _BLOCK_ROWS] = torch.xlogy(blk, blk).sum(1)
    return s.squeeze(1).log() - out / s.squeeze(1)


def _chunks(rows: torch.Tensor, vocab: int, chunk_size: int | None):
    """``(buffer [C, V] float32, row index chunks [c] each)`` for the selected ``rows [K]``; no buffer if K == 0."""
    k = rows.numel()
    if k == 0:
        return None, []
    c = _chunk_rows(k, vocab, rows.device, chunk_size)
    return torch.empty((min(c, k), vocab), dtype=torch.float32, device=rows.device), rows.split(c)


# --------------------------------------------------------------------------------- linear_logprobs (recompute)


def forward(hidden, weight, targets, *, active, inv_temp, with_entropy, chunk_size, bias=None):
    """Returns ``(logp, entropy, lse, sum_pz)``, each ``[N]`` float32; rows outside ``active`` are 0.

    ``sum_pz[n] = sum_v p[v] * z[v] = lse - entropy``; backward needs it for the entropy gradient.
    """
    n, vocab = hidden.shape[0], weight.shape[0]
    w32, b2 = weight.float(), _bias2(bias, inv_temp)  # [V, H] (no copy when already float32), [V] or None
    f32 = dict(dtype=torch.float32, device=hidden.device)
    logp, entropy, lse, sum_pz = (torch.zeros(n, **f32) for _ in range(4))  # [N] each
    buf, chunks = _chunks(_select(active, n, hidden.device), vocab, chunk_size)
    for idx in chunks:  # idx: [c]
        x = buf[:idx.numel()]
        logp_c, lse_c, s = _chunk_logprobs(x, hidden.index_select(0, idx).float(), w32, targets[idx].long(),
                                           inv_temp, b2)
        logp[idx], lse[idx] = logp_c, lse_c
        if with_entropy:
            ent_c = _entropy(x, s)
            entropy[idx] = ent_c
            sum_pz[idx] = lse_c - ent_c
    return logp, entropy, lse, sum_pz


def backward(hidden, weight, targets, lse, sum_pz, g_logp, g_entropy, *, inv_temp, chunk_size,
             need_grad_hidden=True, need_grad_weight=True, bias=None, grad_bias=None):
    """Gradients w.r.t. ``hidden`` and ``weight`` given the upstream gradients of logp (and entropy); None for one
    not needed (a frozen head: no ``[V, H]`` gradient buffer and no product 3; a frozen trunk: no product 2).
    ``grad_bias``: a float32 ``[V]`` buffer that ``d/d bias = sum over rows of dX`` is added into, or None.

    With ``z = x * inv_temp``, ``x = hidden @ weight.T`` and ``p = softmax(z)``:
      d logp / dz_v    = onehot_v - p_v
      d entropy / dz_v = -p_v * (z_v - sum_pz) = -p_v * (log p_v + entropy)
      dX = inv_temp * (g_logp * (onehot - p) - g_entropy * p * (log p + entropy))      # [N, V], chunk by chunk
      grad_hidden = dX @ weight;  grad_weight = dX.T @ hidden
    Rows whose upstream gradients are both zero are skipped.
    """
    n, vocab = hidden.shape[0], weight.shape[0]
    w32, b2 = weight.float(), _bias2(bias, inv_temp)  # [V, H], [V] or None
    g = g_logp.float() * inv_temp  # [N]
    nonzero = g != 0
    if g_entropy is not None:
        g_entropy = g_entropy.float() * inv_temp
        nonzero |= g_entropy != 0
    f32 = dict(dtype=torch.float32, device=hidden.device)
    grad_hidden = torch.zeros(hidden.shape, **f32) if need_grad_hidden else None  # [N, H]
    grad_weight = torch.zeros(weight.shape, **f32) if need_grad_weight else None  # [V, H]
    buf, chunks = _chunks(_select(nonzero, n, hidden.device), vocab, chunk_size)
    for idx in chunks:  # idx: [c]
        x = buf[:idx.numel()]
        h = hidden.index_select(0, idx).float()  # [c, H]
        tgt = targets[idx, None].long()
        _logits2(x, h, w32, inv_temp, b2)  # product 1 again: z2 [c, V]
        x.sub_(lse[idx, None] * _LOG2E)  # log2 p
        g_c = g[idx, None]  # [c, 1]
        if g_entropy is None:
            x.exp2_().mul_(-g_c)
        else:  # x <- p * (-g - g_ent * (log p + entropy)), block by block (p needs a temporary)
            ge_c, ent_c = g_entropy[idx, None], (lse - sum_pz)[idx, None]
            for r in range(0, x.shape[0], _BLOCK_ROWS):
                blk, sl = x[r:r + _BLOCK_ROWS], slice(r, r + _BLOCK_ROWS)
                p = blk.exp2()
                blk.mul_(_LN2).add_(ent_c[sl]).mul_(-ge_c[sl]).sub_(g_c[sl]).mul_(p)
        x.scatter_add_(1, tgt, g_c)  # dX [c, V]
        if need_grad_hidden:
            grad_hidden.index_copy_(0, idx, x @ w32)  # product 2
        if need_grad_weight:
            grad_weight.addmm_(x.T, h)  # product 3
        if grad_bias is not None:
            grad_bias.add_(x.sum(0))
    return (None if grad_hidden is None else grad_hidden.to(hidden.dtype),
            None if grad_weight is None else grad_weight.to(weight.dtype))


# ------------------------------------------------------------------------------ linear_grpo_loss (grad in fwd)


def loss_pass(hidden, weight, targets, token_weights, objective, *, inv_temp, need_grad_hidden, need_grad_weight,
              chunk_size=None, with_entropy=True, bias=None, grad_bias=None):
    """Forward of ``sum_n token_weights[n] * l_n`` with its gradients (three products; see the module docstring).

    Same contract as ``_gradfwd.loss_pass``: ``objective`` a row-local ``TokenObjective`` (``l_n``); returns
    ``(logp, entropy, grad_hidden, grad_weight)``, ``[N]`` float32 each (0 on rows outside
    ``objective.active``; entropy 0 unless ``with_entropy``), then the gradients in the inputs' dtypes (None where
    not needed). ``bias [V]`` is added to the logits; ``grad_bias``, a float32 ``[V]`` buffer or None, gets the
    bias's gradient added into it.
    """
    n, vocab = hidden.shape[0], weight.shape[0]
    dev = hidden.device
    need_grad = need_grad_hidden or need_grad_weight or grad_bias is not None
    w32, b2 = weight.float(), _bias2(bias, inv_temp)  # [V, H], [V] or None
    f32 = dict(dtype=torch.float32, device=dev)
    logp, entropy = torch.zeros(n, **f32), torch.zeros(n, **f32)  # [N]
    grad_hidden = torch.zeros(hidden.shape, **f32) if need_grad_hidden else None  # [N, H]
    grad_w32 = None  # [V, H], created by the first product 3
    counted = objective.active(token_weights)  # [N] rows whose logp the loss needs
    moving = objective.moving(token_weights)  # rows with a possibly nonzero gradient
    grad_rows = _select(moving, n, dev) if need_grad else torch.zeros(0, dtype=torch.long, device=dev)
    fwd_rows = _select(counted & ~moving if need_grad else counted, n, dev)
    # A g known before any product is formed by one call for all rows instead of one per chunk.
    g_known = not objective.grad_depends_on_logp
    for rows, grad in ((grad_rows, True), (fwd_rows, False)):
        buf, chunks = _chunks(rows, vocab, chunk_size)
        if not chunks:
            continue
        tgt_k = targets.index_select(0, rows).long()[:, None]  # [K, 1], in row order, sliced per chunk
        if grad:
            obj_k, w_k = objective.rows(rows), token_weights.index_select(0, rows)  # [K] vectors
            g_k = obj_k.logp_grad(torch.zeros(rows.numel(), **f32), w_k) if g_known else None
        start = 0
        for idx in chunks:  # idx: [c]
            c = idx.numel()
            sl, start = slice(start, start + c), start + c
            x, tgt = buf[:c], tgt_k[sl]
            h = hidden.index_select(0, idx).float()  # [c, H]
            logp_c, _, s = _chunk_logprobs(x, h, w32, tgt.squeeze(1), inv_temp, b2)  # x <- e = s * p
            logp[idx] = logp_c
            if with_entropy:
                entropy[idx] = _entropy(x, s)
            if not grad:
                continue
            g_c = g_k[sl] if g_known else obj_k.rows(sl).logp_grad(logp_c, w_k[sl])
            g_c = g_c[:, None] * inv_temp  # [c, 1]
            x.mul_(-g_c / s).scatter_add_(1, tgt, g_c)  # dX = g / T * (onehot - p)
            if need_grad_hidden:
                grad_hidden.index_copy_(0, idx, x @ w32)  # product 2
            if need_grad_weight:
                if grad_w32 is None:
                    grad_w32 = x.T @ h  # product 3
                else:
                    grad_w32.addmm_(x.T, h)
            if grad_bias is not None:
                grad_bias.add_(x.sum(0))
        del buf
    if need_grad_weight and grad_w32 is None:
        grad_w32 = torch.zeros(weight.shape, **f32)
    return (logp, entropy, None if grad_hidden is None else grad_hidden.to(hidden.dtype),
            None if grad_w32 is None else grad_w32.to(weight.dtype))


def scale_(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """``x *= s`` (``s`` a 0-d tensor), no host sync."""
    return x.mul_(s.to(x.dtype))
