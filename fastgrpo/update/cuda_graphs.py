"""CUDA graphs of the decoder blocks per token bucket (``parallel.cuda_graphs``, one plain GPU, eager blocks).

Why: on a GPU a small model's update is bound by the host's dispatch (issue 38: ~1,000 launches per micro-batch
at 10% of the card's bf16 rate). A CUDA graph replays a captured sequence of kernels with one launch. Capture needs
static shapes and no host sync: the packed rows are padded to token buckets (``parallel.token_buckets``,
:mod:`fastgrpo.models.packing`) and the attention is one varlen op on a boundary tensor of fixed size
(``varlen_op``: on CUDA in bf16, torch's FlashAttention varlen op).

How (:class:`BlockGraphs`): at the first training forward of a bucketed row, every bucket is captured, largest
first, with ``torch.cuda.make_graphed_callables`` over all the blocks in forward order (per callable a warm-up of a
few iterations on a side stream, then its forward and backward captured as two graphs, replayed by an autograd
wrapper that hands the parameter gradients to autograd). All buckets share one memory pool
(``torch.cuda.graph_pool_handle``): only one bucket's graphs run at a time, and capturing the largest first sizes the
pool once. A row whose length is no bucket (a sequence longer than every bucket), a forward without gradients (the
log-prob passes) and a call on another device run the block eagerly. Each block's ``forward`` is replaced on the
instance, so parameter names (checkpoints, exports) do not change.

With ``parallel.compile`` too, the blocks are compiled with ``mode="reduce-overhead"`` instead (inductor's CUDA
graph trees: the same per-shape capture, warm-up and shared pool, on the compiled kernels); see
``fastgrpo.distributed.parallelize``.

Not graphed: the embedding, the final norm and the head loss (the loss reads a different number of target tokens
per row; graphing it needs the target index padded too), and the optimizer step.

Needs a GPU: tests/test_cuda_graphs.py skips without one; ``make bench-gpu`` measures it.
"""

from __future__ import annotations

import types
from typing import Any, Callable, Sequence

import torch
from torch import nn

from fastgrpo.models.packing import check_buckets, segment_capacity

__all__ = ["BlockGraphs", "graph_blocks"]


class _BlockCall(nn.Module):
    """A decoder block as a function of tensors only (what capture takes): hidden ``[1, T, H]``, rotary cos and sin
    ``[1, T, d]``, boundaries ``cu_seqlens [C]`` -> hidden ``[1, T, H]``; ``max_seqlen`` is the bucket."""

    def __init__(self, block: nn.Module, forward: Callable, max_seqlen: int) -> None:
        super().__init__()
        self.block = block  # registered so that capture sees its parameters
        self._forward = forward  # the block's own forward (its instance attribute is the dispatcher)
        self.max_seqlen = max_seqlen

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cu_seqlens: torch.Tensor) -> torch.Tensor:
        out = self._forward(hidden, attention_mask=None, position_embeddings=(cos, sin), use_cache=False,
                            cu_seq_lens_q=cu_seqlens, cu_seq_lens_k=cu_seqlens, max_length_q=self.max_seqlen,
                            max_length_k=self.max_seqlen)
        return out[0] if isinstance(out, tuple) else out


class BlockGraphs:
    """The graphs of all blocks for all buckets (module doc)."""

    def __init__(self, blocks: nn.ModuleList, buckets: Sequence[int], *, warmup_iters: int = 3) -> None:
        self.blocks = list(blocks)
        self.forwards = [block.forward for block in self.blocks]  # the eager forwards
        self.buckets = sorted(check_buckets(buckets, "parallel.token_buckets"), reverse=True)  # largest first
        self.warmup_iters = warmup_iters
        self.graphed: dict[int, tuple] = {}  # bucket -> one graphed callable per block

    def capture(self, *, dtype: torch.dtype, hidden_size: int, head_dim: int) -> None:
        """Capture every bucket (largest first) in one pool, with inputs of the real call's dtype and sizes."""
        pool = torch.cuda.graph_pool_handle()
        device = next(self.blocks[0].parameters()).device
        for bucket in self.buckets:
            calls = tuple(_BlockCall(b, f, bucket) for b, f in zip(self.blocks, self.forwards))
            # The sample inputs become the graphs' static input buffers (a replay copies the real inputs into
            # them), so no two inputs may share one: fresh tensors per input and per block.
            samples = tuple(self._samples(bucket, hidden_size, head_dim, dtype, device) for _ in calls)
            self.graphed[bucket] = torch.cuda.make_graphed_callables(
                calls, samples, num_warmup_iters=self.warmup_iters, pool=pool)

    @staticmethod
    def _samples(bucket: int, hidden_size: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device) -> tuple[torch.Tensor, ...]:
        """(hidden [1, T, H], cos [1, T, d], sin [1, T, d], cu_seqlens [C]) of one row of ``bucket`` tokens."""
        cu = torch.full((segment_capacity(bucket),), bucket, dtype=torch.int32, device=device)
        cu[0] = 0
        return (torch.randn(1, bucket, hidden_size, device=device, dtype=dtype, requires_grad=True),
                torch.ones(1, bucket, head_dim, device=device, dtype=dtype),
                torch.zeros(1, bucket, head_dim, device=device, dtype=dtype), cu)

    def run(self, index: int, hidden_states: torch.Tensor, *args, position_embeddings: Any = None, **kwargs):
        """Block ``index``'s forward: from its graph when the row is a bucket (module doc), else eager."""
        cu = kwargs.get("cu_seq_lens_q")
        bucket = hidden_states.shape[1]
        if not (hidden_states.is_cuda and torch.is_grad_enabled() and bucket in self.buckets and not args
                and position_embeddings is not None and cu is not None and cu.numel() == segment_capacity(bucket)):
            return self.forwards[index](hidden_states, *args, position_embeddings=position_embeddings, **kwargs)
        if not self.graphed:
            self.capture(dtype=hidden_states.dtype, hidden_size=hidden_states.shape[-1],
                         head_dim=position_embeddings[0].shape[-1])
        cos, sin = position_embeddings
        return self.graphed[bucket][index](hidden_states, cos, sin, cu)


def graph_blocks(blocks: nn.ModuleList, buckets: Sequence[int], *, warmup_iters: int = 3) -> BlockGraphs:
    """Route every block's forward through a :class:`BlockGraphs` over ``buckets``. ValueError without CUDA or
    without buckets (the row lengths to capture)."""
    if not torch.cuda.is_available():
        raise ValueError("parallel.cuda_graphs needs a CUDA device (set it to false on this machine)")
    if not buckets:
        raise ValueError("parallel.cuda_graphs needs parallel.token_buckets: the row lengths to capture")
    graphs = BlockGraphs(blocks, buckets, warmup_iters=warmup_iters)
    for i, block in enumerate(graphs.blocks):
        def forward(self, hidden_states, *args, _i=i, **kwargs):
            return graphs.run(_i, hidden_states, *args, **kwargs)

        block.forward = types.MethodType(forward, block)
    return graphs
