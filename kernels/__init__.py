"""fastgrpo.kernels: fused lm_head -> log-prob / GRPO-loss ops that never build an ``[N, V]`` logits tensor.

Imports only torch (and Triton when available), so other trainers can vendor this folder.

    linear_logprobs(hidden[N,H], weight[V,H], targets[N], *, temperature=1.0, return_entropy=False, bias=None)
        -> logp[N] float32 (, entropy[N] float32)
    linear_grpo_loss(hidden, weight, targets, advantages[N], token_weights[N], *, old_logprobs=None,
                     ref_logprobs=None, epsilon_low=0.2, epsilon_high=0.2, delta=None, beta=0.0,
                     temperature=1.0, sequence_index=None, policy_loss="clip", sapo_temperature_pos=1.0,
                     sapo_temperature_neg=1.05, use_bias_correction_kl=False, kl_token_weights=None,
                     bias=None) -> (loss, stats)
        (sequence_index [N]: GSPO's sequence-level ratio, on the torch and triton paths; policy_loss: a key of
        POLICY_LOSSES, "clip", "cispo" or "sapo"; bias [V]: an lm_head bias, on every path)
    FusedLinearGRPOLoss(...)(_input[B,T,H], lin_weight, selected_token_ids[B,T], attention_mask[B,T], advantages[B],
                             ...) -> (loss, metrics): Liger's LigerFusedLinearGRPOLoss, on padded batches (module.py)

    fused_grpo_loss(hidden, weight, targets, advantages, token_weights, settings, *, old_logprobs=None, ...)
        -> (loss, stats): linear_grpo_loss with its settings as one ``LossSettings`` (settings.py), as the trainer
        and the adapters call it

Layers, each knowing only the one below:
  ``settings.py``  ``LossSettings``: the policy term and its parameters, beta, the ratio's level, the temperature;
      checked once when built; ``loss_types.py`` ``LOSS_TYPES``: each loss type's term and normaliser, for
      fastgrpo's trainer, TRL and Liger (the one table); ``terms.py`` the policy terms (``POLICY_LOSSES``);
  ``objective.py``  ``TokenObjective``: the per-token GRPO loss as a function of the log-prob (the loss, its
      closed-form gradient, which rows can move), built once per call from a ``LossSettings`` and the call's rows;
  ``grpo_loss.py`` / ``logprobs.py``  the public ops and their ``autograd.Function``s;
  ``backends.py``  which backend runs a call and what each can run (``resolve_backend``, ``check_backend``);
  the backends, which take the objective as one argument and never read its settings:
    ``"cublas"`` (``_gradfwd.py``) on CUDA with a gradient to take: the gradient formed in forward from cuBLAS
        logits chunk by chunk, three large products in all; token-level ratio only;
    ``"triton"`` (``_triton.py``) other CUDA calls: online log-sum-exp over vocabulary tiles, logits recomputed in
        backward;
    ``"torch"`` (``_chunked.py``) other devices: chunked plain torch with the same memory bound; its loss also
        forms the gradient in forward (three products).
``reference`` holds the plain-torch oracles, written independently of all of the above.
"""

from .backends import BACKENDS, check_backend, resolve_backend
from .grpo_loss import fused_grpo_loss, linear_grpo_loss
from .logprobs import linear_logprobs
from .loss_types import LOSS_TYPES, LossType
from .module import FusedLinearGRPOLoss, padded_grpo_loss
from .objective import TokenObjective
from .reference import reference_linear_grpo_loss, reference_linear_logprobs
from .settings import LossSettingError, LossSettings
from .terms import POLICY_LOSSES

__all__ = [
    "linear_logprobs",
    "linear_grpo_loss",
    "fused_grpo_loss",
    "LossSettings",
    "LossSettingError",
    "LOSS_TYPES",
    "LossType",
    "FusedLinearGRPOLoss",
    "padded_grpo_loss",
    "reference_linear_logprobs",
    "reference_linear_grpo_loss",
    "TokenObjective",
    "POLICY_LOSSES",
    "BACKENDS",
    "check_backend",
    "resolve_backend",
]
