"""fastgrpo.kernels: fused lm_head -> log-prob / GRPO-loss ops that never build an ``[N, V]`` logits tensor.

Imports only torch (and Triton when available), so other trainers can vendor this folder.

    linear_logprobs(hidden[N,H], weight[V,H], targets[N], *, temperature=1.0, return_entropy=False)
        -> logp[N] float32 (, entropy[N] float32)
    linear_grpo_loss(hidden, weight, targets, advantages[N], token_weights[N], *, old_logprobs=None,
                     ref_logprobs=None, epsilon_low=0.2, epsilon_high=0.2, delta=None, beta=0.0,
                     temperature=1.0, sequence_index=None) -> (loss, stats)
        (sequence_index [N]: GSPO's sequence-level ratio, on the torch and triton paths)

Backends (``backend="auto"`` picks; ``resolve_backend(backend, device, needs_grad)`` says which one a call runs):
  ``linear_grpo_loss`` on CUDA with a gradient to take: ``"cublas"`` (``_gradfwd.py``), the gradient formed in
      forward from cuBLAS logits chunk by chunk, three large products in all;
  other CUDA calls: ``"triton"`` (``_triton.py``), online log-sum-exp over vocabulary tiles, logits recomputed in
      backward;
  other devices: ``"torch"`` (``_chunked.py``), chunked plain torch with the same memory bound; its loss also forms
      the gradient in forward (three products).
``reference`` holds the plain-torch oracles.
"""

from .backends import BACKENDS, resolve_backend
from .grpo_loss import linear_grpo_loss
from .logprobs import linear_logprobs
from .reference import reference_linear_grpo_loss, reference_linear_logprobs

__all__ = [
    "linear_logprobs",
    "linear_grpo_loss",
    "reference_linear_logprobs",
    "reference_linear_grpo_loss",
    "BACKENDS",
    "resolve_backend",
]
