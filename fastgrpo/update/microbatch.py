"""The CUDA micro-batch token budget, sized from the GPU's free memory (``grpo.max_tokens_per_microbatch: null``).

Why: on a GPU the policy update of a small or mid-size model is bound by the host, not by the card. Each packed
micro-batch costs one trunk forward and backward's worth of dispatched ops (about 0.13 s for Qwen2.5-0.5B's 24
layers on the H100 host, whatever its token count up to several thousand tokens), while the arithmetic of 4,096
tokens takes a fifth of that (benchmarks/RESULTS.md, "One GPU"). Packing makes a large micro-batch cost only its real
tokens, so fewer, larger micro-batches are the cheapest lead over padded trainers; the limit is activation memory,
which depends on the model and on what else holds the GPU (a colocated vLLM engine, the reference model).

How: at the first update, ``free`` = what the driver reports free plus what torch's cache holds unused, less the
gradients and AdamW moments not allocated yet (the first step creates them); ``fraction`` of that, divided by an
upper estimate of the activations one token keeps for the backward, rounded down to a multiple of 1024 and clamped
to [``floor``, ``cap``]. The floor is the old fixed default (4096), so no run gets smaller micro-batches than before;
a model whose config does not give the estimate keeps the floor. The estimate, per decoder layer and token, in
bytes of the compute dtype: ``16 * hidden + 6 * intermediate`` elements (norm inputs and outputs, q/k/v and the
attention output, the residual stream kept in float32 under autocast, and gate/up/activation/down inputs of the MLP);
with activation checkpointing a layer keeps only its float32 input, plus one layer's full set during its recompute.
It is about 1.3x what the H100 measured for Qwen2.5-0.5B under bf16 autocast (1.6 MB per token).

The budget counts the tokens a row forwards: with shared prefixes (``grpo.shared_prefix``) a group's prompt once,
so the same budget holds more sequences, and their activations are still those of the forwarded tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch

__all__ = ["MicrobatchSizing", "activation_bytes_per_token", "auto_microbatch_tokens", "pending_training_bytes"]

FLOOR_TOKENS = 4096
"""The fixed CUDA default before sizing existed, and the smallest budget sizing picks."""
CAP_TOKENS = 32768
"""Beyond this the per-micro-batch dispatch is amortised; larger rows only add memory risk."""
FRACTION = 0.4
"""Share of the free memory given to one micro-batch's activations (the rest: the head's chunk, allocator
fragmentation, gradients of tied weights, the reference model's forward)."""


@dataclass(frozen=True)
class MicrobatchSizing:
    tokens: int
    """The budget picked."""
    free_bytes: int
    """Free for activations: free + cached - pending gradients and AdamW state."""
    bytes_per_token: int | None
    """The activation estimate (None: the model's config did not give one; the floor is used)."""

    def describe(self) -> str:
        per = "no estimate" if self.bytes_per_token is None else f"~{self.bytes_per_token / 2**20:.2f} MiB per token"
        return f"{self.tokens} tokens ({self.free_bytes / 2**30:.1f} GiB free for activations, {per})"


def activation_bytes_per_token(config, *, compute_bytes: int, checkpointing: bool = False) -> int | None:
    """Upper estimate of the bytes one token's activations keep for the backward (module doc), or None."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden = getattr(text, "hidden_size", None)
    layers = getattr(text, "num_hidden_layers", None)
    inter = getattr(text, "intermediate_size", None)
    if not (isinstance(hidden, int) and isinstance(layers, int) and isinstance(inter, int)) or min(
            hidden, layers, inter) <= 0:
        return None
    per_layer = (16 * hidden + 6 * inter) * compute_bytes
    if checkpointing:
        return layers * hidden * 4 + per_layer
    return layers * per_layer


def _local_numel(p: torch.Tensor) -> int:
    return p.to_local().numel() if hasattr(p, "to_local") else p.numel()


def pending_training_bytes(params: Iterable[torch.nn.Parameter], optimizer: torch.optim.Optimizer | None) -> int:
    """Bytes the first optimizer step will still allocate on this rank: each parameter's gradient (its dtype) while
    it has none, and AdamW's two float32 moments while the optimizer holds no state for it."""
    total = 0
    for p in params:
        n = _local_numel(p)
        if p.grad is None:
            total += n * p.element_size()
        if optimizer is not None and not optimizer.state.get(p):
            total += 2 * n * 4
    return total


def auto_microbatch_tokens(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, *,
                           device: torch.device | str, compute_bytes: int, checkpointing: bool = False,
                           mem_info: tuple[int, int] | None = None, cached_bytes: int | None = None,
                           floor: int = FLOOR_TOKENS, cap: int = CAP_TOKENS,
                           fraction: float = FRACTION) -> MicrobatchSizing:
    """The micro-batch budget for ``model`` on CUDA ``device`` (module doc). ``mem_info`` (free, total) and
    ``cached_bytes`` (reserved - allocated) default to torch.cuda's readings; tests pass their own."""
    if mem_info is None:
        mem_info = torch.cuda.mem_get_info(torch.device(device))
    if cached_bytes is None:
        cached_bytes = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    params = [p for p in model.parameters() if p.requires_grad]
    free = max(0, int(mem_info[0]) + int(cached_bytes) - pending_training_bytes(params, optimizer))
    per_token = activation_bytes_per_token(model.config, compute_bytes=compute_bytes, checkpointing=checkpointing)
    if per_token is None:
        return MicrobatchSizing(tokens=floor, free_bytes=free, bytes_per_token=None)
    tokens = int(fraction * free / per_token) // 1024 * 1024
    return MicrobatchSizing(tokens=max(floor, min(cap, tokens)), free_bytes=free, bytes_per_token=per_token)
