"""Chunked plain-torch backend of the fused linear -> log-prob op (CPU, or CUDA with ``backend="torch"``).

Shapes: N rows (tokens), H hidden, V vocabulary, C rows per chunk.

Memory bound: never an ``[N, V]`` tensor. Rows are processed ``C`` at a time, so the extra memory is a few
``[C, V]`` float32 buffers plus ``[N]`` vectors, plus the float32 gradient buffers that autograd needs anyway
(``[N, H]`` and ``[V, H]``). ``C`` defaults to ``_CHUNK_ELEMS // V`` rows (16 MiB per float32 buffer).

Why recompute in backward instead of computing the gradients during forward (Liger's fused linear cross
entropy does the latter)?
  * ``linear_logprobs`` returns a vector: the upstream gradient of each row is unknown during forward, so there
    is nothing to pre-multiply. One code path serves both public ops.
  * Pre-computed gradients would keep an extra ``[V, H]`` and ``[N, H]`` float32 buffer alive from forward to
    backward (2.2 GB for Qwen2.5-7B's head), and be wasted in no-grad passes (old / ref log-probs).
  * Rows whose upstream gradient is exactly zero (token weight 0, or advantage 0 with beta 0 -- every token of a
    group with equal rewards) are skipped in backward, which pre-computation cannot know about.
The price is one extra ``[C, H] x [H, V]`` matmul per chunk (4 instead of 3 matmuls in all).

Row selection uses ``nonzero()``, a host sync; that is free on CPU, and this backend is only the fallback on
CUDA (the Triton backend selects rows on the device).

Everything is computed in float32 (bf16 inputs are upcast chunk by chunk; the weight once, which costs one
``[V, H]`` float32 copy, the size of the gradient buffer).
"""

from __future__ import annotations

import torch

_CHUNK_ELEMS = 1 << 22


def _chunk_rows(vocab: int, chunk_size: int | None) -> int:
    if chunk_size is not None:
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        return chunk_size
    return max(1, _CHUNK_ELEMS // vocab)


def _selected_rows(n: int, active: torch.Tensor | None, device) -> torch.Tensor:
    if active is None:
        return torch.arange(n, device=device)
    return active.nonzero().squeeze(1)  # [K], host sync (see module docstring)


def forward(hidden, weight, targets, *, active, inv_temp, with_entropy, chunk_size):
    """Returns ``(logp, entropy, lse, sum_pz)``, each ``[N]`` float32; rows outside ``active`` are 0.

    ``sum_pz[n] = sum_v softmax(z)[v] * z[v]`` with ``z = hidden @ weight.T * inv_temp``; the entropy is
    ``lse - sum_pz`` and backward needs ``sum_pz`` for the entropy gradient.
    """
    n = hidden.shape[0]
    w32 = weight.float()  # [V, H], no copy when already float32
    f32 = dict(dtype=torch.float32, device=hidden.device)
    logp, entropy, lse, sum_pz = (torch.zeros(n, **f32) for _ in range(4))  # [N] each
    rows = _selected_rows(n, active, hidden.device)
    for idx in rows.split(_chunk_rows(weight.shape[0], chunk_size)):  # idx: [C]
        z = (hidden[idx].float() @ w32.T).mul_(inv_temp)  # [C, V]
        lse_c = torch.logsumexp(z, dim=1)  # [C]
        lse[idx] = lse_c
        logp[idx] = z.gather(1, targets[idx, None].long()).squeeze(1) - lse_c
        if with_entropy:
            p = torch.exp(z - lse_c[:, None])  # [C, V]
            spz = (p * z).sum(1)  # [C]
            sum_pz[idx] = spz
            entropy[idx] = lse_c - spz
    return logp, entropy, lse, sum_pz


def backward(hidden, weight, targets, lse, sum_pz, g_logp, g_entropy, *, inv_temp, chunk_size):
    """Gradients w.r.t. ``hidden`` and ``weight`` given the upstream gradients of logp (and entropy).

    With ``z = x * inv_temp``, ``x = hidden @ weight.T`` and ``p = softmax(z)``:
      d logp / dz_v    = onehot_v - p_v
      d entropy / dz_v = -p_v * (z_v - sum_pz)
      dX = inv_temp * (g_logp * (onehot - p) - g_entropy * p * (z - sum_pz))       # [N, V], chunk by chunk
      grad_hidden = dX @ weight;  grad_weight = dX.T @ hidden
    """
    n, vocab = hidden.shape[0], weight.shape[0]
    w32 = weight.float()  # [V, H]
    g = g_logp.float()  # [N]
    nonzero = g != 0
    if g_entropy is not None:
        g_entropy = g_entropy.float()
        nonzero |= g_entropy != 0
    grad_hidden = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)  # [N, H]
    grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)  # [V, H]
    rows = _selected_rows(n, nonzero, hidden.device)
    for idx in rows.split(_chunk_rows(vocab, chunk_size)):  # idx: [C]
        h = hidden[idx].float()  # [C, H]
        z = (h @ w32.T).mul_(inv_temp)  # [C, V]
        p = torch.exp(z - lse[idx, None])  # [C, V]
        if g_entropy is not None:
            # reuse z's buffer: z <- -g_ent * p * (z - sum_pz)
            dx = z.sub_(sum_pz[idx, None]).mul_(p).mul_(-g_entropy[idx, None])
            dx.sub_(p.mul_(g[idx, None]))
        else:
            dx = p.mul_(-g[idx, None])
        dx.scatter_add_(1, targets[idx, None].long(), g[idx, None])
        dx.mul_(inv_temp)  # [C, V]
        grad_hidden[idx] = dx @ w32
        grad_weight.addmm_(dx.T, h)
    return grad_hidden.to(hidden.dtype), grad_weight.to(weight.dtype)
