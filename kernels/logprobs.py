"""Fused linear -> selective log-prob (+ entropy), without an ``[N, V]`` logits tensor.

Shapes: N rows (tokens), H hidden size, V vocabulary size.

    z = hidden @ weight.T / temperature                      # [N, V], never materialised whole
    logp[n]    = z[n, targets[n]] - logsumexp(z[n])          # [N] float32
    entropy[n] = logsumexp(z[n]) - sum_v softmax(z[n])_v z[n, v]

Backends (a registry, picked per call): ``"triton"`` (``_triton.py``, CUDA -- or the Triton CPU interpreter
under ``TRITON_INTERPRET=1``) and ``"torch"`` (``_chunked.py``, chunked plain torch, any device). Both expose
``forward(...) -> (logp, entropy, lse, sum_pz)`` and ``backward(...) -> (grad_hidden, grad_weight)``; this file
holds only the dispatch and the thin ``autograd.Function``.
"""

from __future__ import annotations

import torch

from . import _chunked

try:  # Triton is optional: without it every call takes the torch backend.
    from . import _triton
except ImportError:  # pragma: no cover - depends on the environment
    _triton = None

BACKENDS = {"torch": _chunked}
if _triton is not None:
    BACKENDS["triton"] = _triton

__all__ = ["linear_logprobs", "BACKENDS"]


def resolve_backend(backend: str, device: torch.device) -> str:
    """``"auto"`` -> Triton on CUDA tensors when Triton imports, else the chunked torch path."""
    if backend == "auto":
        return "triton" if device.type == "cuda" and "triton" in BACKENDS else "torch"
    if backend not in BACKENDS:
        raise ValueError(f"backend must be 'auto' or one of {sorted(BACKENDS)}, got {backend!r}")
    if backend == "triton" and device.type != "cuda" and not _triton.INTERPRET:
        raise ValueError("backend='triton' needs CUDA tensors (or TRITON_INTERPRET=1 set before import)")
    return backend


def check_inputs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float) -> None:
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden must be [N, H] and weight [V, H], got {tuple(hidden.shape)} and {tuple(weight.shape)}")
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"targets must be [N]={hidden.shape[0]}, got {tuple(targets.shape)}")
    if hidden.dtype != weight.dtype:
        raise ValueError(f"hidden and weight dtypes differ: {hidden.dtype} vs {weight.dtype}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")


