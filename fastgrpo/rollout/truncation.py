"""The sampler's kept set (top-k, then top-p) and the log-prob every engine reports for a sampled token.

One definition, shared by the hf engine's sampler, the vLLM engine (``logprobs_mode='processed_logprobs'``) and the
trainer's side of the importance weight:

    p(x)  = softmax(logits / T)(x)                               the untruncated distribution at temperature T
    K     = the top_k most likely tokens (all when top_k = 0), then the smallest prefix of K, most likely first,
            whose mass reaches top_p of K's mass (at least one token)
    S     = sum_{y in K} p(y)                                    the kept mass
    q(x)  = p(x) / S for x in K, 0 elsewhere                     the distribution the token is drawn from

The sampler's log-prob of a drawn token is ``log q(x) = log p(x) - log S``. The trainer's side renormalises its own
``log p`` over its own kept set the same way before it forms the importance ratio, so the ratio is 1 wherever the two
numerics agree, whatever top_p / top_k remove (an untruncated trainer log-prob against ``log q`` would carry a factor
S into every token's weight).

Top-p is taken over the top-k set renormalised (vLLM's order): a token is dropped when the kept mass before it, most
likely first, already reaches ``top_p * (mass of K)``.

Legend: N rows, V vocabulary, K kept candidates (V, or top_k).
"""

from __future__ import annotations

import torch

__all__ = ["kept_log_mass", "kept_probs", "truncates"]


def truncates(top_k: int, top_p: float) -> bool:
    """Whether ``top_k`` / ``top_p`` remove any token (0 and 1.0 keep the whole vocabulary)."""
    return top_k > 0 or top_p < 1.0


def kept_probs(logp: torch.Tensor, top_k: int, top_p: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``p`` restricted to the kept set, not renormalised: (probs, order).

    logp: [N, V] ``log_softmax(logits / T)``. Without truncation probs is ``exp(logp)`` [N, V] in vocabulary order and
    order is None; otherwise probs is [N, K] most likely first, zero outside the kept set, and ``order`` [N, K] maps
    its columns to token ids.
    """
    probs = logp.exp()  # [N, V]
    if not truncates(top_k, top_p):
        return probs, None
    if top_k > 0:
        probs, order = probs.topk(min(top_k, probs.shape[-1]), dim=-1)  # [N, K], sorted descending
    else:
        probs, order = probs.sort(dim=-1, descending=True)  # [N, V]
    if top_p < 1.0:
        before = probs.cumsum(dim=-1) - probs  # [N, K] kept mass before each token
        # top_k alone leaves a set of mass < 1: top-p is relative to that set (the first token always stays)
        bound = top_p * probs.sum(dim=-1, keepdim=True) if top_k > 0 else top_p
        probs = probs.masked_fill(before >= bound, 0.0)
    return probs, order


def kept_log_mass(logp: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """log S [N]: the log of the untruncated probability of each row's kept set (0 without truncation)."""
    if not truncates(top_k, top_p):
        return logp.new_zeros(logp.shape[0])
    probs, _ = kept_probs(logp, top_k, top_p)
    return probs.sum(dim=-1).log()
