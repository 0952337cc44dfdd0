"""The trainer's side of the sampler's log-prob under top-k / top-p: the log of its own kept mass at each token.

The engines report ``log q(x) = log p(x) - log S`` (:mod:`fastgrpo.rollout.truncation`: the token's log-prob under
the distribution it was drawn from, renormalised over the kept set). The importance ratio compares that with the
trainer's ``log p_old(x) - log S_old``, where ``S_old`` is the mass the same top_k / top_p keep of the trainer's own
distribution; without the renormalisation the ratio would be ``S`` at every token, not 1, a scale on the whole
policy gradient that only depends on the sampling settings. The pass costs one more trunk forward of the step
(the lm_head in chunks of tokens, with a sort over the vocabulary for top_p), and runs only when the rollout
truncates and ``rollout.importance_sampling_cap`` is set.

Legend: N completion tokens on this rank, n those of one micro-batch, c a chunk of them, H hidden, V vocabulary.
"""

from __future__ import annotations

import torch

from fastgrpo.config import RolloutConfig
from fastgrpo.distributed.runner import ModelRunner, as_runner
from fastgrpo.models.packing import MicroBatch
from fastgrpo.rollout.truncation import kept_log_mass, truncates

__all__ = ["old_kept_log_mass", "packed_kept_log_mass"]

_CHUNK_ELEMENTS = 1 << 24
"""Most logits one chunk holds (64 MiB in float32): the pass never builds an [N, V] tensor."""


@torch.no_grad()
def packed_kept_log_mass(model: ModelRunner | torch.nn.Module, mbs: list[MicroBatch], num_tokens: int, *,
                         temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """log S_old [N] float32: the log of the probability that ``model``'s ``softmax(logits / temperature)`` gives the
    top_k / top_p kept set at each target position (0 where nothing is truncated)."""
    runner = as_runner(model)
    device = mbs[0].targets.device if mbs else "cpu"
    out = torch.zeros(num_tokens, dtype=torch.float32, device=device)
    for mb in mbs:
        out[mb.flat_index] = runner.packed_forward(
            mb, lambda h, w: _log_mass(h, w, temperature=temperature, top_k=top_k, top_p=top_p))
    return out


def _log_mass(hidden: torch.Tensor, weight: torch.Tensor, *, temperature: float, top_k: int,
              top_p: float) -> torch.Tensor:
    """log S [n] of the rows of ``hidden`` [n, H] under the head ``weight`` [V, H], a chunk of rows at a time."""
    rows = max(1, _CHUNK_ELEMENTS // weight.shape[0])
    parts = []
    for h in hidden.split(rows):  # [c, H]
        logp = torch.log_softmax((h @ weight.to(h.dtype).T).float() / temperature, dim=-1)  # [c, V]
        parts.append(kept_log_mass(logp, top_k, top_p))  # [c]
    return torch.cat(parts) if parts else hidden.new_zeros(0, dtype=torch.float32)


def old_kept_log_mass(model: ModelRunner | torch.nn.Module, mbs: list[MicroBatch], num_tokens: int,
                      rollout: RolloutConfig) -> torch.Tensor | None:
    """:func:`packed_kept_log_mass` at the rollout's temperature, top_k and top_p when they truncate; else None."""
    if not truncates(rollout.top_k, rollout.top_p):
        return None
    return packed_kept_log_mass(model, mbs, num_tokens, temperature=rollout.temperature, top_k=rollout.top_k,
                                top_p=rollout.top_p)
