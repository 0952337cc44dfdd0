"""Triton backend of the fused linear -> log-prob op: kernels, then launchers on plain tensors.

Shapes: N rows (tokens), H hidden, V vocabulary, S vocabulary splits, C rows per backward chunk.
Notation: ``x = hidden @ weight.T`` (raw logits), ``z = x / T`` (T = temperature), ``p = softmax(z)``.

Forward (``_fwd_kernel``): grid ``(N / BLOCK_M, S)``. Each program owns BLOCK_M rows and one contiguous range of
vocabulary tiles; per tile it computes ``z`` with ``tl.dot`` over H and folds it into an online log-sum-exp
``(m, s)``, ``a = sum exp(z - m) * z`` (for the entropy) and the target logit. The S partials per row are
merged in torch (``[S, N]`` vectors). Splitting the vocabulary keeps every SM busy when N is small (N=1 still
gets ``cdiv(V, BLOCK_V)`` programs).

Backward, in row chunks of C rows (C * V elements of ``dx``, at most ``_DX_BUDGET_BYTES``):
  ``_dlogits_kernel``  recomputes the logits tile and writes
                       ``dx = (g_logp * (onehot - p) - g_ent * p * (z - sum_pz)) / T`` into a ``[C, V]``
                       buffer (in the inputs' dtype, as cuBLAS-based chunked losses do);
  ``_dhidden_kernel``  grad_hidden[rows] = dx @ W              (K loop over V)
  ``_dweight_kernel``  grad_weight += dx.T @ hidden[rows]      (K loop over the chunk's rows; one float32
                       ``[V, H]`` buffer, read-modify-write per chunk, no atomics: each program owns its tile)
Why materialise ``dx`` per chunk rather than fuse all three products into one kernel? A fused kernel must
either hold a ``[BLOCK_M, H]`` grad_hidden accumulator (too large for registers at H=4096) or atomically add
into grad_hidden once per vocabulary tile (V / BLOCK_V ~ 1000 float32 atomics per element). The ``[C, V]``
round trip costs about 3 bytes of traffic per element against 2*H flops per element for each product: a few
per cent of the products' time on an H100 (estimate from bandwidth and peak flops, not measured here).

Zero rows cost nothing, without a host sync: rows are reordered on the device so the selected ones come first
(a stable argsort) and their count is passed as a device pointer; a program whose rows all lie past the count
returns at once, and ``_dweight_kernel``'s loop stops at the count. Backward selects rows whose upstream
gradient is nonzero (token weight 0, or advantage 0 with beta 0); forward selects the ``active`` rows given by
the caller (``linear_grpo_loss`` passes ``token_weights != 0``).

In the Triton CPU interpreter (``TRITON_INTERPRET=1``) ``tl.dot`` on bf16 operands returns garbage (triton
3.9), so the launcher sets ``UPCAST`` and the kernels convert operands to float32 first.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

# Realistic Hopper tiles (see benchmarks/check_hopper.py for registers / spills / wgmma at these sizes).
# Small tiles for the interpreter keep the tests fast and exercise the multi-tile and masking paths.
GPU_BLOCKS = dict(BLOCK_M=128, BLOCK_V=128, BLOCK_H=128, BLOCK_K=64, num_warps=8, num_stages=3)
GPU_BLOCKS_FP32 = dict(BLOCK_M=64, BLOCK_V=64, BLOCK_H=64, BLOCK_K=32, num_warps=4, num_stages=2)
INTERPRET_BLOCKS = dict(BLOCK_M=16, BLOCK_V=32, BLOCK_H=32, BLOCK_K=16, num_warps=4, num_stages=1)

_DX_BUDGET_BYTES = 1 << 30


# ----------------------------------------------------------------------------------------------- kernels


@triton.jit
def _row_ids(rows_ptr, offs, mask, HAS_ROWS: tl.constexpr):
    # Position in the (possibly reordered) row list -> row of hidden / targets / outputs.
    if HAS_ROWS:
        rows = tl.load(rows_ptr + offs, mask=mask, other=0)
    else:
        rows = offs
    return rows.to(tl.int64)


@triton.jit
def _row_count(n_active_ptr, N, HAS_ROWS: tl.constexpr):
    if HAS_ROWS:
        n = tl.load(n_active_ptr)
    else:
        n = N
    return n


@triton.jit
def _logits_tile(h_ptr, w_ptr, rows, mask_m, offs_v, mask_v, Hdim, stride_h, stride_w, inv_temp,
                 BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
                 UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    # z[BLOCK_M, BLOCK_V] = hidden[rows] @ weight[offs_v].T * inv_temp, float32 accumulation over H.
    # Pointer tiles are rebuilt from [BM] / [BV] row offsets each step instead of being carried through the
    # loop: carried 64-bit pointer tiles cost 2 registers per element and pushed the forward kernel into spills.
    offs_k = tl.arange(0, BLOCK_K)
    h_rows = h_ptr + rows * stride_h  # [BM] pointers
    w_rows = w_ptr + offs_v.to(tl.int64) * stride_w  # [BV] pointers
    acc = tl.zeros((BLOCK_M, BLOCK_V), dtype=tl.float32)
    for k in range(0, Hdim, BLOCK_K):
        k_ok = offs_k < Hdim - k
        a = tl.load(h_rows[:, None] + (k + offs_k)[None, :], mask=mask_m[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_rows[None, :] + (k + offs_k)[:, None], mask=k_ok[:, None] & mask_v[None, :], other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    return acc * inv_temp


@triton.jit
def _fwd_kernel(h_ptr, w_ptr, tgt_ptr, rows_ptr, n_active_ptr,
                m_ptr, s_ptr, a_ptr, zt_ptr,  # [S, N] float32 partials
                N, V, Hdim, stride_h, stride_w, inv_temp, tiles_per_split,
                HAS_ROWS: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_s = tl.program_id(1)
    n_rows = _row_count(n_active_ptr, N, HAS_ROWS)
    if pid_m * BLOCK_M >= n_rows:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < n_rows
    rows = _row_ids(rows_ptr, offs_m, mask_m, HAS_ROWS)  # [BM]
    tgt = tl.load(tgt_ptr + rows, mask=mask_m, other=-1).to(tl.int32)  # [BM]; int32 compares are cheaper

    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)  # running max of z
    s_i = tl.zeros((BLOCK_M,), dtype=tl.float32)  # sum exp(z - m)
    a_i = tl.zeros((BLOCK_M,), dtype=tl.float32)  # sum exp(z - m) * z
    v_first = pid_s * tiles_per_split * BLOCK_V
    for t in range(0, tiles_per_split):
        offs_v = v_first + t * BLOCK_V + tl.arange(0, BLOCK_V)
        mask_v = offs_v < V
        z = _logits_tile(h_ptr, w_ptr, rows, mask_m, offs_v, mask_v, Hdim, stride_h, stride_w, inv_temp,
                         BLOCK_M, BLOCK_V, BLOCK_K, UPCAST, PRECISION)
        # Padded columns hold z = 0 (masked loads) and are masked out of the max and the sums.
        # The launcher guarantees each split's first tile has valid columns, so m_new is finite.
        m_new = tl.maximum(m_i, tl.max(tl.where(mask_v[None, :], z, float("-inf")), axis=1))
        alpha = tl.exp(m_i - m_new)
        e = tl.where(mask_v[None, :], tl.exp(z - m_new[:, None]), 0.0)  # [BM, BV]
        s_i = s_i * alpha + tl.sum(e, axis=1)
        a_i = a_i * alpha + tl.sum(e * z, axis=1)
        m_i = m_new
    # Target logit as a row-wise dot with weight[target], by the split whose vocabulary range holds the target.
    # Picking it out of each z tile with a [BM, BV] compare cost ~50 registers and pushed the kernel to 255.
    v_end = v_first + tiles_per_split * BLOCK_V
    has_t = mask_m & (tgt >= v_first) & (tgt < v_end)  # [BM]
    t_rows = w_ptr + tl.where(has_t, tgt, 0).to(tl.int64) * stride_w  # [BM] pointers
    h_rows = h_ptr + rows * stride_h
    offs_k = tl.arange(0, BLOCK_K)
    zt = tl.zeros((BLOCK_M,), dtype=tl.float32)  # x[target], the raw target logit
    for k in range(0, Hdim, BLOCK_K):
        kmask = has_t[:, None] & (offs_k < Hdim - k)[None, :]
        a = tl.load(h_rows[:, None] + (k + offs_k)[None, :], mask=kmask, other=0.0).to(tl.float32)
        b = tl.load(t_rows[:, None] + (k + offs_k)[None, :], mask=kmask, other=0.0).to(tl.float32)
        zt += tl.sum(a * b, axis=1)
    zt = zt * inv_temp
    out = pid_s * N + rows
    tl.store(m_ptr + out, m_i, mask=mask_m)
    tl.store(s_ptr + out, s_i, mask=mask_m)
    tl.store(a_ptr + out, a_i, mask=mask_m)
    tl.store(zt_ptr + out, zt, mask=mask_m)


@triton.jit
def _dlogits_kernel(h_ptr, w_ptr, tgt_ptr, rows_ptr, n_active_ptr,
                    lse_ptr, spz_ptr, glp_ptr, gent_ptr, dx_ptr,  # [N] x4 float32, dx [C, V]
                    row_start, chunk_rows, V, Hdim, stride_h, stride_w, stride_dx, inv_temp,
                    HAS_ENT: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_v = tl.program_id(1)
    row_end = tl.minimum(row_start + chunk_rows, tl.load(n_active_ptr))
    if row_start + pid_m * BLOCK_M >= row_end:
        return
    offs_c = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # position inside the chunk
    mask_m = row_start + offs_c < row_end
    rows = _row_ids(rows_ptr, row_start + offs_c, mask_m, True)
    offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    mask_v = offs_v < V
    z = _logits_tile(h_ptr, w_ptr, rows, mask_m, offs_v, mask_v, Hdim, stride_h, stride_w, inv_temp,
                     BLOCK_M, BLOCK_V, BLOCK_K, UPCAST, PRECISION)
    lse = tl.load(lse_ptr + rows, mask=mask_m, other=0.0)
    g = tl.load(glp_ptr + rows, mask=mask_m, other=0.0)
    tgt = tl.load(tgt_ptr + rows, mask=mask_m, other=-1).to(tl.int32)
    p = tl.where(mask_v[None, :], tl.exp(z - lse[:, None]), 0.0)  # [BM, BV]
    dz = tl.where(offs_v[None, :] == tgt[:, None], g[:, None], 0.0) - g[:, None] * p
    if HAS_ENT:
        spz = tl.load(spz_ptr + rows, mask=mask_m, other=0.0)
        ge = tl.load(gent_ptr + rows, mask=mask_m, other=0.0)
        dz -= ge[:, None] * p * (z - spz[:, None])
    dx = dz * inv_temp
    ptrs = dx_ptr + offs_c[:, None].to(tl.int64) * stride_dx + offs_v[None, :]
    tl.store(ptrs, dx.to(dx_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_v[None, :])


@triton.jit
def _dhidden_kernel(dx_ptr, w_ptr, rows_ptr, n_active_ptr, dh_ptr,
                    row_start, chunk_rows, V, Hdim, stride_dx, stride_w, stride_dh,
                    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_h = tl.program_id(1)
    row_end = tl.minimum(row_start + chunk_rows, tl.load(n_active_ptr))
    if row_start + pid_m * BLOCK_M >= row_end:
        return
    offs_c = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = row_start + offs_c < row_end
    offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_h < Hdim
    offs_k = tl.arange(0, BLOCK_K)
    dx_ptrs = dx_ptr + offs_c[:, None].to(tl.int64) * stride_dx + offs_k[None, :]  # [BM, BK]
    w_ptrs = w_ptr + offs_k[:, None].to(tl.int64) * stride_w + offs_h[None, :]  # [BK, BH]
    acc = tl.zeros((BLOCK_M, BLOCK_H), dtype=tl.float32)
    for k in range(0, V, BLOCK_K):
        k_ok = offs_k < V - k
        a = tl.load(dx_ptrs, mask=mask_m[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_ptrs, mask=k_ok[:, None] & mask_h[None, :], other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        dx_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * stride_w
    rows = _row_ids(rows_ptr, row_start + offs_c, mask_m, True)
    ptrs = dh_ptr + rows[:, None] * stride_dh + offs_h[None, :]
    tl.store(ptrs, acc.to(dh_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_h[None, :])


@triton.jit
def _dweight_kernel(dx_ptr, h_ptr, rows_ptr, n_active_ptr, dw_ptr,
                    row_start, chunk_rows, V, Hdim, stride_dx, stride_h, stride_dw,
                    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                    BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_v = tl.program_id(0)
    pid_h = tl.program_id(1)
    n_chunk = tl.minimum(row_start + chunk_rows, tl.load(n_active_ptr)) - row_start
    if n_chunk <= 0:
        return
    offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    mask_v = offs_v < V
    offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_h < Hdim
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_V, BLOCK_H), dtype=tl.float32)
    for k in range(0, n_chunk, BLOCK_K):
        c = k + offs_k  # [BK] positions inside the chunk
        c_ok = c < n_chunk
        a = tl.load(dx_ptr + c[None, :].to(tl.int64) * stride_dx + offs_v[:, None],
                    mask=c_ok[None, :] & mask_v[:, None], other=0.0)  # [BV, BK] = dx[c, v].T
        rows = _row_ids(rows_ptr, row_start + c, c_ok, True)
        b = tl.load(h_ptr + rows[:, None] * stride_h + offs_h[None, :],
                    mask=c_ok[:, None] & mask_h[None, :], other=0.0)  # [BK, BH]
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    ptrs = dw_ptr + offs_v[:, None].to(tl.int64) * stride_dw + offs_h[None, :]
    mask = mask_v[:, None] & mask_h[None, :]
    tl.store(ptrs, tl.load(ptrs, mask=mask, other=0.0) + acc, mask=mask)


# --------------------------------------------------------------------------------------------- launchers


def _blocks(dtype: torch.dtype, blocks: dict | None) -> dict:
    if blocks is not None:
        return blocks
    if INTERPRET:
        return INTERPRET_BLOCKS
    return GPU_BLOCKS_FP32 if dtype == torch.float32 else GPU_BLOCKS


def _precision(dtype: torch.dtype) -> str:
    # float32 inputs follow torch's matmul setting (IEEE by default); 16-bit inputs ignore this.
    if dtype == torch.float32 and not INTERPRET and torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    return "ieee"


def _compact(selected: torch.Tensor | None, n: int, device):
    """Selected rows first (stable order) and their count, both on the device: no host sync."""
    if selected is None:
        return None, torch.full((1,), n, dtype=torch.int32, device=device)
    order = torch.argsort((~selected).to(torch.int8), stable=True).to(torch.int32)  # [N]
    return order, selected.sum(dtype=torch.int32).reshape(1)


def _launch_kw(cfg: dict, *names: str) -> dict:
    kw = {k: cfg[k] for k in names}
    kw.update(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return kw


def _num_programs_target(device) -> int:
    if device.type == "cuda":
        return 2 * torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def forward(hidden, weight, targets, *, active, inv_temp, with_entropy, chunk_size, blocks=None):
    """Returns ``(logp, entropy, lse, sum_pz)``, each ``[N]`` float32; rows outside ``active`` are 0.

    The entropy comes free with the online log-sum-exp, so ``with_entropy`` is ignored; ``chunk_size`` only
    concerns backward.
    """
    del with_entropy, chunk_size
    hidden, weight = hidden.contiguous(), weight.contiguous()
    n, h_dim = hidden.shape
    vocab = weight.shape[0]
    cfg = _blocks(hidden.dtype, blocks)
    rows, n_active = _compact(active, n, hidden.device)

    n_tiles = triton.cdiv(vocab, cfg["BLOCK_V"])
    row_blocks = triton.cdiv(n, cfg["BLOCK_M"])
    splits = min(n_tiles, max(1, triton.cdiv(_num_programs_target(hidden.device), row_blocks)))
    tiles_per_split = triton.cdiv(n_tiles, splits)
    splits = triton.cdiv(n_tiles, tiles_per_split)  # every split starts on a valid tile

    f32 = dict(dtype=torch.float32, device=hidden.device)
    m_part = torch.zeros((splits, n), **f32)  # [S, N]
    s_part = torch.ones((splits, n), **f32)  # rows never written stay finite
    a_part = torch.zeros((splits, n), **f32)
    zt_part = torch.zeros((splits, n), **f32)
    _fwd_kernel[(row_blocks, splits)](
        hidden, weight, targets, rows if rows is not None else targets, n_active,
        m_part, s_part, a_part, zt_part,
        n, vocab, h_dim, hidden.stride(0), weight.stride(0), inv_temp, tiles_per_split,
        HAS_ROWS=rows is not None, UPCAST=INTERPRET, PRECISION=_precision(hidden.dtype),
        **_launch_kw(cfg, "BLOCK_M", "BLOCK_V", "BLOCK_K"),
    )
    m_max = m_part.max(0).values  # [N]
    scale = torch.exp(m_part - m_max)  # [S, N]
    s = (s_part * scale).sum(0)
    lse = m_max + torch.log(s)  # [N]
    sum_pz = (a_part * scale).sum(0) / s
    logp = zt_part.sum(0) - lse
    entropy = lse - sum_pz
    outs = (logp, entropy, lse, sum_pz)
    if active is not None:
        outs = tuple(torch.where(active, x, 0.0) for x in outs)
    return outs


def backward(hidden, weight, targets, lse, sum_pz, g_logp, g_entropy, *, inv_temp, chunk_size, blocks=None):
    """Gradients w.r.t. ``hidden`` and ``weight``; see the module docstring for the maths and the chunking."""
    hidden, weight = hidden.contiguous(), weight.contiguous()
    n, h_dim = hidden.shape
    vocab = weight.shape[0]
    cfg = _blocks(hidden.dtype, blocks)
    g_logp = g_logp.float().contiguous()
    nonzero = g_logp != 0
    if g_entropy is not None:
        g_entropy = g_entropy.float().contiguous()
        nonzero |= g_entropy != 0
    rows, n_active = _compact(nonzero, n, hidden.device)

    bm = cfg["BLOCK_M"]
    if chunk_size is None:
        chunk_size = _DX_BUDGET_BYTES // (vocab * hidden.element_size())
    chunk = max(bm, min(chunk_size, triton.cdiv(n, bm) * bm) // bm * bm)  # multiple of BLOCK_M
    dx = torch.empty((chunk, vocab), dtype=hidden.dtype, device=hidden.device)  # [C, V]
    grad_hidden = torch.zeros_like(hidden)  # [N, H]; unselected rows stay 0
    grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)  # [V, H]
    common = dict(UPCAST=INTERPRET, PRECISION=_precision(hidden.dtype))
    for start in range(0, n, chunk):
        _dlogits_kernel[(chunk // bm, triton.cdiv(vocab, cfg["BLOCK_V"]))](
            hidden, weight, targets, rows, n_active,
            lse, sum_pz, g_logp, g_entropy if g_entropy is not None else g_logp, dx,
            start, chunk, vocab, h_dim, hidden.stride(0), weight.stride(0), dx.stride(0), inv_temp,
            HAS_ENT=g_entropy is not None, **common, **_launch_kw(cfg, "BLOCK_M", "BLOCK_V", "BLOCK_K"),
        )
        _dhidden_kernel[(chunk // bm, triton.cdiv(h_dim, cfg["BLOCK_H"]))](
            dx, weight, rows, n_active, grad_hidden,
            start, chunk, vocab, h_dim, dx.stride(0), weight.stride(0), grad_hidden.stride(0),
            **common, **_launch_kw(cfg, "BLOCK_M", "BLOCK_H", "BLOCK_K"),
        )
        _dweight_kernel[(triton.cdiv(vocab, cfg["BLOCK_V"]), triton.cdiv(h_dim, cfg["BLOCK_H"]))](
            dx, hidden, rows, n_active, grad_weight,
            start, chunk, vocab, h_dim, dx.stride(0), hidden.stride(0), grad_weight.stride(0),
            **common, **_launch_kw(cfg, "BLOCK_V", "BLOCK_H", "BLOCK_K"),
        )
    return grad_hidden, grad_weight.to(weight.dtype)