class FusedLinearLogprobs(torch.autograd.Function):
    """Outputs ``(logp, entropy)``. ``active`` (bool ``[N]`` or None) limits the forward work to those rows;
    the others get 0. Backward recomputes the logits tile by tile and skips rows whose upstream gradients are
    both zero."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, active, temperature, with_entropy, backend, chunk_size):
        impl = BACKENDS[backend]
        inv_temp = 1.0 / temperature
        logp, entropy, lse, sum_pz = impl.forward(
            hidden, weight, targets, active=active, inv_temp=inv_temp, with_entropy=with_entropy,
            chunk_size=chunk_size,
        )
        ctx.save_for_backward(hidden, weight, targets, lse, sum_pz)
        ctx.impl, ctx.inv_temp, ctx.with_entropy, ctx.chunk_size = impl, inv_temp, with_entropy, chunk_size
        if not with_entropy:
            ctx.mark_non_differentiable(entropy)
        ctx.set_materialize_grads(False)  # an unused output's gradient arrives as None: skip its term
        return logp, entropy

    @staticmethod
    def backward(ctx, g_logp, g_entropy):
        hidden, weight, targets, lse, sum_pz = ctx.saved_tensors
        if g_logp is None:
            g_logp = torch.zeros_like(lse)
        if not ctx.with_entropy:
            g_entropy = None
        grad_hidden, grad_weight = ctx.impl.backward(
            hidden, weight, targets, lse, sum_pz, g_logp, g_entropy,
            inv_temp=ctx.inv_temp, chunk_size=ctx.chunk_size,
        )
        return grad_hidden, grad_weight, None, None, None, None, None, None


def fused_logprobs(hidden, weight, targets, *, active=None, temperature=1.0, with_entropy=False,
                   backend="auto", chunk_size=None):
    """Shared entry of both public ops: validates, dispatches, returns ``(logp, entropy)`` (entropy is zeros
    unless ``with_entropy``)."""
    check_inputs(hidden, weight, targets, temperature)
    name = resolve_backend(backend, hidden.device)
    return FusedLinearLogprobs.apply(hidden, weight, targets, active, float(temperature), bool(with_entropy),
                                     name, chunk_size)


def linear_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    return_entropy: bool = False,
    backend: str = "auto",
    chunk_size: int | None = None,
):
    """Log-probability of ``targets`` under ``softmax(hidden @ weight.T / temperature)``, without ``[N, V]``.

    Args:
        hidden: ``[N, H]`` (bf16, fp16 or fp32), e.g. the trunk's last hidden states of completion tokens.
        weight: ``[V, H]``, same dtype, e.g. ``lm_head.weight`` (tied embeddings work unchanged).
        targets: ``[N]`` token ids.
        temperature: logits are divided by it (the sampler's temperature).
        return_entropy: also return the softmax entropy per row (differentiable).
        backend: ``"auto"`` (Triton on CUDA, else chunked torch), ``"triton"``, ``"torch"``, or ``"cublas"``
            (no gradient: the numerics of ``linear_grpo_loss(backend="cublas")``, for its old / ref log-probs).
        chunk_size: rows per chunk (torch backend: forward and backward; Triton: backward ``dx`` buffer).

    Returns:
        ``logp [N]`` float32, or ``(logp, entropy)`` each ``[N]`` float32; differentiable w.r.t. hidden and weight.
    """
    if backend == "cublas":
        logp, entropy = _cublas_logprobs(hidden, weight, targets, temperature, chunk_size)
    else:
        logp, entropy = fused_logprobs(hidden, weight, targets, temperature=temperature,
                                       with_entropy=return_entropy, backend=backend, chunk_size=chunk_size)
    return (logp, entropy) if return_entropy else logp


def _cublas_logprobs(hidden, weight, targets, temperature, chunk_size):
    """Forward-only log-probs with the numerics of ``linear_grpo_loss(backend="cublas")`` (see ``_gradfwd``)."""
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        raise ValueError("linear_logprobs(backend='cublas') has no backward (that path forms the gradient of the "
                         "GRPO loss in forward): call it under torch.no_grad() for old / reference log-probs, or "
                         f"pick 'auto' or one of {sorted(BACKENDS)} for a differentiable result")
    check_inputs(hidden, weight, targets, temperature)
    return cublas_module(hidden.device).logprobs_pass(hidden, weight, targets, inv_temp=1.0 / float(temperature),
                                                      chunk_size=chunk_size)


def cublas_module(device: torch.device):
    """The ``"cublas"`` path's module (``_gradfwd``), after checking that it can run on ``device``."""
    try:
        from . import _gradfwd
    except ImportError:  # pragma: no cover - depends on the environment
        raise ValueError("backend='cublas' needs Triton (pip install triton) for its row kernels") from None
    if device.type != "cuda" and not _gradfwd.INTERPRET:
        raise ValueError("backend='cublas' needs CUDA tensors (or TRITON_INTERPRET=1 set before import)")
    return _gradfwd


def training_backend(device: torch.device) -> str:
    """The path ``linear_grpo_loss(backend="auto")`` takes on ``device`` when a gradient will be taken: the
    gradient-in-forward ``"cublas"`` path on CUDA (when Triton imports), else what ``"auto"`` resolves to."""
    if device.type == "cuda" and "triton" in BACKENDS:
        return "cublas"
    return resolve_backend("auto", device)
