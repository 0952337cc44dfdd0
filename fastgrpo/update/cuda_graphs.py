"""CUDA graphs of the decoder blocks per token bucket (``parallel.cuda_graphs``, one plain GPU, eager blocks).

Why: on a GPU a small model's update is bound by the host's dispatch (~1,000 launches per micro-batch at a tenth
of the card's bf16 rate). A CUDA graph replays a captured sequence of kernels with one launch. Capture needs
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
micro-batch's forward and backward run before the next one's, so no two shapes' graphs are live at a time. With
``parallel.token_buckets`` left empty the buckets are the micro-batch budget's 1/4, 1/2 and 1 ('auto', resolved by
the step plan once the budget is known) and any row length is taken. A row whose length is no listed bucket (a
sequence longer than every bucket), a shape past ``max_shapes`` (8: each keeps its own activations and gradient
buffers), a forward without gradients (the log-prob passes) and a call on another device run the block eagerly.
:meth:`BlockGraphs.block_forwards` are the forwards that a :class:`fastgrpo.distributed.runner.ModelRunner` puts in
place of the blocks' own during its packed passes only, so parameter names (checkpoints, exports) do not change and
decoding runs the plain blocks. :attr:`BlockGraphs.captures` / ``replays`` / ``eager_calls`` count what happened
(``benchmarks/bench_update_variants.py`` reports them).

Under autocast (float32 weights on one plain GPU) the capture runs with autocast's weight-cast cache off, as capture
requires: the graphs then cast the (updated in place) float32 weights themselves at every replay.

With ``parallel.compile`` too, the blocks are compiled with ``mode="reduce-overhead"`` instead (inductor's CUDA
graph trees: the same per-shape capture, warm-up and shared pool, on the compiled kernels); see
``fastgrpo.distributed.runner.prepare_model``.

The head loss (:class:`HeadGraphs`, ``parallel.cuda_graphs_head``, on by default with ``cuda_graphs``): a
:class:`fastgrpo.update.head.TokenHead` (the GRPO / PPO policy loss, SFT's) runs its ``compute`` on the micro-batch's
target rows padded with zero rows to :func:`fastgrpo.update.head.padded_rows` (a few counts per octave; zero rows add
nothing to the loss, the gradients or the stats), so each (head key, row count, dtypes) is one graph of the head's
forward and backward: the chunked log-softmax, the loss and its gradient in hidden states and the head's weight. The
head graphs keep a memory pool of their own (they are captured after, and replayed between, the blocks' forward and
backward graphs, an order a shared pool does not allow). A head that is not a ``TokenHead`` (PPO's value head), a
forward without gradients and a head beyond ``max_shapes`` (8) distinct shapes run eagerly: each shape's graph keeps
its own gradient of the head's weight (``[V, H]`` in the weight's dtype, 0.27 GB in bf16 at Qwen2.5's vocabulary and
H = 896), so the count is capped.

Not graphed: the embedding, the final norm, the gather of the target rows, and the optimizer step.

Gradients (:class:`GradientBuffers`, held by the runner that ``build_trained`` builds with ``cuda_graphs``): a
graphed backward hands autograd its *static* gradient buffers, and autograd makes the first one a parameter's
``.grad`` outright (it "steals" a gradient nobody else seems to hold), so the next replay of that graph would
overwrite the ``.grad`` before adding to it: two micro-batches of one shape would give twice the second one's
gradient instead of the sum (pytorch/pytorch#181723). Every trainable parameter therefore gets a zeroed ``.grad``
buffer of its own before an update's first backward, which autograd adds into in place and never replaces.

Needs a GPU: tests/test_cuda_graphs.py skips without one; ``make bench-gpu`` measures it.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import nn

from fastgrpo.models.packing import check_buckets
from fastgrpo.update.head import BoundHead, pad_rows, padded_rows

__all__ = ["BlockGraphs", "GradientBuffers", "HeadGraphs", "graph_blocks", "graph_head"]


DEVICE_TYPE = "cuda"
"""The device whose rows the graphs take (a test on the CPU stands the capture in and sets "cpu")."""


def _require_cuda() -> None:
    if not torch.cuda.is_available():
        raise ValueError("parallel.cuda_graphs needs a CUDA device (set it to false on this machine)")


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

    def __init__(self, blocks: nn.ModuleList, buckets: Sequence[int] | None, *, warmup_iters: int = 3,
                 max_shapes: int = 8) -> None:
        self.blocks = list(blocks)
        self.forwards = [block.forward for block in self.blocks]  # the eager forwards
        # None: any row length (parallel.token_buckets left to 'auto': the step plan pads every row that fits the
        # budget to one of the budget's buckets, so only an oversize row brings another length)
        self.buckets = None if buckets is None else set(check_buckets(buckets, "parallel.token_buckets"))
        self.max_shapes = max_shapes
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
        if not (hidden_states.device.type == DEVICE_TYPE and torch.is_grad_enabled()
                and (self.buckets is None or hidden_states.shape[1] in self.buckets)
                and not args and position_embeddings is not None and cu is not None and isinstance(max_seqlen, int)):
            return self._eager(index, hidden_states, *args, position_embeddings=position_embeddings, **kwargs)
        cos, sin = position_embeddings
        autocast = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else None
        shape = _Shape(hidden_states.shape[1], cu.numel(), max_seqlen, hidden_states.dtype, cos.dtype,
                       hidden_states.requires_grad, autocast)
        graphed = self.graphed.get(shape)
        if graphed is None and len(self.graphed) >= self.max_shapes:  # each shape holds its own activations and
            # gradient buffers: past the cap, new shapes run eagerly
            return self._eager(index, hidden_states, position_embeddings=position_embeddings, **kwargs)
        if graphed is None:
            graphed = self.capture(shape, hidden_size=hidden_states.shape[-1], head_dim=cos.shape[-1],
                                   device=hidden_states.device)
        self.replays += 1
        return graphed[index](hidden_states, cos, sin, cu)

    def _eager(self, index: int, *args, **kwargs):
        self.eager_calls += 1
        return self.forwards[index](*args, **kwargs)

    def block_forwards(self) -> list[Callable]:
        """Block i's forward through :meth:`run` (graph or eager), one per block, for a runner to put in place."""
        return [functools.partial(self.run, i) for i in range(len(self.blocks))]


