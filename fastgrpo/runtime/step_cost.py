"""The least work a step must do: the FLOPs of an update and the bytes of a decode step (the numerators of MFU and
of the decode step's bandwidth floor; :mod:`fastgrpo.runtime.peaks` has the denominators)."""

from __future__ import annotations

import torch

__all__ = ["decode_step_bytes", "update_flops"]


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


def update_flops(model: torch.nn.Module, prompt_lens: list[int], comp_lens: list[int]) -> float:
    """Useful training FLOPs (forward + backward) of one packed update.

    6 * trunk params * all tokens + 6 * H * V * completion tokens only (the head runs on completions) +
    causal attention 6 * layers * d_attn * sum_i T_i^2 (per sequence: packing has no cross-sequence attention).
    """
    cfg = model.config
    n_trunk = sum(p.numel() for p in model.get_decoder().parameters()) - model.get_input_embeddings().weight.numel()
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    d_attn = cfg.num_attention_heads * head_dim
    totals = [p + c for p, c in zip(prompt_lens, comp_lens)]
    return (6 * n_trunk * sum(totals) + 6 * cfg.hidden_size * cfg.vocab_size * sum(comp_lens)
            + 6 * cfg.num_hidden_layers * d_attn * sum(t * t for t in totals))
