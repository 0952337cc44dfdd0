"""Which kernel path runs a call: the one place that knows the backends and what each needs.

    "torch"   chunked plain torch (``_chunked.py``), any device
    "triton"  online log-sum-exp over vocabulary tiles, logits recomputed in backward (``_triton.py``); CUDA, or
              the Triton CPU interpreter under ``TRITON_INTERPRET=1``
    "cublas"  ``linear_grpo_loss`` only with a gradient: the gradient formed in forward from cuBLAS logits
              (``_gradfwd.py``); ``linear_logprobs`` runs it forward-only, for old / reference log-probs with the
              loss's numerics. Needs Triton for its row kernels, and CUDA (or the interpreter)
    "auto"    "cublas" on CUDA when the caller will take a gradient through a token-level loss, "triton" on
              CUDA otherwise, "torch" elsewhere

What each can run (``_CAN``): a recompute backend hands any differentiable token loss's gradient to the fused op;
a gradient-in-forward one forms each row's gradient as soon as the row's softmax is known, so it runs only
row-local objectives (``TokenObjective.row_local``). "cublas" has no recompute op, hence no sequence-level (GSPO)
ratio: :func:`check_backend` is the one place that says so. Every backend runs every policy term, the KL's own
weights, its bias correction and an lm_head bias (each is either a row-local term of ``TokenObjective`` or an
addition to the logits). Both ops, the trainer and config validation call
:func:`resolve_backend` (which calls :func:`check_backend`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import _chunked

try:  # Triton is optional: without it every call takes the torch backend.
    from . import _triton
except ImportError:  # pragma: no cover - depends on the environment
    _triton = None

__all__ = ["BACKENDS", "check_backend", "resolve_backend", "recompute_module", "grad_in_forward_module",
           "cublas_module"]

BACKENDS = ("auto", "cublas", "triton", "torch")
"""Every accepted ``backend=`` name."""


@dataclass(frozen=True)
class _Can:
    recompute: bool
    """Has the recompute op (``logprobs.FusedLinearLogprobs``): any token loss, autograd forms its gradient."""
    grad_in_forward: bool
    """Has a ``loss_pass`` that forms the loss's gradient in forward: row-local objectives only."""


_CAN = {"cublas": _Can(recompute=False, grad_in_forward=True),
        "triton": _Can(recompute=True, grad_in_forward=False),
        "torch": _Can(recompute=True, grad_in_forward=True)}

# The backends of the recompute autograd function (logprobs.FusedLinearLogprobs): forward(...) -> (logp, entropy,
# lse, sum_pz) and backward(..., need_grad_hidden, need_grad_weight) -> (grad_hidden, grad_weight), each None
# where not needed.
_RECOMPUTE = {"torch": _chunked}
if _triton is not None:
    _RECOMPUTE["triton"] = _triton


def recompute_module(name: str):
    """The module behind ``"torch"`` or ``"triton"`` (a name :func:`resolve_backend` returned)."""
    return _RECOMPUTE[name]


def grad_in_forward_module(name: str, device: torch.device):
    """The module whose ``loss_pass`` forms the loss's gradient in forward for backend ``name`` (a resolved one),
    or None when it has none (``"triton"``)."""
    if not _CAN[name].grad_in_forward:
        return None
    return _chunked if name == "torch" else cublas_module(device)


def cublas_module(device: torch.device):
    """The ``"cublas"`` path's module (``_gradfwd``), after checking that it can run on ``device``."""
    try:
        from . import _gradfwd
    except ImportError:  # pragma: no cover - depends on the environment
        raise ValueError("backend='cublas' needs Triton (pip install triton) for its row kernels") from None
    if device.type != "cuda" and not _gradfwd.INTERPRET:
        raise ValueError("backend='cublas' needs CUDA tensors (or TRITON_INTERPRET=1 set before import)")
    return _gradfwd


def check_backend(name: str, *, sequence_level: bool) -> None:
    """Raise ValueError unless ``name`` is a backend (one of ``BACKENDS``) that can run the GRPO loss with
    (``sequence_level=True``) or without GSPO's sequence-level importance ratio. Needs no device: config
    validation calls it too."""
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {list(BACKENDS)}, got {name!r}")
    if name != "auto" and not _runs(name, sequence_level):
        raise ValueError(f"backend {name!r} has no sequence-level importance sampling (GSPO): it forms each token's "
                         "gradient in forward, before its sequence's other tokens are known; use 'auto' (triton "
                         "on CUDA) or 'triton'")


def _runs(name: str, sequence_level: bool) -> bool:
    # a sequence-level ratio couples the rows of a sequence: only autograd through a recompute op sees them all
    return _CAN[name].recompute or not sequence_level


def resolve_backend(backend: str, device: torch.device | str, needs_grad: bool, *,
                    sequence_level: bool = False) -> str:
    """The concrete backend (``"cublas"``, ``"triton"`` or ``"torch"``) for ``backend`` on ``device``.

    ``needs_grad``: a gradient will be taken through ``linear_grpo_loss``, so ``"auto"`` may pick the
    gradient-in-forward ``"cublas"`` path. ``sequence_level``: the loss uses GSPO's sequence-level ratio, which
    ``"auto"`` then runs on a recompute path and an explicit ``"cublas"`` refuses (:func:`check_backend`). A trainer
    resolves once and runs the loss and its old / reference log-probs on the result: one numerics for both keeps
    ``exp(logp - old)`` exactly 1 while the policy has not moved. An explicit name is checked (ValueError saying
    what it needs) and returned unchanged.
    """
    check_backend(backend, sequence_level=sequence_level)
    device = torch.device(device)
    if backend == "auto":
        if device.type == "cuda" and _triton is not None:
            preferred = ("cublas", "triton") if needs_grad else ("triton",)  # cublas: three products, not four
            return next(name for name in preferred if _runs(name, sequence_level))
        return "torch"
    if backend == "cublas":
        cublas_module(device)
    elif backend == "triton":
        if _triton is None:
            raise ValueError("backend='triton' needs Triton (pip install triton)")
        if device.type != "cuda" and not _triton.INTERPRET:
            raise ValueError("backend='triton' needs CUDA tensors (or TRITON_INTERPRET=1 set before import)")
    return backend
