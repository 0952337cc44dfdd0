"""An independent reference of the sampler's log-prob (fastgrpo.rollout.truncation's definition), written the way
vLLM's sampler computes its ``processed_logprobs``: logits sorted ascending, top-k masked to -inf, softmax of the
rest, tokens whose ascending cumulative mass stays <= 1 - top_p masked (the most likely token always kept), then
``log_softmax`` of what is left. Shared by the hf, vLLM and trainer-side tests."""

from __future__ import annotations

import torch


def kept_set_logprobs(logits: torch.Tensor, tokens: torch.Tensor, *, temperature: float, top_p: float = 1.0,
                      top_k: int = 0) -> torch.Tensor:
    """log q of ``tokens`` [L] under ``logits`` [L, V]: after temperature, renormalised over the kept set."""
    scaled = logits.double() / temperature  # [L, V]
    ascending, order = scaled.sort(dim=-1)
    v = scaled.shape[-1]
    if top_k:
        kth = ascending[:, v - min(top_k, v)][:, None]  # [L, 1]
        ascending = ascending.masked_fill(ascending < kth, float("-inf"))
    if top_p < 1.0:
        cum = ascending.softmax(-1).cumsum(-1)  # [L, V]
        drop = cum <= 1 - top_p
        drop[:, -1] = False
        ascending = ascending.masked_fill(drop, float("-inf"))
    kept = torch.full_like(scaled, float("-inf")).scatter(-1, order, ascending)  # back to vocabulary order
    return torch.log_softmax(kept, -1).gather(-1, tokens[:, None]).squeeze(-1).float()  # [L]
