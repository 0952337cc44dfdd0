"""Leaner saved activations for a decoder's RMSNorms and SwiGLU MLPs during packed passes.

Autograd keeps what each op needs for backward, and for the pointwise tail of a decoder block that is far more than
the block's inputs. Per token and layer of a Llama / Qwen2 block, an RMSNorm keeps its float32 input and its
normalised output (besides the output the next linear layer keeps), and the MLP ``down(silu(gate(x)) * up(x))``
keeps ``gate(x)`` for the SiLU, ``silu(gate(x))`` and ``up(x)`` for the product, and the product for ``down``: four
``[tokens, intermediate]`` tensors. Two autograd functions keep only their inputs and recompute the pointwise rest
in backward, where it costs a few elementwise passes against the block's matmuls:

- :class:`RMSNormFunction`: keeps ``x`` and ``1 / rms(x)`` (one float per token), not the normalised ``x``;
- :class:`SwiGLUFunction`: keeps ``gate(x)`` and ``up(x)``; with the down projection inside it (a plain
  ``nn.Linear``) it recomputes the product in backward instead of keeping it. A down projection with adapters (LoRA)
  stays a module of its own, and only the product is fused.

On SmolLM2-135M (30 blocks, hidden 576, intermediate 1536) that is 16.5 KB less per token and layer, a third of the
~50 KB autograd keeps: 0.37 GB on a 746-token micro-batch (``benchmarks/RESULTS.md``, "Host memory").

Forwards are bitwise those of the modules they stand in for: the same ops in the same order and dtypes
(autocast included: the functions run their products in the autocast dtype, as the modules' would). Backwards
are the analytic gradients, equal to autograd's to float rounding. Which modules qualify is not read from class
names alone: :func:`lean_forwards` takes a module whose structure matches (an ``*RMSNorm`` with ``weight`` and
``variance_epsilon`` / ``eps``; an MLP with ``gate_proj``, ``up_proj``, ``down_proj`` and a SiLU ``act_fn``) and
keeps it only if the lean forward reproduces the module's own output exactly on a probe input (Gemma's ``1 +
weight`` norm, a GELU MLP or an MLP with extra terms fail the probe and keep their forward).

:class:`fastgrpo.distributed.runner.ModelRunner` installs the forwards for the duration of a packed pass only (as it
does the compiled block forwards), so decoding and exports run the modules' own. Not with compiled blocks
(inductor already recomputes pointwise ops instead of saving them) and not with activation checkpointing (which
keeps no activations, and whose recompute must see the forward it checkpointed).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["RMSNormFunction", "SwiGLUFunction", "lean_forwards"]

log = logging.getLogger(__name__)


def _compute_dtype(x: torch.Tensor) -> torch.dtype | None:
    """The autocast dtype products on ``x``'s device run in, or None outside autocast."""
    kind = x.device.type
    if torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return None


def _sum_to(t: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """``t`` summed over its leading dimensions down to ``shape`` (a broadcast parameter's gradient)."""
    return t.reshape(-1, *shape).sum(0)


class RMSNormFunction(torch.autograd.Function):
    """``weight * (x32 * rsqrt(mean(x32^2) + eps)).to(x.dtype)`` with ``x32 = x.float()`` (Llama / Qwen2's RMSNorm,
    op for op); keeps ``x`` and the ``[..., 1]`` float32 reciprocal RMS for backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x32 = x.to(torch.float32)
        rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        normed = (x32 * rstd).to(x.dtype)
        ctx.save_for_backward(x, weight, rstd)
        return weight * normed

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        n32 = x.to(torch.float32) * rstd
        grad_x = grad_w = None
        if ctx.needs_input_grad[1]:
            normed = n32.to(x.dtype)
            grad_w = _sum_to(grad_out * normed, weight.shape).to(weight.dtype)
        if ctx.needs_input_grad[0]:
            # the gradient reaching the normalised x, rounded to its dtype as autograd's cast would
            g_n = (grad_out * weight).to(x.dtype).to(torch.float32)
            dot = (g_n * n32).mean(-1, keepdim=True)
            grad_x = torch.addcmul(g_n, n32, dot, value=-1).mul_(rstd).to(x.dtype)
        return grad_x, grad_w, None


class SwiGLUFunction(torch.autograd.Function):
    """``silu(gate) * up``, then ``F.linear(., down_weight, down_bias)`` when a down weight is given; keeps ``gate``
    and ``up`` (and the down weight) for backward and recomputes the rest there."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor, down_weight: torch.Tensor | None,
                down_bias: torch.Tensor | None) -> torch.Tensor:
        h = F.silu(gate) * up
        ctx.dtype = _compute_dtype(h)
        ctx.has_down = down_weight is not None
        if not ctx.has_down:
            ctx.save_for_backward(gate, up)
            return h
        w = down_weight if ctx.dtype is None else down_weight.to(ctx.dtype)  # what F.linear uses under autocast
        out = F.linear(h, down_weight, down_bias)
        ctx.save_for_backward(gate, up, w)
        ctx.weight_dtype, ctx.bias_dtype = down_weight.dtype, None if down_bias is None else down_bias.dtype
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        saved = ctx.saved_tensors
        gate, up = saved[0], saved[1]
        silu = F.silu(gate)
        grad_w = grad_b = None
        if ctx.has_down:
            w = saved[2]
            if ctx.dtype is not None:
                grad_out = grad_out.to(ctx.dtype)
            flat = grad_out.reshape(-1, grad_out.shape[-1])
            if ctx.needs_input_grad[2]:
                h = silu * up
                grad_w = flat.T.mm(h.reshape(-1, h.shape[-1])).to(ctx.weight_dtype)
            if ctx.needs_input_grad[3]:
                grad_b = flat.sum(0).to(ctx.bias_dtype)
            grad_h = grad_out.matmul(w)
        else:
            grad_h = grad_out
        grad_up = grad_h * silu if ctx.needs_input_grad[1] else None
        # silu'(gate) applied by aten's own SiLU backward kernel (one pass)
        grad_gate = torch.ops.aten.silu_backward(grad_h * up, gate) if ctx.needs_input_grad[0] else None
        return grad_gate, grad_up, grad_w, grad_b


