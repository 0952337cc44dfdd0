"""The least work a step must do: the FLOPs of an update and the bytes of a decode step (the numerators of MFU and
of the decode step's bandwidth floor; :mod:`fastgrpo.runtime.peaks` has the denominators)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

__all__ = ["UpdateCost", "causal_pairs", "decode_step_bytes", "update_flops"]


def decode_step_bytes(model: torch.nn.Module, *, sequences: int, batch_size: int, context: float) -> float:
    """Bytes one decode step must read at least, over all ``sequences`` (the memory-bandwidth floor's numerator):
    every weight once per batch of ``batch_size`` sequences (the input embedding only where it is also the head,
    since a step looks up one row of it per sequence), and each sequence's key / value cache of ``context`` tokens
    once. Weights and cache in the model's parameter dtype."""
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    params = list(model.parameters())  # a tied head once: parameters() yields each tensor once
    elem = params[0].element_size()
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    tied = head is not None and head.weight is embed
    weight_bytes = (sum(p.numel() for p in params) - (0 if tied else embed.numel())) * elem
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    kv_bytes_per_token = 2 * cfg.num_hidden_layers * kv_heads * head_dim * elem
    batches = -(-sequences // batch_size)
    return batches * weight_bytes + sequences * context * kv_bytes_per_token


def causal_pairs(segments: Iterable[tuple[int, int]]) -> int:
    """Query-key pairs causal attention computes over ``segments``, each ``(queries, keys)``: a segment's L queries
    are its own tokens, its K >= L keys are whatever it sees before them and itself, causal aligned bottom-right, so
    query j (1-based) sees K - L + j keys and the segment L * (K - L) + L * (L + 1) / 2. An unshared sequence of T
    tokens is ``(T, T)``; with a shared prefix of S tokens, the prefix is ``(S, S)`` once and each sequence's own
    segment of L tokens ``(L, S + L)`` (``fastgrpo.models.packing``, "Shared prefixes")."""
    return sum(q * (k - q) + q * (q + 1) // 2 for q, k in segments)


@dataclass(frozen=True, kw_only=True)
class UpdateCost:
    """A model's update FLOPs per unit of work (forward + backward: 3x the forward's 2 FLOPs per multiply-add)."""

    trunk_params: int
    """Parameters the trunk multiplies each token by (the decoder's, less the input embedding: a lookup)."""
    head_params: int
    """H * V: the head's multiply-adds per token it runs on."""
    attention_width: int
    """layers * heads * head_dim: multiply-adds of one query-key pair's score (and of its weighted value)."""

    @classmethod
    def of(cls, model: torch.nn.Module) -> "UpdateCost":
        """From a transformers causal LM (plain, PEFT-wrapped or FSDP2-sharded: a DTensor counts its full size)."""
        cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        embed = model.get_input_embeddings().weight.numel()
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        return cls(trunk_params=sum(p.numel() for p in model.get_decoder().parameters()) - embed,
                   head_params=cfg.hidden_size * cfg.vocab_size,
                   attention_width=cfg.num_hidden_layers * cfg.num_attention_heads * head_dim)

    def flops(self, *, tokens: float, head_tokens: float, attention_pairs: float) -> float:
        """6 * trunk params * tokens the trunk runs + 6 * H * V * tokens the head runs on (completions only) +
        12 * layers * d_attn * causal query-key pairs (scores and weighted values, 2 multiply-adds per pair and
        dimension, forward and backward)."""
        return (6 * self.trunk_params * tokens + 6 * self.head_params * head_tokens
                + 12 * self.attention_width * attention_pairs)


def update_flops(model: torch.nn.Module, prompt_lens: list[int], comp_lens: list[int]) -> float:
    """Useful training FLOPs (forward + backward) of one packed update of unshared sequences (each prompt forwarded
    with its completion, as other trainers do): :meth:`UpdateCost.flops` of every token, the head on completion
    tokens only, and each sequence's causal attention over itself (packing has no cross-sequence attention)."""
    totals = [p + c for p, c in zip(prompt_lens, comp_lens)]
    return UpdateCost.of(model).flops(tokens=sum(totals), head_tokens=sum(comp_lens),
                                      attention_pairs=causal_pairs((t, t) for t in totals))
