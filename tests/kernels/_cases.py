"""Comparison helpers shared by the in-process tests and the Triton-interpreter subprocess.

Each helper runs a fused op on fresh random inputs (benchmarks.harness builds them, as in the benchmark) and
returns relative errors against the float64 reference evaluated on the same inputs.
"""

from __future__ import annotations

import pytest
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
                zero_weight_frac=0.25, entropy=False, chunk_size=None, seed=0, epsilon_high=0.2, sequences=None,
                bias=False, kl_weights=False, **objective):
    """``sequences=K``: sequence-level importance sampling (GSPO) with rows drawn into K sequences. ``bias``: an
    lm_head bias (its gradient compared too). ``kl_weights``: the KL term gets its own weights (a third of the
    policy's zeroed, as an entropy mask does, and the rest scaled). ``objective``: more keyword arguments of both
    losses (``policy_loss``, ``use_bias_correction_kl``, ...)."""
    inp = make_inputs(shape, dtype=dtype, seed=seed, zero_weight_frac=zero_weight_frac)
    hidden, weight, targets = inp["hidden"], inp["weight"], inp["targets"]
    adv, tw = inp["advantages"], inp["token_weights"]
    h64, w64 = _f64_leaves(hidden, weight)
    leaves, leaves64 = [hidden, weight], [h64, w64]
    kw = dict(delta=delta, beta=beta, temperature=temperature, epsilon_high=epsilon_high, **objective)
    kw64 = {}
    if bias:
        gen = torch.Generator().manual_seed(seed + 4)
        b = (torch.randn(shape.v, generator=gen) * 2).to(device=hidden.device, dtype=dtype).requires_grad_()
        (b64,) = _f64_leaves(b)
        leaves.append(b)
        leaves64.append(b64)
        kw64["bias"], kw["bias"] = b64, b
    logp_exact = reference_linear_logprobs(h64, w64, targets, temperature=temperature, bias=kw64.get("bias")).detach()
    kw.update(old_logprobs=perturbed(logp_exact, std=0.3, seed=seed + 1) if old else None,
              ref_logprobs=perturbed(logp_exact, std=0.2, seed=seed + 2) if beta else None)
    if sequences is not None:
        gen = torch.Generator().manual_seed(seed + 3)
        kw["sequence_index"] = torch.randint(0, sequences, (shape.n,), generator=gen).to(hidden.device)
    if kl_weights:  # the plain normaliser on the KL term; the policy's weights masked and scaled
        gen = torch.Generator().manual_seed(seed + 5)
        kw["kl_token_weights"] = tw.clone()
        tw = tw * (torch.rand(shape.n, generator=gen) * 2).to(tw.device) * (torch.rand(shape.n, generator=gen) > 0.33)
    kw64 = {**kw, **kw64}
    loss, stats = linear_grpo_loss(hidden, weight, targets, adv, tw, return_entropy=entropy, backend=backend,
                                   chunk_size=chunk_size, **kw)
    loss_ref, stats_ref = reference_linear_grpo_loss(h64, w64, targets, adv.double(), tw.double(),
                                                     return_entropy=entropy, **kw64)
    grads = torch.autograd.grad(loss, leaves)
    grads_ref = torch.autograd.grad(loss_ref, leaves64)
    counted = tw != 0
    if kl_weights:
        counted = counted | (kw["kl_token_weights"] != 0)
    errs = {
        "loss": rel_err(loss, loss_ref),
        "grad_hidden": rel_err(grads[0], grads_ref[0]),
        "grad_weight": rel_err(grads[1], grads_ref[1]),
        "logprobs": rel_err(stats["logprobs"][counted], stats_ref["logprobs"][counted]),
        "skipped_logprobs_zero": float(stats["logprobs"][~counted].abs().max()) if (~counted).any() else 0.0,
    }
    if bias:
        errs["grad_bias"] = rel_err(grads[2], grads_ref[2])
        assert grads[2].dtype == dtype
    assert stats.keys() - {"entropy"} == stats_ref.keys() - {"entropy"}
    for key in stats_ref.keys() - {"logprobs", "entropy"}:
        errs[key] = abs(stats[key].item() - stats_ref[key].item())
    if entropy:
        errs["entropy"] = rel_err(stats["entropy"][counted], stats_ref["entropy"][counted])
    return errs


