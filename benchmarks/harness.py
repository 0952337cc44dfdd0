"""Shared input construction and timing for the kernel benchmarks and tests (so baselines cannot drift).

Shapes: N tokens, H hidden size, V vocabulary size.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch


@dataclass(frozen=True, kw_only=True)
class Shape:
    """One benchmark / test case."""

    n: int
    """tokens (rows of hidden)"""
    h: int
    """hidden size"""
    v: int
    """vocabulary size"""
    label: str = ""
    """free-form tag for tables (e.g. "liger B=4")"""


def make_inputs(shape: Shape, *, dtype=torch.bfloat16, device="cpu", seed=0, logit_scale=2.0,
                zero_weight_frac=0.0, requires_grad=True) -> dict:
    """Random lm_head inputs. Logits ``hidden @ weight.T`` have standard deviation ``logit_scale`` (about
    what a trained head gives: a few dominant tokens, a long tail).

    Returns a dict with ``hidden [N, H]``, ``weight [V, H]`` (leaf tensors, ``requires_grad``), ``targets [N]``,
    ``advantages [N]`` float32 and ``token_weights [N]`` float32 (DAPO-style ``1/N``; a ``zero_weight_frac``
    fraction of them set to 0 at random).
    """
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def randn(*size, scale=1.0):
        return (torch.randn(*size, generator=gen) * scale).to(device=device, dtype=dtype)

    hidden = randn(shape.n, shape.h).requires_grad_(requires_grad)
    weight = randn(shape.v, shape.h, scale=logit_scale / shape.h**0.5).requires_grad_(requires_grad)
    targets = torch.randint(0, shape.v, (shape.n,), generator=gen).to(device)
    advantages = torch.randn(shape.n, generator=gen).to(device)
    token_weights = torch.full((shape.n,), 1.0 / shape.n)
    if zero_weight_frac > 0:
        token_weights[torch.rand(shape.n, generator=gen) < zero_weight_frac] = 0.0
    return dict(hidden=hidden, weight=weight, targets=targets, advantages=advantages,
                token_weights=token_weights.to(device))


def perturbed(logprobs: torch.Tensor, *, std: float, seed: int = 1) -> torch.Tensor:
    """``logprobs`` plus Gaussian noise (detached): stands in for old / ref log-probs so ratios spread
    around 1 and both clip branches are exercised."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    noise = torch.randn(logprobs.shape, generator=gen).to(logprobs.device)
    return (logprobs.detach().float() + std * noise).clamp(max=0.0)


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``||actual - expected|| / ||expected||`` in float64 (0 when both are 0)."""
    a, e = actual.detach().double(), expected.detach().double()
    denom = e.norm().item()
    diff = (a - e).norm().item()
    return diff if denom == 0 else diff / denom


def time_fwd_bwd(fn, *, warmup: int = 2, reps: int = 5) -> tuple[float, float]:
    """Median milliseconds of ``fn()`` (which runs forward and backward) and the peak extra memory in MB
    (CUDA: ``max_memory_allocated`` above the level before the first call; CPU: NaN, not measured)."""
    cuda = torch.cuda.is_available()
    for _ in range(warmup):
        fn()
    if cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(reps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20 if cuda else float("nan")
    times.sort()
    return times[len(times) // 2], peak
