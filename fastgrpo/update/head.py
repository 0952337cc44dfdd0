"""A head loss split in two, so that a CUDA graph can replay the part that launches the kernels (issue 38).

Legend: n target tokens of one micro-batch, n' >= n the padded count, H hidden size, V vocabulary size.

A :data:`fastgrpo.update.step.HeadLoss` is any ``head_loss(mb, hidden [n, H], weight [V, H]) -> (loss, stats)``.
A :class:`TokenHead` is one whose work is

    gather(mb)                        -> {name: tensor [n]}   the micro-batch's per-token inputs (eager: indexing)
    compute(hidden, weight, **those)  -> (loss, stats)         a function of tensors alone (what a graph captures)

and whose ``compute`` obeys one rule: **a row whose every gathered tensor is 0 adds nothing to the loss or to the
stats** (the token weight is one of the tensors, and 0 on such a row; the stats are means over rows of nonzero
weight). A micro-batch's head can then run on ``n'`` rows, its per-token tensors and hidden states padded with zero
rows (:func:`pad_rows`): the loss, the gradients of the real rows and of the weight, and the stats are those of the
``n`` real rows (tests/test_token_head.py checks it for every head the trainer builds). ``n'`` takes few values
(:func:`padded_rows`), so one graph per value serves every step (``fastgrpo.update.cuda_graphs.HeadGraphs``).

``key`` names what ``compute`` computes: two heads with equal keys are the same function of their tensors (the GRPO
head's key is its kernel settings), so a graph captured for one replays for the other, step after step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Hashable

import torch

__all__ = ["BoundHead", "TokenHead", "pad_rows", "padded_rows"]

MIN_ROWS = 16
"""The fewest rows a padded head runs on."""


def padded_rows(n: int) -> int:
    """The row count ``n' >= n`` a head of ``n`` rows runs on when it is graphed: ``n`` rounded up to a multiple of
    an eighth of the next power of two (at least ``MIN_ROWS``): at most four values per octave, and at most 25% of
    padding from 128 rows on (n = 17 -> 32; 256 -> 256; 257 -> 320; 3000 -> 3072)."""
    if n < 1:
        raise ValueError(f"a head needs at least one row, got {n}")
    top = max(MIN_ROWS, 1 << (n - 1).bit_length())
    step = max(MIN_ROWS, top // 8)
    return -(-n // step) * step


def pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """``x`` [n, ...] with zero rows appended up to ``rows`` (differentiable; ``x`` itself when n == rows)."""
    n = x.shape[0]
    if n == rows:
        return x
    if n > rows:
        raise ValueError(f"cannot pad {n} rows down to {rows}")
    return torch.cat([x, x.new_zeros(rows - n, *x.shape[1:])])


@dataclass(frozen=True)
class TokenHead:
    """A head loss as gathered per-token tensors + a function of them (module doc). Calling it is the plain
    ``HeadLoss``: ``head(mb, hidden, weight) = compute(hidden, weight, **gather(mb))``."""

    compute: Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]
    """``(hidden [n, H], weight [V, H], **tensors [n]) -> (loss, stats)``: zero rows add nothing (module doc)."""
    gather: Callable[[Any], dict[str, torch.Tensor]]
    """``mb -> {name: [n] tensor}``: the same names at every call of one head."""
    key: Hashable
    """Equal keys: the same ``compute`` (module doc)."""

    def __call__(self, mb, hidden: torch.Tensor, weight: torch.Tensor):
        return self.compute(hidden, weight, **self.gather(mb))

    def bind(self, mb) -> "BoundHead":
        """The head of one micro-batch, as a runner's ``packed_forward`` takes it: ``fn(hidden, weight)``."""
        return BoundHead(self, mb)


@dataclass(frozen=True)
class BoundHead:
    """``head(mb, ...)`` with ``mb`` fixed; ``packed_forward`` hands it to a model's head graphs when it has them."""

    head: TokenHead
    mb: Any

    def __call__(self, hidden: torch.Tensor, weight: torch.Tensor):
        return self.head(self.mb, hidden, weight)
