"""CUDA graphs of the decoder blocks per token bucket (``parallel.cuda_graphs``, one plain GPU, eager blocks).

Why: on a GPU a small model's update is bound by the host's dispatch (issue 38: ~1,000 launches per micro-batch
at 10% of the card's bf16 rate). A CUDA graph replays a captured sequence of kernels with one launch. Capture needs
static shapes and no host sync: the packed rows are padded to token buckets (``parallel.token_buckets``,
:mod:`fastgrpo.models.packing`) and the attention is one varlen op on a boundary tensor of fixed size
(``varlen_op``: on CUDA in bf16, torch's FlashAttention varlen op).

How (:class:`BlockGraphs`): the first training forward of a row of a new *shape* captures the graphs of that shape
with ``torch.cuda.make_graphed_callables`` over all the blocks in forward order (per callable a warm-up of a few
iterations on a side stream, then its forward and backward captured as two graphs, replayed by an autograd wrapper
that hands the parameter gradients to autograd); later rows of that shape replay them. A shape is the row's bucket,
its boundary count (``cu_seqlens`` entries), its ``max_seqlen`` (the step plan keeps both to a few values:
``fastgrpo.update.step.plan_step``), the dtypes and the autocast state: a graph replays exactly the kernels it
captured, so each of them must match. All shapes share one memory pool (``torch.cuda.graph_pool_handle``): one
micro-batch's forward and backward run before the next one's, so no two shapes' graphs are live at a time. A row
whose length is no bucket (a sequence longer than every bucket), a forward without gradients (the log-prob passes)
and a call on another device run the block eagerly. Each block's ``forward`` is replaced on the instance, so
parameter names (checkpoints, exports) do not change. :attr:`BlockGraphs.captures` / ``replays`` / ``eager_calls``
count what happened (``benchmarks/bench_update_variants.py`` reports them); ``graph_blocks`` leaves the object on
the blocks' ``ModuleList`` as ``block_graphs``.

Under autocast (float32 weights on one plain GPU) the capture runs with autocast's weight-cast cache off, as capture
requires: the graphs then cast the (updated in place) float32 weights themselves at every replay.

With ``parallel.compile`` too, the blocks are compiled with ``mode="reduce-overhead"`` instead (inductor's CUDA
graph trees: the same per-shape capture, warm-up and shared pool, on the compiled kernels); see
``fastgrpo.distributed.parallelize``.

Not graphed: the embedding, the final norm and the head loss (the loss reads a different number of target tokens
per row; graphing it needs the target index padded too), and the optimizer step.

Needs a GPU: tests/test_cuda_graphs.py skips without one; ``make bench-gpu`` measures it.
"""

from __future__ import annotations

import contextlib
import types
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import nn

from fastgrpo.models.packing import check_buckets

__all__ = ["BlockGraphs", "graph_blocks"]


class _BlockCall(nn.Module):
    """A decoder block as a function of tensors only (what capture takes): hidden ``[1, T, H]``, rotary cos and sin
    ``[1, T, d]``, boundaries ``cu_seqlens [C]`` -> hidden ``[1, T, H]``; ``max_seqlen`` is fixed per shape."""

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


@dataclass(frozen=True)
class _Shape:
    """What a captured graph is specific to (module doc)."""

    tokens: int  # the bucket: T
    boundaries: int  # entries of cu_seqlens: C
    max_seqlen: int
    hidden_dtype: torch.dtype
    rotary_dtype: torch.dtype
    hidden_requires_grad: bool
    autocast: torch.dtype | None  # the autocast dtype, None without autocast


