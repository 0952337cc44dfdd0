"""Comparison helpers shared by the in-process tests and the Triton-interpreter subprocess.

Each helper runs a fused op on fresh random inputs (benchmarks.harness builds them, as in the benchmark) and
returns relative errors against the float64 reference evaluated on the same inputs.
"""

from __future__ import annotations

import torch

from benchmarks.harness import Shape, make_inputs, perturbed, rel_err
from fastgrpo.kernels import (
    linear_grpo_loss,
    linear_logprobs,
    reference_linear_grpo_loss,
    reference_linear_logprobs,
)


def _f64_leaves(*tensors):
    return [x.detach().double().requires_grad_() for x in tensors]


def logprobs_errors(shape: Shape, *, dtype, backend, temperature=1.0, entropy=False, chunk_size=None, seed=0):
    inp = make_inputs(shape, dtype=dtype, seed=seed)
    hidden, weight, targets = inp["hidden"], inp["weight"], inp["targets"]
    out = linear_logprobs(hidden, weight, targets, temperature=temperature, return_entropy=entropy,
                          backend=backend, chunk_size=chunk_size)
    h64, w64 = _f64_leaves(hidden, weight)
    ref = reference_linear_logprobs(h64, w64, targets, temperature=temperature, return_entropy=entropy)
    outs, refs = (out, ref) if entropy else ((out,), (ref,))
    assert all(o.dtype == torch.float32 and o.shape == (shape.n,) for o in outs)
    gen = torch.Generator().manual_seed(seed + 100)
    upstream = [torch.randn(shape.n, generator=gen) for _ in outs]  # fresh upstream gradients
    grads = torch.autograd.grad(sum((o * g).sum() for o, g in zip(outs, upstream)), (hidden, weight))
    grads_ref = torch.autograd.grad(sum((r * g.double()).sum() for r, g in zip(refs, upstream)), (h64, w64))
    errs = {"logp": rel_err(outs[0], refs[0]), "grad_hidden": rel_err(grads[0], grads_ref[0]),
            "grad_weight": rel_err(grads[1], grads_ref[1])}
    if entropy:
        errs["entropy"] = rel_err(outs[1], refs[1])
    assert grads[0].dtype == hidden.dtype and grads[1].dtype == weight.dtype
    return errs


def grpo_errors(shape: Shape, *, dtype, backend, old=True, beta=0.0, delta=None, temperature=1.0,
                zero_weight_frac=0.25, entropy=False, chunk_size=None, seed=0, epsilon_high=0.2, sequences=None):
    """``sequences=K``: sequence-level importance sampling (GSPO) with rows drawn into K sequences."""
    inp = make_inputs(shape, dtype=dtype, seed=seed, zero_weight_frac=zero_weight_frac)
    hidden, weight, targets = inp["hidden"], inp["weight"], inp["targets"]
    adv, tw = inp["advantages"], inp["token_weights"]
    h64, w64 = _f64_leaves(hidden, weight)
    logp_exact = reference_linear_logprobs(h64, w64, targets, temperature=temperature).detach()
    kw = dict(
        old_logprobs=perturbed(logp_exact, std=0.3, seed=seed + 1) if old else None,
        ref_logprobs=perturbed(logp_exact, std=0.2, seed=seed + 2) if beta else None,
        delta=delta, beta=beta, temperature=temperature, epsilon_high=epsilon_high,
    )
    if sequences is not None:
        gen = torch.Generator().manual_seed(seed + 3)
        kw["sequence_index"] = torch.randint(0, sequences, (shape.n,), generator=gen).to(hidden.device)
    loss, stats = linear_grpo_loss(hidden, weight, targets, adv, tw, return_entropy=entropy, backend=backend,
                                   chunk_size=chunk_size, **kw)
    loss_ref, stats_ref = reference_linear_grpo_loss(h64, w64, targets, adv.double(), tw.double(),
                                                     return_entropy=entropy, **kw)
    grads = torch.autograd.grad(loss, (hidden, weight))
    grads_ref = torch.autograd.grad(loss_ref, (h64, w64))
    counted = tw != 0
    errs = {
        "loss": rel_err(loss, loss_ref),
        "grad_hidden": rel_err(grads[0], grads_ref[0]),
        "grad_weight": rel_err(grads[1], grads_ref[1]),
        "logprobs": rel_err(stats["logprobs"][counted], stats_ref["logprobs"][counted]),
        "skipped_logprobs_zero": float(stats["logprobs"][~counted].abs().max()) if (~counted).any() else 0.0,
    }
    for key in ("clip_low_frac", "clip_high_frac", "kl_mean"):
        errs[key] = abs(stats[key].item() - stats_ref[key].item())
    if entropy:
        errs["entropy"] = rel_err(stats["entropy"][counted], stats_ref["entropy"][counted])
    return errs


def assert_bf16_loss_error_at_most_twice_plain(shape: Shape, *, device, backend, chunk_size, seed):
    """The issue's bf16 criterion for a loss path: its error against float64 is at most 2x that of the plain bf16
    torch computation, for the loss and both gradients (on benchmarks/kernel_accuracy.py's inputs)."""
    from benchmarks.kernel_accuracy import errors

    plain, ours = errors(shape, device=device, chunk_size=chunk_size, seed=seed, paths=("plain bf16 torch", backend))
    for what, o, p in zip(("loss", "grad_hidden", "grad_weight"), ours[1:], plain[1:]):
        assert o <= 2 * p + 1e-6, f"{backend} {what}: error {o:.3g} > 2 x {p:.3g}"


def assert_small(errs: dict, tol: float, *, grad_tol: float | None = None, stat_tol: float = 1e-6):
    grad_tol = tol if grad_tol is None else grad_tol
    for key, err in errs.items():
        limit = grad_tol if key.startswith("grad") else stat_tol if key.endswith(("frac", "_zero")) else tol
        assert err <= limit, f"{key}: error {err:.3g} > {limit:.3g} (all: {errs})"
