"""Triton backend of the fused linear -> log-prob op: kernels, then launchers on plain tensors.
(Past ~450 lines on purpose: each kernel's argument list and grid must match its launcher's, so both stay here.)

Shapes: N rows (tokens), H hidden, V vocabulary, S vocabulary splits, C rows per backward chunk.
Notation: ``x = hidden @ weight.T`` (raw logits), ``z = x / T`` (T = temperature), ``p = softmax(z)``.

Forward (``_fwd_kernel``): ``R x S`` programs (R = N / BLOCK_M row blocks, S vocabulary splits). Each owns BLOCK_M
rows and one contiguous range of vocabulary tiles; per tile it computes ``z`` with ``tl.dot`` over H and folds it
into an online log-sum-exp ``(m, s)``, ``a = sum exp(z - m) * z`` (for the entropy) and the target logit. The S
partials per row are merged in torch (``[S, N]`` vectors). Splitting the vocabulary keeps every SM busy when N is
small (N=1 still gets many programs).

Backward, in balanced row chunks of C rows (C * V elements of ``dx``, at most ``_schedule._DX_BUDGET_BYTES``, or
all rows when that needs no more memory than chunking; see ``backward_chunk``):
  ``_dlogits_kernel``  recomputes the logits tile and writes
                       ``dx = (g_logp * (onehot - p) - g_ent * p * (z - sum_pz)) / T`` into a ``[C, V]``
                       buffer (in the inputs' dtype, as cuBLAS-based chunked losses do);
  ``_dhidden_kernel``  grad_hidden[rows] = dx @ W              (K loop over V, optionally split: split-K)
  ``_dweight_kernel``  grad_weight += dx.T @ hidden[rows]      (K loop over the chunk's rows; the first chunk
                       writes, later ones add to a float32 ``[V, H]`` sum, the last writes the weight's dtype; one
                       chunk writes the gradient directly. No atomics: each program owns its tile)

Schedule (host side, ``_schedule.py``; benchmarks/roofline.py models it for an H100 / H200):
  * launch order: 1-D grids walked in groups (``_tile_ids``), so the programs resident at one time share their
    operands in L2: in forward and ``_dlogits_kernel`` a group's hidden row blocks (re-read for every vocabulary
    tile) fit half the L2; in ``_dweight_kernel`` H tiles are the fast axis, so each ``dx`` column tile is read
    from HBM once, not H / BLOCK_H times;
  * grid sizes from occupancy: programs per SM come from the compiled kernel's registers and shared memory
    (``programs_per_sm``), and the vocabulary splits (forward) and the K splits (``_dhidden_kernel``) are chosen
    so that the last wave is nearly full.

Why materialise ``dx`` per chunk rather than fuse all three products into one kernel? A fused kernel must
either hold a ``[BLOCK_M, H]`` grad_hidden accumulator (too large for registers at H=4096) or atomically add
into grad_hidden once per vocabulary tile (V / BLOCK_V ~ 1000 float32 atomics per element). The ``[C, V]``
round trip costs about 3 bytes of traffic per element against 2*H flops per element for each product: a few
per cent of the products' time on an H100 (estimate from bandwidth and peak flops, not measured here).

Zero rows cost nothing, without a host sync: rows are reordered on the device so the selected ones come first
(a stable argsort) and their count is passed as a device pointer; a program whose rows all lie past the count
returns at once, and ``_dweight_kernel``'s loop stops at the count (a chunk with no selected row still
writes in its first and last modes). Backward selects rows whose upstream
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

from ._schedule import (
    backward_chunk,
    fwd_splits,
    l2_group,
    l2_bytes,
    resident_programs,
    split_k,
)

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

# Realistic Hopper tiles (see benchmarks/check_hopper.py for registers / spills / wgmma at these sizes).
# Small tiles for the interpreter keep the tests fast and exercise the multi-tile and masking paths.
GPU_BLOCKS = dict(BLOCK_M=128, BLOCK_V=128, BLOCK_H=128, BLOCK_K=64, num_warps=8, num_stages=3)
GPU_BLOCKS_FP32 = dict(BLOCK_M=64, BLOCK_V=64, BLOCK_H=64, BLOCK_K=32, num_warps=4, num_stages=2)
INTERPRET_BLOCKS = dict(BLOCK_M=16, BLOCK_V=32, BLOCK_H=32, BLOCK_K=16, num_warps=4, num_stages=1)


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
def _logits_tile(h_ptr, w_ptr, b_ptr, rows, mask_m, offs_v, mask_v, Hdim, stride_h, stride_w, inv_temp,
                 BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
                 UPCAST: tl.constexpr, PRECISION: tl.constexpr, HAS_BIAS: tl.constexpr):
    # z[BLOCK_M, BLOCK_V] = (hidden[rows] @ weight[offs_v].T + bias[offs_v]) * inv_temp, float32 accumulation over H.
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
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_v, mask=mask_v, other=0.0).to(tl.float32)[None, :]
    return acc * inv_temp


@triton.jit
def _tile_ids(pid, num_a, num_b, group_a):
    # Grouped launch order: program ids run in order, so the ~SM-count programs resident at one time have
    # consecutive ids. Walking ``group_a`` tiles of axis a fastest, then axis b, makes them cover a
    # group_a x (resident / group_a) patch of tiles instead of one long row of axis a: data indexed by a (e.g. a
    # row block of hidden, re-read for every vocabulary tile) is then a small set that stays in L2, and data
    # indexed by b (a weight tile) is read from HBM once for group_a programs. Returns (pid_a, pid_b).
    per_group = group_a * num_b
    group = pid // per_group
    first = group * group_a
    size = tl.minimum(num_a - first, group_a)  # the last group may be short
    local = pid - group * per_group
    return first + local % size, local // size


@triton.jit
def _fwd_kernel(h_ptr, w_ptr, b_ptr, tgt_ptr, rows_ptr, n_active_ptr,
                m_ptr, s_ptr, a_ptr, zt_ptr,  # [S, N] float32 partials
                N, V, Hdim, stride_h, stride_w, inv_temp, tiles_per_split, num_m, splits, group_m,
                HAS_ROWS: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr):
    pid_m, pid_s = _tile_ids(tl.program_id(0), num_m, splits, group_m)
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
        z = _logits_tile(h_ptr, w_ptr, b_ptr, rows, mask_m, offs_v, mask_v, Hdim, stride_h, stride_w, inv_temp,
                         BLOCK_M, BLOCK_V, BLOCK_K, UPCAST, PRECISION, HAS_BIAS)
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
    if HAS_BIAS:
        zt += tl.load(b_ptr + tl.where(has_t, tgt, 0), mask=has_t, other=0.0).to(tl.float32)
    zt = zt * inv_temp
    out = pid_s * N + rows
    tl.store(m_ptr + out, m_i, mask=mask_m)
    tl.store(s_ptr + out, s_i, mask=mask_m)
    tl.store(a_ptr + out, a_i, mask=mask_m)
    tl.store(zt_ptr + out, zt, mask=mask_m)


@triton.jit
def _dlogits_kernel(h_ptr, w_ptr, b_ptr, tgt_ptr, rows_ptr, n_active_ptr,
                    lse_ptr, spz_ptr, glp_ptr, gent_ptr, dx_ptr,  # [N] x4 float32, dx [C, V]
                    row_start, chunk_rows, V, Hdim, stride_h, stride_w, stride_dx, inv_temp, num_m, num_v, group_m,
                    HAS_ENT: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr):
    pid_m, pid_v = _tile_ids(tl.program_id(0), num_m, num_v, group_m)
    row_end = tl.minimum(row_start + chunk_rows, tl.load(n_active_ptr))
    if row_start + pid_m * BLOCK_M >= row_end:
        return
    offs_c = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # position inside the chunk
    mask_m = row_start + offs_c < row_end
    rows = _row_ids(rows_ptr, row_start + offs_c, mask_m, True)
    offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    mask_v = offs_v < V
    z = _logits_tile(h_ptr, w_ptr, b_ptr, rows, mask_m, offs_v, mask_v, Hdim, stride_h, stride_w, inv_temp,
                     BLOCK_M, BLOCK_V, BLOCK_K, UPCAST, PRECISION, HAS_BIAS)
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
def _dhidden_kernel(dx_ptr, w_ptr, rows_ptr, n_active_ptr, dh_ptr, part_ptr,
                    row_start, chunk_rows, V, Hdim, stride_dx, stride_w, stride_dh, k_len, num_m, num_h, group_m,
                    SPLIT_K: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr):
    # Split-K: program pid_k covers vocabulary range [pid_k * k_len, (pid_k + 1) * k_len) and writes a float32
    # partial [C, H] slice of part_ptr ([S, C, H]); the launcher sums the S partials (in a fixed order, so the
    # result does not depend on scheduling, unlike atomics). Without it, the result goes to grad_hidden's rows.
    pid = tl.program_id(0)
    per_split = num_m * num_h
    pid_k = pid // per_split
    pid_m, pid_h = _tile_ids(pid - pid_k * per_split, num_m, num_h, group_m)
    row_end = tl.minimum(row_start + chunk_rows, tl.load(n_active_ptr))
    if row_start + pid_m * BLOCK_M >= row_end:
        return
    offs_c = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = row_start + offs_c < row_end
    offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_h < Hdim
    k_first = pid_k * k_len
    k_end = tl.minimum(V, k_first + k_len)
    offs_k = tl.arange(0, BLOCK_K)
    dx_ptrs = dx_ptr + offs_c[:, None].to(tl.int64) * stride_dx + (k_first + offs_k)[None, :]  # [BM, BK]
    w_ptrs = w_ptr + (k_first + offs_k)[:, None].to(tl.int64) * stride_w + offs_h[None, :]  # [BK, BH]
    acc = tl.zeros((BLOCK_M, BLOCK_H), dtype=tl.float32)
    for k in range(k_first, k_end, BLOCK_K):
        k_ok = offs_k < k_end - k
        a = tl.load(dx_ptrs, mask=mask_m[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_ptrs, mask=k_ok[:, None] & mask_h[None, :], other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        dx_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * stride_w
    mask = mask_m[:, None] & mask_h[None, :]
    if SPLIT_K:
        # A scalar base and 32-bit offsets (C * H < 2**31): a [BM, BH] tile of 64-bit offsets cost 34 registers.
        part = part_ptr + pid_k.to(tl.int64) * chunk_rows * Hdim
        tl.store(part + offs_c[:, None] * Hdim + offs_h[None, :], acc, mask=mask)
    else:
        rows = _row_ids(rows_ptr, row_start + offs_c, mask_m, True)
        ptrs = dh_ptr + rows[:, None] * stride_dh + offs_h[None, :]
        tl.store(ptrs, acc.to(dh_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _dweight_kernel(dx_ptr, h_ptr, rows_ptr, n_active_ptr, acc_ptr, out_ptr,
                    row_start, chunk_rows, V, Hdim, stride_dx, stride_h, stride_dw, mode, num_h, num_v, group_h,
                    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                    BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr):
    # out[tile] = dx.T @ hidden[rows] (mode 0), or acc[tile] + that (mode 1: out is acc, the float32 running
    # sum; mode 2: the last chunk, out is the gradient in its own dtype). So the first chunk only writes, the
    # last writes the final dtype, and a single chunk needs no float32 [V, H] buffer at all.
    # H tiles are the fast axis (group_h of them): the programs resident together read the same few dx column
    # tiles, once from HBM, and the chunk's hidden rows (C x H, sized by the launcher to fit L2).
    pid_h, pid_v = _tile_ids(tl.program_id(0), num_h, num_v, group_h)
    n_chunk = tl.minimum(row_start + chunk_rows, tl.load(n_active_ptr)) - row_start
    if (n_chunk <= 0) & (mode == 1):  # no selected rows: the running sum is already right
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
    offs = offs_v[:, None].to(tl.int64) * stride_dw + offs_h[None, :]
    mask = mask_v[:, None] & mask_h[None, :]
    if mode != 0:
        acc += tl.load(acc_ptr + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


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


def forward(hidden, weight, targets, *, active, inv_temp, with_entropy, chunk_size, blocks=None, bias=None):
    """Returns ``(logp, entropy, lse, sum_pz)``, each ``[N]`` float32; rows outside ``active`` are 0. ``bias``:
    ``[V]`` added to the logits, or None.

    The entropy comes free with the online log-sum-exp, so ``with_entropy`` is ignored; ``chunk_size`` only
    concerns backward. ``blocks`` overrides the tile sizes (and may pin ``SPLITS`` / ``GROUP``, for tests).
    """
    del with_entropy, chunk_size
    hidden, weight = hidden.contiguous(), weight.contiguous()
    n, h_dim = hidden.shape
    vocab = weight.shape[0]
    dev = hidden.device
    f32 = dict(dtype=torch.float32, device=dev)
    if n == 0:
        return tuple(torch.zeros(0, **f32) for _ in range(4))
    cfg = _blocks(hidden.dtype, blocks)
    rows, n_active = _compact(active, n, dev)
    row_blocks = triton.cdiv(n, cfg["BLOCK_M"])
    n_tiles = triton.cdiv(vocab, cfg["BLOCK_V"])

    kw = dict(HAS_ROWS=rows is not None, UPCAST=INTERPRET, PRECISION=_precision(hidden.dtype),
              HAS_BIAS=bias is not None, **_launch_kw(cfg, "BLOCK_M", "BLOCK_V", "BLOCK_K"))
    ones = torch.ones((1, n), **f32)
    b_arg = weight if bias is None else bias.contiguous()  # any pointer when there is no bias

    def args(splits, per, group, parts=(ones,) * 4):
        return (hidden, weight, b_arg, targets, rows if rows is not None else targets, n_active, *parts,
                n, vocab, h_dim, hidden.stride(0), weight.stride(0), inv_temp, per, row_blocks, splits, group)

    if "SPLITS" in cfg:
        splits = cfg["SPLITS"]
        per = triton.cdiv(n_tiles, splits)
        splits = triton.cdiv(n_tiles, per)
    else:
        slots = resident_programs(_fwd_kernel, args(2, 2, 2), kw, dev)
        splits, per = fwd_splits(n, vocab, cfg["BLOCK_M"], cfg["BLOCK_V"], slots)
    # Hidden row blocks are re-read for every vocabulary tile: a group's blocks must stay in L2.
    group = cfg.get("GROUP") or l2_group(cfg["BLOCK_M"] * h_dim * hidden.element_size(), row_blocks, l2_bytes(dev))

    m_part = torch.zeros((splits, n), **f32)  # [S, N]
    s_part = torch.ones((splits, n), **f32)  # rows never written stay finite
    a_part = torch.zeros((splits, n), **f32)
    zt_part = torch.zeros((splits, n), **f32)
    _fwd_kernel[(row_blocks * splits,)](*args(splits, per, group, (m_part, s_part, a_part, zt_part)), **kw)
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


def backward(hidden, weight, targets, lse, sum_pz, g_logp, g_entropy, *, inv_temp, chunk_size, blocks=None,
             need_grad_hidden=True, need_grad_weight=True, bias=None, grad_bias=None):
    """Gradients w.r.t. ``hidden`` and ``weight``; see the module docstring for the maths and the chunking.
    ``blocks`` overrides the tile sizes (and may pin ``SPLIT_K`` / ``GROUP``, for tests). ``bias``: ``[V]`` added
    to the logits, or None; ``grad_bias``: a float32 ``[V]`` buffer the bias's gradient (the column sums of ``dx``
    over the selected rows) is added into, or None.

    A gradient not needed is None and costs nothing: without ``need_grad_weight`` (a frozen lm_head)
    ``_dweight_kernel`` does not run and no ``[V, H]`` buffer is allocated; without ``need_grad_hidden``
    ``_dhidden_kernel`` does not run and neither ``grad_hidden`` nor the split-K partials are allocated."""
    hidden, weight = hidden.contiguous(), weight.contiguous()
    n, h_dim = hidden.shape
    vocab = weight.shape[0]
    dev = hidden.device
    grad_hidden = torch.zeros_like(hidden) if need_grad_hidden else None  # [N, H]; unselected rows stay 0
    if n == 0:
        return grad_hidden, torch.zeros_like(weight) if need_grad_weight else None
    cfg = _blocks(hidden.dtype, blocks)
    elt = hidden.element_size()
    g_logp = g_logp.float().contiguous()
    nonzero = g_logp != 0
    if g_entropy is not None:
        g_entropy = g_entropy.float().contiguous()
        nonzero |= g_entropy != 0
    rows, n_active = _compact(nonzero, n, dev)

    bm, bv, bh = cfg["BLOCK_M"], cfg["BLOCK_V"], cfg["BLOCK_H"]
    chunk = backward_chunk(n, vocab, h_dim, elt, bm, chunk_size)
    n_chunks = triton.cdiv(n, chunk)
    num_m, num_v, num_h = chunk // bm, triton.cdiv(vocab, bv), triton.cdiv(h_dim, bh)
    l2 = l2_bytes(dev)
    # [C, V]; zeroed for the bias gradient, which sums dx's columns: rows past the selected count are never written
    dx = (torch.empty if grad_bias is None else torch.zeros)((chunk, vocab), dtype=hidden.dtype, device=dev)
    b_arg = weight if bias is None else bias.contiguous()  # any pointer when there is no bias
    # grad_weight: written directly in its dtype when there is one chunk; else summed in a float32 buffer that
    # the last chunk reads and converts (see _dweight_kernel's modes).
    grad_weight = acc_w = None
    if need_grad_weight:
        grad_weight = torch.empty_like(weight)
        acc_w = grad_weight if n_chunks == 1 else torch.empty(weight.shape, dtype=torch.float32, device=dev)  # [V, H]
    common = dict(UPCAST=INTERPRET, PRECISION=_precision(hidden.dtype))
    group_m = cfg.get("GROUP") or l2_group(bm * h_dim * elt, num_m, l2)  # dlogits re-reads hidden row blocks
    group_h = cfg.get("GROUP") or l2_group(chunk * bh * elt, num_h, l2)  # dweight re-reads hidden column tiles
    group_dh = cfg.get("GROUP") or 8  # dhidden: dx row blocks and weight column tiles are both streamed over V

    dh_kw = dict(common, **_launch_kw(cfg, "BLOCK_M", "BLOCK_H", "BLOCK_K"))
    k_tiles = triton.cdiv(vocab, cfg["BLOCK_K"])

    def dh_args(start, k_len, s, part):
        return (dx, weight, rows, n_active, grad_hidden, part, start, chunk, vocab, h_dim, dx.stride(0),
                weight.stride(0), grad_hidden.stride(0), k_len, num_m, num_h, group_dh)

    n_split, k_len = 1, vocab  # no product 2 at all without need_grad_hidden
    if need_grad_hidden:
        if "SPLIT_K" in cfg:
            n_split = cfg["SPLIT_K"]
        else:  # the tail: programs = row blocks x H tiles is often just over a multiple of the resident count
            slots = resident_programs(_dhidden_kernel, dh_args(0, 2, 1, dx), dict(dh_kw, SPLIT_K=False), dev)
            n_split = split_k(num_m * num_h, k_tiles, slots)
        k_len = triton.cdiv(k_tiles, n_split) * cfg["BLOCK_K"]
        n_split = triton.cdiv(vocab, k_len)
    part = torch.empty((n_split, chunk, h_dim), dtype=torch.float32, device=dev) if n_split > 1 else dx  # [S, C, H]

    for i, start in enumerate(range(0, n, chunk)):
        _dlogits_kernel[(num_m * num_v,)](
            hidden, weight, b_arg, targets, rows, n_active,
            lse, sum_pz, g_logp, g_entropy if g_entropy is not None else g_logp, dx,
            start, chunk, vocab, h_dim, hidden.stride(0), weight.stride(0), dx.stride(0), inv_temp,
            num_m, num_v, group_m,
            HAS_ENT=g_entropy is not None, HAS_BIAS=bias is not None, **common,
            **_launch_kw(cfg, "BLOCK_M", "BLOCK_V", "BLOCK_K"),
        )
        if grad_bias is not None:  # the chunk's selected rows: positions start .. n_active - 1 of the order
            valid = (torch.arange(chunk, device=dev) + start < n_active).to(dx.dtype)  # [C], no host sync
            grad_bias.add_(torch.mv(dx.T, valid).float())
        if need_grad_hidden:
            if n_split > 1:
                part.zero_()  # row blocks past the selected count return without writing
            _dhidden_kernel[(num_m * num_h * n_split,)](*dh_args(start, k_len, n_split, part), SPLIT_K=n_split > 1,
                                                        **dh_kw)
            if n_split > 1:
                c = min(chunk, n - start)
                grad_hidden.index_copy_(0, rows[start:start + c].long(), part[:, :c].sum(0).to(hidden.dtype))
        if not need_grad_weight:
            continue
        mode = 0 if i == 0 else (2 if i == n_chunks - 1 else 1)
        _dweight_kernel[(num_h * num_v,)](
            dx, hidden, rows, n_active, acc_w, grad_weight if mode == 2 else acc_w,
            start, chunk, vocab, h_dim, dx.stride(0), hidden.stride(0), acc_w.stride(0), mode, num_h, num_v, group_h,
            **common, **_launch_kw(cfg, "BLOCK_V", "BLOCK_H", "BLOCK_K"),
        )
    return grad_hidden, grad_weight