class BlockGraphs:
    """The graphs of all blocks, per row shape (module doc)."""

    def __init__(self, blocks: nn.ModuleList, buckets: Sequence[int], *, warmup_iters: int = 3) -> None:
        self.blocks = list(blocks)
        self.forwards = [block.forward for block in self.blocks]  # the eager forwards
        self.buckets = set(check_buckets(buckets, "parallel.token_buckets"))
        self.warmup_iters = warmup_iters
        self.graphed: dict[_Shape, tuple] = {}  # shape -> one graphed callable per block
        self.pool = None  # one memory pool for every shape's graphs
        self.captures = 0
        """Shapes captured (each: every block's forward and backward)."""
        self.replays = 0
        """Block calls served by a graph."""
        self.eager_calls = 0
        """Block calls run eagerly (no bucket, no gradients, not CUDA)."""

    def capture(self, shape: _Shape, *, hidden_size: int, head_dim: int, device: torch.device) -> tuple:
        """Capture every block's graphs for ``shape`` (in the shared pool), with inputs of its dtypes and sizes."""
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        calls = tuple(_BlockCall(b, f, shape.max_seqlen) for b, f in zip(self.blocks, self.forwards))
        # The sample inputs become the graphs' static input buffers (a replay copies the real inputs into them), so
        # no two inputs may share one: fresh tensors per input and per block.
        samples = tuple(self._samples(shape, hidden_size, head_dim, device) for _ in calls)
        autocast = (torch.autocast("cuda", dtype=shape.autocast, cache_enabled=False) if shape.autocast is not None
                    else contextlib.nullcontext())
        with autocast:  # capture refuses autocast's weight-cast cache (module doc)
            graphed = torch.cuda.make_graphed_callables(calls, samples, num_warmup_iters=self.warmup_iters,
                                                        pool=self.pool)
        self.graphed[shape] = graphed
        self.captures += 1
        return graphed

    @staticmethod
    def _samples(shape: _Shape, hidden_size: int, head_dim: int, device: torch.device) -> tuple[torch.Tensor, ...]:
        """(hidden [1, T, H], cos [1, T, d], sin [1, T, d], cu_seqlens [C]) of one row of ``shape``: one sequence
        of ``max_seqlen`` tokens at most, the rest empty segments' repeats (any valid boundaries will do)."""
        t = shape.tokens
        cu = torch.full((shape.boundaries,), t, dtype=torch.int32, device=device)
        cu[0] = 0
        if shape.boundaries > 2 and shape.max_seqlen < t:  # no segment longer than max_seqlen
            starts = torch.arange(0, t, shape.max_seqlen, dtype=torch.int32, device=device)[1:shape.boundaries - 1]
            cu[1:1 + starts.numel()] = starts
        hidden = torch.randn(1, t, hidden_size, device=device, dtype=shape.hidden_dtype)
        return (hidden.requires_grad_(shape.hidden_requires_grad),
                torch.ones(1, t, head_dim, device=device, dtype=shape.rotary_dtype),
                torch.zeros(1, t, head_dim, device=device, dtype=shape.rotary_dtype), cu)

    def run(self, index: int, hidden_states: torch.Tensor, *args, position_embeddings: Any = None, **kwargs):
        """Block ``index``'s forward: from its graph when the row is a bucket (module doc), else eager."""
        cu = kwargs.get("cu_seq_lens_q")
        max_seqlen = kwargs.get("max_length_q")
        if not (hidden_states.is_cuda and torch.is_grad_enabled() and hidden_states.shape[1] in self.buckets
                and not args and position_embeddings is not None and cu is not None and isinstance(max_seqlen, int)):
            self.eager_calls += 1
            return self.forwards[index](hidden_states, *args, position_embeddings=position_embeddings, **kwargs)
        cos, sin = position_embeddings
        autocast = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else None
        shape = _Shape(hidden_states.shape[1], cu.numel(), max_seqlen, hidden_states.dtype, cos.dtype,
                       hidden_states.requires_grad, autocast)
        graphed = self.graphed.get(shape)
        if graphed is None:
            graphed = self.capture(shape, hidden_size=hidden_states.shape[-1], head_dim=cos.shape[-1],
                                   device=hidden_states.device)
        self.replays += 1
        return graphed[index](hidden_states, cos, sin, cu)


def graph_blocks(blocks: nn.ModuleList, buckets: Sequence[int], *, warmup_iters: int = 3) -> BlockGraphs:
    """Route every block's forward through a :class:`BlockGraphs` over ``buckets`` (also left on ``blocks`` as
    ``block_graphs``). ValueError without CUDA or without buckets (the row lengths to capture)."""
    if not torch.cuda.is_available():
        raise ValueError("parallel.cuda_graphs needs a CUDA device (set it to false on this machine)")
    if not buckets:
        raise ValueError("parallel.cuda_graphs needs parallel.token_buckets: the row lengths to capture")
    graphs = BlockGraphs(blocks, buckets, warmup_iters=warmup_iters)
    for i, block in enumerate(graphs.blocks):
        def forward(self, hidden_states, *args, _i=i, **kwargs):
            return graphs.run(_i, hidden_states, *args, **kwargs)

        block.forward = types.MethodType(forward, block)
    blocks.block_graphs = graphs
    return graphs