def assert_bf16_loss_error_at_most_twice_plain(shape: Shape, *, device, backend, chunk_size, seed):
    """The bf16 criterion for a loss path: its error against float64 is at most 2x that of the plain bf16
    torch computation, for the loss and both gradients (on benchmarks/kernel_accuracy.py's inputs)."""
    from benchmarks.kernel_accuracy import errors

    plain, ours = errors(shape, device=device, chunk_size=chunk_size, seed=seed, paths=("plain bf16 torch", backend))
    for what, o, p in zip(("loss", "grad_hidden", "grad_weight"), ours[1:], plain[1:]):
        assert o <= 2 * p + 1e-6, f"{backend} {what}: error {o:.3g} > 2 x {p:.3g}"


def assert_second_backward_refused(shape: Shape, *, backend: str, seed: int) -> None:
    """The gradient-in-forward loss paths store their gradients once: a second backward is a clear error."""
    inp = make_inputs(shape, dtype=torch.float32, seed=seed)
    loss, _ = linear_grpo_loss(inp["hidden"], inp["weight"], inp["targets"], inp["advantages"],
                               inp["token_weights"], backend=backend)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward"):
        loss.backward()


def assert_small(errs: dict, tol: float, *, grad_tol: float | None = None, stat_tol: float = 1e-6):
    grad_tol = tol if grad_tol is None else grad_tol
    for key, err in errs.items():
        limit = grad_tol if key.startswith("grad") else stat_tol if key.endswith(("frac", "_zero")) else tol
        assert err <= limit, f"{key}: error {err:.3g} > {limit:.3g} (all: {errs})"


# ------------------------------------------------------- a frozen head (LoRA) or a frozen trunk: skipped gradients
FROZEN = ("head", "trunk")


def frozen_grads(shape: Shape, *, fn: str, frozen: str, backend: str, dtype=torch.float32, chunk_size=None,
                 seed=0, beta=0.0):
    """Gradients of ``fn`` (``"logprobs"``: ``linear_logprobs`` with entropy, random upstream gradients; ``"loss"``:
    ``linear_grpo_loss`` with old log-probs, and reference ones when ``beta``) once with both inputs trainable and
    once with ``frozen`` (``"head"``: the weight, or ``"trunk"``: hidden) detached, on the same inputs.

    Returns ``(full, part, created)``: ``full`` = (grad_hidden, grad_weight), ``part`` = the .grad of both inputs of
    the frozen run (None for the frozen one), ``created`` = the shapes of every tensor with new storage made during
    the frozen run (forward and backward)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    inp = make_inputs(shape, dtype=dtype, seed=seed, zero_weight_frac=0.2)
    gen = torch.Generator().manual_seed(seed + 1)
    up_lp, up_ent = torch.randn(shape.n, generator=gen), torch.randn(shape.n, generator=gen)
    with torch.no_grad():
        lp = reference_linear_logprobs(inp["hidden"].double(), inp["weight"].double(), inp["targets"])
    loss_kw = dict(old_logprobs=perturbed(lp, std=0.3, seed=seed + 2), beta=beta,
                   ref_logprobs=perturbed(lp, std=0.2, seed=seed + 3) if beta else None)

    def run(hidden, weight):
        if fn == "logprobs":
            lp, ent = linear_logprobs(hidden, weight, inp["targets"], return_entropy=True, backend=backend,
                                      temperature=0.8, chunk_size=chunk_size)
            out = (lp * up_lp + ent * up_ent).sum()
        else:
            out, _ = linear_grpo_loss(hidden, weight, inp["targets"], inp["advantages"], inp["token_weights"],
                                      backend=backend, chunk_size=chunk_size, **loss_kw)
        out.backward()

    run(inp["hidden"], inp["weight"])
    full = (inp["hidden"].grad, inp["weight"].grad)
    hidden, weight = (x.detach().clone().requires_grad_(name != frozen)
                      for x, name in ((inp["hidden"], "trunk"), (inp["weight"], "head")))
    existing = {hidden.untyped_storage().data_ptr(), weight.untyped_storage().data_ptr()}

    class Created(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.shapes = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in existing:
                    self.shapes.append(tuple(t.shape))
            return out

    with Created() as seen:
        run(hidden, weight)
    return full, (hidden.grad, weight.grad), seen.shapes


def assert_frozen_skips_its_gradient(shape: Shape, *, frozen: str, **kw) -> None:
    """The gradient taken equals the full computation's bit for bit and the frozen input gets none; with a frozen
    head no ``[V, H]`` tensor is created (the products run are counted in test_torch_path.py)."""
    full, part, created = frozen_grads(shape, frozen=frozen, **kw)
    kept = 0 if frozen == "head" else 1
    assert part[1 - kept] is None
    assert torch.equal(part[kept], full[kept]) and part[kept].any()
    if frozen == "head":
        assert (shape.v, shape.h) not in created, created
