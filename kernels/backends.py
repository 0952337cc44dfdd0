"""Which kernel path runs a call: the one place that knows the backends and what each needs.

    "torch"   chunked plain torch (``_chunked.py``), any device
    "triton"  online log-sum-exp over vocabulary tiles, logits recomputed in backward (``_triton.py``); CUDA, or
              the Triton CPU interpreter under ``TRITON_INTERPRET=1``
    "cublas"  ``linear_grpo_loss`` only with a gradient: the gradient formed in forward from cuBLAS logits
              (``_gradfwd.py``); ``linear_logprobs`` runs it forward-only, for old / reference log-probs with the
              loss's numerics. Needs Triton for its row kernels, and CUDA (or the interpreter)
    "auto"    "cublas" on CUDA when the caller will take a gradient through the loss, "triton" on CUDA
              otherwise, "torch" elsewhere

Both ops, the trainer and config validation call :func:`resolve_backend`.
"""

from __future__ import annotations

import torch

from . import _chunked

try:  # Triton is optional: without it every call takes the torch backend.
    from . import _triton
except ImportError:  # pragma: no cover - depends on the environment
    _triton = None

__all__ = ["BACKENDS", "resolve_backend", "recompute_module", "cublas_module"]

BACKENDS = ("auto", "cublas", "triton", "torch")
"""Every accepted ``backend=`` name."""

# The backends of the recompute autograd function (logprobs.FusedLinearLogprobs): forward(...) -> (logp, entropy,
# lse, sum_pz) and backward(..., need_grad_hidden, need_grad_weight) -> (grad_hidden, grad_weight), each None
# where not needed.
_RECOMPUTE = {"torch": _chunked}
if _triton is not None:
    _RECOMPUTE["triton"] = _triton


def recompute_module(name: str):
    """The module behind ``"torch"`` or ``"triton"`` (a name :func:`resolve_backend` returned)."""
    return _RECOMPUTE[name]


def cublas_module(device: torch.device):
    """The ``"cublas"`` path's module (``_gradfwd``), after checking that it can run on ``device``."""
    try:
        from . import _gradfwd
    except ImportError:  # pragma: no cover - depends on the environment
        raise ValueError("backend='cublas' needs Triton (pip install triton) for its row kernels") from None
    if device.type != "cuda" and not _gradfwd.INTERPRET:
        raise ValueError("backend='cublas' needs CUDA tensors (or TRITON_INTERPRET=1 set before import)")
    return _gradfwd


def resolve_backend(backend: str, device: torch.device | str, needs_grad: bool) -> str:
    """The concrete backend (``"cublas"``, ``"triton"`` or ``"torch"``) for ``backend`` on ``device``.

    ``needs_grad``: a gradient will be taken through ``linear_grpo_loss``, so ``"auto"`` may pick the
    gradient-in-forward ``"cublas"`` path. An explicit name is checked (ValueError saying what it needs) and
    returned unchanged.
    """
    device = torch.device(device)
    if backend == "auto":
        if device.type == "cuda" and _triton is not None:
            return "cublas" if needs_grad else "triton"
        return "torch"
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {list(BACKENDS)}, got {backend!r}")
    if backend == "cublas":
        cublas_module(device)
    elif backend == "triton":
        if _triton is None:
            raise ValueError("backend='triton' needs Triton (pip install triton)")
        if device.type != "cuda" and not _triton.INTERPRET:
            raise ValueError("backend='triton' needs CUDA tensors (or TRITON_INTERPRET=1 set before import)")
    return backend
