"""Fused linear -> selective log-prob (+ entropy), without an ``[N, V]`` logits tensor.

Shapes: N rows (tokens), H hidden size, V vocabulary size.

    z = (hidden @ weight.T + bias) / temperature             # [N, V], never materialised whole (bias optional)
    logp[n]    = z[n, targets[n]] - logsumexp(z[n])          # [N] float32
    entropy[n] = logsumexp(z[n]) - sum_v softmax(z[n])_v z[n, v]

Backends (picked per call by ``backends.resolve_backend``): ``"triton"`` (``_triton.py``) and ``"torch"``
(``_chunked.py``) both expose ``forward(...) -> (logp, entropy, lse, sum_pz)`` and ``backward(...) -> (grad_hidden,
grad_weight)``, None for a gradient autograd does not need (a frozen lm_head, e.g. under LoRA: no ``[V, H]`` buffer
and no weight product; a frozen trunk: no hidden product), and add the bias's gradient into a ``grad_bias`` buffer
when given one; ``"cublas"`` (``_gradfwd.py``) runs here forward-only.
This file holds the thin ``autograd.Function`` and the public op.
"""

from __future__ import annotations

import torch

from ._targets import check_targets
from .backends import cublas_module, recompute_module, resolve_backend

__all__ = ["linear_logprobs"]


def check_inputs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float,
                 bias: torch.Tensor | None = None) -> None:
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden must be [N, H] and weight [V, H], got {tuple(hidden.shape)} and {tuple(weight.shape)}")
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"targets must be [N]={hidden.shape[0]}, got {tuple(targets.shape)}")
    if hidden.dtype != weight.dtype:
        raise ValueError(f"hidden and weight dtypes differ: {hidden.dtype} vs {weight.dtype}")
    if bias is not None and (bias.shape != weight.shape[:1] or bias.dtype != weight.dtype):
        raise ValueError(f"bias must be [V]={weight.shape[0]} in the weight's dtype {weight.dtype}, got "
                         f"{tuple(bias.shape)} {bias.dtype}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    check_targets(targets, weight.shape[0])  # every backend: ids outside [0, V) (see _targets.py)


class FusedLinearLogprobs(torch.autograd.Function):
    """Outputs ``(logp, entropy)``. ``active`` (bool ``[N]`` or None) limits the forward work to those rows;
    the others get 0. Backward recomputes the logits tile by tile and skips rows whose upstream gradients are
    both zero. ``bias`` (``[V]`` or None) is added to the logits and differentiated like the weight."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, active, temperature, with_entropy, backend, chunk_size, bias):
        impl = recompute_module(backend)
        inv_temp = 1.0 / temperature
        logp, entropy, lse, sum_pz = impl.forward(
            hidden, weight, targets, active=active, inv_temp=inv_temp, with_entropy=with_entropy,
            chunk_size=chunk_size, bias=bias,
        )
        ctx.save_for_backward(hidden, weight, targets, lse, sum_pz, bias)
        ctx.impl, ctx.inv_temp, ctx.with_entropy, ctx.chunk_size = impl, inv_temp, with_entropy, chunk_size
        if not with_entropy:
            ctx.mark_non_differentiable(entropy)
        ctx.set_materialize_grads(False)  # an unused output's gradient arrives as None: skip its term
        return logp, entropy

    @staticmethod
    def backward(ctx, g_logp, g_entropy):
        hidden, weight, targets, lse, sum_pz, bias = ctx.saved_tensors
        if g_logp is None:
            g_logp = torch.zeros_like(lse)
        if not ctx.with_entropy:
            g_entropy = None
        # float32 [V], summed into by the backward pass
        grad_bias = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) \
            if ctx.needs_input_grad[8] else None
        grad_hidden, grad_weight = ctx.impl.backward(
            hidden, weight, targets, lse, sum_pz, g_logp, g_entropy,
            inv_temp=ctx.inv_temp, chunk_size=ctx.chunk_size,
            need_grad_hidden=ctx.needs_input_grad[0], need_grad_weight=ctx.needs_input_grad[1],
            bias=bias, grad_bias=grad_bias,
        )
        if grad_bias is not None:
            grad_bias = grad_bias.to(bias.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None, None, grad_bias


def fused_logprobs(hidden, weight, targets, *, active=None, temperature=1.0, with_entropy=False,
                   backend="auto", chunk_size=None, bias=None):
    """Shared entry of both public ops: validates, dispatches, returns ``(logp, entropy)`` (entropy is zeros
    unless ``with_entropy``)."""
    check_inputs(hidden, weight, targets, temperature, bias)
    # needs_grad=False: "auto" never picks the gradient-in-forward path, which this function has no backward for.
    name = resolve_backend(backend, hidden.device, needs_grad=False)
    return FusedLinearLogprobs.apply(hidden, weight, targets, active, float(temperature), bool(with_entropy),
                                     name, chunk_size, bias)


def linear_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    return_entropy: bool = False,
    backend: str = "auto",
    chunk_size: int | None = None,
    bias: torch.Tensor | None = None,
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
        bias: ``[V]`` lm_head bias, the weight's dtype (logits ``= hidden @ weight.T + bias``); differentiable.

    Returns:
        ``logp [N]`` float32, or ``(logp, entropy)`` each ``[N]`` float32; differentiable w.r.t. hidden and weight.
    """
    if backend == "cublas":
        logp, entropy = _cublas_logprobs(hidden, weight, targets, temperature, chunk_size, bias)
    else:
        logp, entropy = fused_logprobs(hidden, weight, targets, temperature=temperature,
                                       with_entropy=return_entropy, backend=backend, chunk_size=chunk_size,
                                       bias=bias)
    return (logp, entropy) if return_entropy else logp


def _cublas_logprobs(hidden, weight, targets, temperature, chunk_size, bias):
    """Forward-only log-probs with the numerics of ``linear_grpo_loss(backend="cublas")`` (see ``_gradfwd``)."""
    if torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (hidden, weight, bias)):
        raise ValueError("linear_logprobs(backend='cublas') has no backward (that path forms the gradient of the "
                         "GRPO loss in forward): call it under torch.no_grad() for old / reference log-probs, or "
                         "pick 'auto', 'triton' or 'torch' for a differentiable result")
    check_inputs(hidden, weight, targets, temperature, bias)
    return cublas_module(hidden.device).logprobs_pass(hidden, weight, targets, inv_temp=1.0 / float(temperature),
                                                      chunk_size=chunk_size, bias=bias)