def graph_blocks(blocks: Sequence[nn.Module], buckets: Sequence[int] | None, *, warmup_iters: int = 3,
                 max_shapes: int = 8) -> BlockGraphs:
    """A :class:`BlockGraphs` of ``blocks`` over ``buckets`` (None or empty: any row length, at most ``max_shapes``
    shapes); its :meth:`~BlockGraphs.block_forwards` go to the model's runner. ValueError without CUDA."""
    _require_cuda()
    return BlockGraphs(blocks, buckets or None, warmup_iters=warmup_iters, max_shapes=max_shapes)


class _HeadCall(nn.Module):
    """A TokenHead's ``compute`` as a function of tensors only (what capture takes): hidden ``[n', H]`` and the
    gathered tensors ``[n']`` in ``names`` order -> ``(loss, stats [K])``; the head's weight is the registered
    ``lm_head``'s, cast to ``dtype`` inside the graph when the weights are float32 under autocast (as
    ``packed_head_forward`` casts it)."""

    def __init__(self, lm_head: nn.Module, compute: Callable, names: tuple[str, ...],
                 dtype: torch.dtype | None) -> None:
        super().__init__()
        self.lm_head = lm_head  # registered so that capture sees its weight (tied: the embedding's)
        self.compute, self.names, self.dtype = compute, names, dtype
        self.stat_names: tuple[str, ...] | None = None  # set by the first call (warm-up)

    def forward(self, hidden: torch.Tensor, *tensors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weight = self.lm_head.weight
        if self.dtype is not None:
            hidden, weight = hidden.to(self.dtype), weight.to(self.dtype)
        loss, stats = self.compute(hidden, weight, **dict(zip(self.names, tensors)))
        self.stat_names = tuple(stats)
        return loss, torch.stack([s.detach().float().reshape(()) for s in stats.values()])  # [K]


@dataclass(frozen=True)
class _HeadShape:
    """What a captured head graph is specific to."""

    key: Any  # TokenHead.key
    rows: int  # n'
    names: tuple[str, ...]
    dtypes: tuple[torch.dtype, ...]  # hidden's, then each gathered tensor's
    cast: torch.dtype | None  # the compute dtype the head casts to (float32 weights under autocast), else None
    weight_requires_grad: bool


class HeadGraphs:
    """The graphs of a model's TokenHead losses, per :class:`_HeadShape` (module doc)."""

    def __init__(self, lm_head: nn.Module, *, warmup_iters: int = 3, max_shapes: int = 8) -> None:
        self.lm_head = lm_head
        self.warmup_iters = warmup_iters
        self.max_shapes = max_shapes
        self.graphed: dict[_HeadShape, tuple[Callable, _HeadCall]] = {}
        self.pool = None  # the head graphs' own pool (module doc)
        self.captures = 0
        """Head shapes captured."""
        self.replays = 0
        """Head calls served by a graph."""
        self.eager_calls = 0
        """Head calls run eagerly (not a TokenHead, no gradients, not CUDA, beyond ``max_shapes``, no rows)."""

    def takes(self, head: Any, hidden: torch.Tensor) -> bool:
        """Whether ``head`` (what ``packed_forward`` got) on ``hidden`` [n, H] replays from a graph."""
        return (isinstance(head, BoundHead) and hidden.device.type == DEVICE_TYPE and torch.is_grad_enabled()
                and hidden.shape[0] > 0 and not torch.is_autocast_enabled("cuda"))

    def forward(self, head: Callable, hidden: torch.Tensor, dtype: torch.dtype | None, eager: Callable[[], Any]):
        """``head(hidden, lm_head.weight)``, both cast to ``dtype`` when not None: from the graph of its shape
        (captured on its first call) when :meth:`takes` it and it is one of the first ``max_shapes`` shapes, else
        ``eager()`` (``packed_head_forward``'s own call). A graphed call returns ``(loss, stats)`` of the real rows
        as fresh tensors (a replay overwrites the graph's outputs)."""
        if not self.takes(head, hidden):
            return self._eager(eager)
        weight = self.lm_head.weight
        tensors = head.head.gather(head.mb)
        n = hidden.shape[0]
        rows = padded_rows(n)
        names = tuple(sorted(tensors))
        shape = _HeadShape(head.head.key, rows, names, (hidden.dtype, *(tensors[k].dtype for k in names)), dtype,
                           weight.requires_grad)
        entry = self.graphed.get(shape)
        if entry is None and len(self.graphed) >= self.max_shapes:
            return self._eager(eager)
        args = (pad_rows(hidden, rows), *(pad_rows(tensors[k], rows) for k in names))
        if entry is None:
            entry = self.capture(shape, head.head.compute, args)
        graphed, call = entry
        self.replays += 1
        loss, stats = graphed(*args)
        stats = stats.clone()  # [K]
        return loss.clone(), dict(zip(call.stat_names, stats.unbind()))

    def _eager(self, eager: Callable[[], Any]):
        self.eager_calls += 1
        return eager()

    def capture(self, shape: _HeadShape, compute: Callable, args: tuple[torch.Tensor, ...]):
        """Capture ``compute``'s forward and backward for ``shape`` with sample inputs like ``args``."""
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        call = _HeadCall(self.lm_head, compute, shape.names, shape.cast)
        # fresh static input buffers (a replay copies the real inputs in); the sample rows are the real ones
        samples = tuple(a.detach().clone().requires_grad_(a.requires_grad) for a in args)
        graphed = torch.cuda.make_graphed_callables(call, samples, num_warmup_iters=self.warmup_iters,
                                                    pool=self.pool)
        self.graphed[shape] = (graphed, call)
        self.captures += 1
        return graphed, call


def graph_head(lm_head: nn.Module, *, warmup_iters: int = 3, max_shapes: int = 8) -> HeadGraphs:
    """A :class:`HeadGraphs` of the TokenHead losses on ``lm_head``'s weight, for the model's runner (which hands it
    to ``packed_head_forward``). ValueError without CUDA."""
    _require_cuda()
    return HeadGraphs(lm_head, warmup_iters=warmup_iters, max_shapes=max_shapes)


class GradientBuffers:
    """A persistent ``.grad`` buffer per trainable parameter, zeroed and installed before each update's backward
    passes (module doc, "Gradients"): one multi-tensor zero per update, and the gradients' memory stays allocated
    between updates."""

    def __init__(self, params) -> None:
        seen: dict[int, torch.nn.Parameter] = {}
        for p in params:
            if p.requires_grad:
                seen.setdefault(id(p), p)  # tied weights: one buffer
        self.params = list(seen.values())
        self.buffers: list[torch.Tensor] | None = None

    @torch.no_grad()
    def install(self) -> None:
        """Every parameter's ``.grad`` = its own zeroed buffer (allocated at the first call)."""
        if self.buffers is None:
            self.buffers = [torch.zeros_like(p) for p in self.params]
        else:
            torch._foreach_zero_(self.buffers)
        for p, b in zip(self.params, self.buffers):
            p.grad = b