def _norm_eps(module: nn.Module) -> float | None:
    for name in ("variance_epsilon", "eps"):
        eps = getattr(module, name, None)
        if isinstance(eps, float):
            return eps
    return None


def _lean_norm_forward(module: nn.Module) -> Callable | None:
    if not type(module).__name__.endswith("RMSNorm") or not isinstance(getattr(module, "weight", None), torch.Tensor):
        return None
    eps = _norm_eps(module)
    if eps is None or module.weight.dim() != 1:
        return None
    return lambda x: RMSNormFunction.apply(x, module.weight, eps)


def _is_silu(act: object) -> bool:
    return isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation" or act is F.silu


def _lean_mlp_forward(module: nn.Module) -> Callable | None:
    parts = [getattr(module, name, None) for name in ("gate_proj", "up_proj", "down_proj")]
    if not all(isinstance(p, nn.Module) for p in parts) or not _is_silu(getattr(module, "act_fn", None)):
        return None
    gate_proj, up_proj, down_proj = parts
    if type(down_proj) is nn.Linear:  # a plain layer: fused, the product recomputed in backward
        return lambda x: SwiGLUFunction.apply(gate_proj(x), up_proj(x), down_proj.weight, down_proj.bias)
    return lambda x: down_proj(SwiGLUFunction.apply(gate_proj(x), up_proj(x), None, None))


@torch.no_grad()
def _reproduces(module: nn.Module, forward: Callable, width: int) -> bool:
    """Whether ``forward`` returns exactly ``module``'s own output on a small probe input (3 tokens)."""
    p = next(module.parameters())
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(1, 3, width, generator=gen).to(device=p.device, dtype=p.dtype)
    try:
        expected, got = module(x), forward(x)
    except Exception:  # noqa: BLE001 - a module whose forward the lean one cannot stand in for
        return False
    return isinstance(expected, torch.Tensor) and got.dtype == expected.dtype and torch.equal(got, expected)


def lean_forwards(model: nn.Module) -> list[tuple[nn.Module, Callable]]:
    """``(module, forward)`` for every RMSNorm and SwiGLU MLP of ``model`` that a lean forward reproduces exactly
    (module doc); to be installed for packed passes only. Call before the parameters are sharded (the probes run
    the modules' own forwards)."""
    found: list[tuple[nn.Module, Callable]] = []
    counts = {"RMSNorm": 0, "MLP": 0}
    for module in model.modules():
        kind, forward = "RMSNorm", _lean_norm_forward(module)
        width = module.weight.shape[0] if forward is not None else 0
        if forward is None:
            kind, forward = "MLP", _lean_mlp_forward(module)
            width = getattr(module.gate_proj, "in_features", 0) if forward is not None else 0
        if forward is None or not width or not _reproduces(module, forward, width):
            continue
        found.append((module, forward))
        counts[kind] += 1
    if found:
        log.info("lean activations: %d RMSNorm and %d MLP modules keep only their inputs for backward",
                 counts["RMSNorm"], counts["MLP"])
    return found
