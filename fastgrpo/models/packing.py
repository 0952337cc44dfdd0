"""Sequence packing: variable-length sequences -> token-budget micro-batches without padding.

Each micro-batch is one row ``[1, T]`` holding whole sequences back to back (prompt then completion);
``position_ids`` restart at 0 for every sequence so that the attention backend keeps sequences apart and
rotary embeddings see the same positions as an unpadded forward. Only the positions whose hidden state
predicts a completion token are kept after the trunk, so the lm_head runs on completion tokens only. The packed
forward itself (how each attention backend is told where sequences start) is in :mod:`fastgrpo.models.attention`.

Shape legend:
  S  sequences in the batch (this rank's)           F  completion tokens of all S sequences (flat layout)
  T  tokens in one packed row                        N  completion tokens in one micro-batch
  H  hidden size                                     V  vocabulary size
  K  sequences in one micro-batch

Static shapes (``buckets``): a compiled block (``dynamic=False``) or a captured CUDA graph needs the same tensor
shapes at every call, so ``pack`` can pad each row up to the smallest of a few token *buckets* that holds it. The
tail is made of dummy segments (``pad_token_id`` tokens, position ids restarting at 0, each at most ``max_seqlen``
long) that predict nothing: they add no row to ``hidden_index`` / ``targets``, so their token weight is 0 and the
loss and gradients are those of the unpadded row. ``cu_seqlens`` is padded to a fixed count per bucket
(:func:`segment_capacity`) by repeating the last offset, which equals the row length (zero-length segments, which
varlen kernels skip), and ``max_seqlen`` is the caller's fixed cap (prompt + completion), not the row's longest.

Flat layout: sequence i's completion tokens occupy ``offsets[i] : offsets[i] + L_i`` where ``offsets`` is the
exclusive cumulative sum of the completion lengths L. Per-token tensors of the step (advantage, token weight,
old/ref log-prob) live in this layout and a micro-batch reads them with ``flat_index``.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

# ----------------------------------------------------------------------------------------------------------------
# Planning: which sequences go into which micro-batch (pure Python on lengths)


def _check_lengths(lengths: Sequence[int], name: str = "lengths") -> None:
    for i, n in enumerate(lengths):
        if int(n) < 1:
            raise ValueError(f"{name}[{i}] = {n}: every sequence needs at least one token")


def completion_offsets(completion_lengths: Sequence[int]) -> list[int]:
    """Exclusive cumulative sum of completion lengths: where each sequence starts in the flat layout."""
    return [0, *itertools.accumulate(completion_lengths)][:-1] if completion_lengths else []


def plan_microbatches(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """First-fit-decreasing bin packing of sequence indices under a token budget.

    lengths[i] is sequence i's total length (prompt + completion). Sequences are placed longest first, each
    into the first bin with room. A sequence longer than ``max_tokens`` cannot be split (attention needs the
    whole sequence in one forward), so it gets a bin of its own that exceeds the budget; callers that need a
    hard memory bound must cap prompt + completion length instead. Each bin lists indices in ascending order;
    bins come in creation order (largest first). FFD uses at most 11/9 OPT + 6/9 bins.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    _check_lengths(lengths)
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    room: list[int] = []
    for i in order:
        n = lengths[i]
        for b, free in enumerate(room):
            if n <= free:
                bins[b].append(i)
                room[b] -= n
                break
        else:
            bins.append([i])
            room.append(max_tokens - n)  # negative for an oversize sequence: nothing else fits there
    return [sorted(b) for b in bins]


def partition_balanced(lengths: Sequence[int], k: int) -> list[list[int]]:
    """Karmarkar-Karp largest differencing: k parts of sequence indices with near-equal token sums.

    Every item starts as a k-way partial partition (itself in one part, k-1 empty parts). The two partial
    partitions with the largest spread (max sum - min sum) are merged by pairing the heaviest part of one with
    the lightest part of the other, which cancels their spreads; repeat until one remains. Returns exactly k
    lists (some empty when fewer than k items), sorted by descending sum, each with ascending indices.
    Deterministic: ties break on insertion order.
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    heap: list[tuple[int, int, list[tuple[int, list[int]]]]] = []
    for tick, i in enumerate(range(len(lengths))):
        parts = [(int(lengths[i]), [i])] + [(0, []) for _ in range(k - 1)]
        heapq.heappush(heap, (-int(lengths[i]), tick, parts))  # spread = the item's length
    tick = len(lengths)
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        a = sorted(a, key=lambda p: -p[0])  # heaviest first
        b = sorted(b, key=lambda p: p[0])  # lightest first
        merged = [(sa + sb, ia + ib) for (sa, ia), (sb, ib) in zip(a, b)]
        sums = [s for s, _ in merged]
        heapq.heappush(heap, (-(max(sums) - min(sums)), tick, merged))
        tick += 1
    parts = heap[0][2] if heap else [(0, []) for _ in range(k)]
    return [sorted(ix) for _, ix in sorted(parts, key=lambda p: -p[0])]


def split_to_count(bins: list[list[int]], lengths: Sequence[int], num_bins: int) -> list[list[int]]:
    """Return exactly ``num_bins`` bins: split the heaviest splittable bins, then pad with empty bins.

    Why: under FSDP2 every micro-batch forward and backward issues collectives (all-gather, reduce-scatter)
    per block, so all ranks must run the same number of micro-batches or the job hangs. The trainer computes
    ``n = all_reduce_int(len(bins), 'max')`` once per step and calls this on every rank. Splitting a bin
    (Karmarkar-Karp in two) only makes bins smaller, so the token budget still holds and no compute is wasted;
    only a rank with fewer sequences than ``n`` gets empty bins, which ``pack`` turns into dummy micro-batches
    (N = 0: a forward/backward that contributes zero gradient but takes part in the collectives).
    """
    if num_bins < len(bins):
        raise ValueError(f"num_bins={num_bins} is fewer than the {len(bins)} bins planned; bins are never merged")
    out = [list(b) for b in bins]
    while len(out) < num_bins:
        splittable = [j for j, b in enumerate(out) if len(b) > 1]
        if not splittable:
            break
        j = max(splittable, key=lambda j: (sum(lengths[i] for i in out[j]), -j))
        halves = partition_balanced([lengths[i] for i in out[j]], 2)
        out[j:j + 1] = [[out[j][h] for h in half] for half in halves]
    return out + [[] for _ in range(num_bins - len(out))]


def bucket_for(num_tokens: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket that holds ``num_tokens`` tokens, or None when none does (the row keeps its length)."""
    fits = [b for b in buckets if b >= num_tokens]
    return min(fits) if fits else None


AUTO_BUCKETS = "auto"
"""``buckets`` value meaning: the budget's 1/4, 1/2 and 1 (:func:`resolve_buckets`)."""


def resolve_buckets(buckets: Sequence[int] | str, max_tokens: int) -> list[int]:
    """The token buckets of a step with micro-batch budget ``max_tokens``: ``buckets`` itself, or for
    :data:`AUTO_BUCKETS` three of them, ``max_tokens`` and its half and quarter rounded up to a multiple of 64 (FFD
    fills most rows close to the budget; the last rows of a step are the small ones)."""
    if buckets == AUTO_BUCKETS:
        return sorted({min(max_tokens, max(2, -(-max_tokens // (d * 64)) * 64)) for d in (4, 2)} | {max_tokens})
    return check_buckets(buckets)


def segment_capacity(bucket: int) -> int:
    """Entries of a padded ``cu_seqlens`` for a row of ``bucket`` tokens: ``bucket // 2 + 2``.

    Every real sequence has at least two tokens (prompt and completion each >= 1) and every dummy segment of the
    tail but the last is ``max_seqlen`` >= 2 long, so a row holds at most ``bucket // 2 + 1`` segments, plus the
    leading 0. A fixed count per bucket keeps the boundary tensor's shape, hence the compiled graph, the same."""
    return bucket // 2 + 2


def check_buckets(buckets: Sequence[int], name: str = "buckets") -> list[int]:
    """``buckets`` sorted ascending without repeats; ValueError naming ``name`` when one is < 2."""
    for b in buckets:
        if int(b) < 2:
            raise ValueError(f"{name}: every token bucket must be >= 2 tokens, got {b}")
    return sorted({int(b) for b in buckets})


def _tail_segments(tail: int, max_seqlen: int) -> list[int]:
    """Lengths of the dummy segments that fill ``tail`` tokens, each at most ``max_seqlen`` (the varlen kernels are
    told no sequence is longer)."""
    full, rest = divmod(tail, max_seqlen)
    return [max_seqlen] * full + ([rest] if rest else [])


# ----------------------------------------------------------------------------------------------------------------
# Packing: token ids -> tensors of one micro-batch


@dataclass(kw_only=True)
class MicroBatch:
    """One packed row. All tensors live on the compute device; the integer fields are host-side metadata."""

    input_ids: torch.Tensor
    """[1, T] int64: prompt + completion of each sequence, back to back."""
    position_ids: torch.Tensor
    """[1, T] int64: restarts at 0 at every sequence start."""
    hidden_index: torch.Tensor
    """[N] int64: positions in T whose hidden state predicts a completion token (per-sequence shift)."""
    targets: torch.Tensor
    """[N] int64: the completion tokens those positions predict."""
    flat_index: torch.Tensor
    """[N] int64: where each target sits in the flat per-token layout of the step."""
    cu_seqlens: torch.Tensor
    """[K + 1] int32: cumulative sequence lengths in the row (flash-attention varlen format)."""
    segment_ids: torch.Tensor
    """[T] int64: which sequence of the row each token belongs to (built here, so masks need no host copy)."""
    seq_indices: list[int]
    """The K sequences (indices into the step's batch) in this row, in row order."""
    seq_lengths: list[int]
    """Their total lengths (prompt + completion)."""
    max_seqlen: int
    """Longest sequence in the row (flash-attention varlen needs it as a Python int)."""
    num_tokens: int
    """T: tokens the trunk runs on (1 for a dummy micro-batch)."""
    num_completion_tokens: int
    """N: completion tokens, the rows of the lm_head input."""
    pad_lengths: list[int] = field(default_factory=list)
    """Lengths of the dummy segments that pad the row to its token bucket (empty: not padded)."""

    @property
    def num_real_tokens(self) -> int:
        """Tokens of the row without its bucket padding (what throughput counts; 1 for a dummy row)."""
        return self.num_tokens - sum(self.pad_lengths)

    @property
    def segment_lengths(self) -> list[int]:
        """Every segment of the row in order: the real sequences, then the padding's dummy segments (a dummy row
        is one segment of its tokens); they add up to ``num_tokens``."""
        return [*(self.seq_lengths or [self.num_tokens - sum(self.pad_lengths)]), *self.pad_lengths]

    @property
    def is_dummy(self) -> bool:
        """A placeholder that keeps FSDP collectives in step across ranks (see ``split_to_count``)."""
        return not self.seq_indices


def pack(
    prompt_ids: Sequence[Sequence[int]],
    completion_ids: Sequence[Sequence[int]],
    bins: Sequence[Sequence[int]],
    device: torch.device | str,
    *,
    pad_token_id: int = 0,
    buckets: Sequence[int] = (),
    max_seqlen: int | None = None,
) -> list[MicroBatch]:
    """Build one ``MicroBatch`` per bin.

    For a sequence at row offset s with prompt length P >= 1 and completion length L >= 1, positions
    s+P-1 ... s+P+L-2 predict the tokens at s+P ... s+P+L-1: the shift is per sequence, so nothing predicts
    across a boundary and the last token of a sequence predicts nothing. An empty bin becomes a dummy row of
    one ``pad_token_id`` token with N = 0. Index tensors are built on the host, in three buffers for all the bins
    (``[1, *]`` rows, ``[*]`` int64 vectors, int32 boundaries), each copied to the device once and split into
    views: three copies per step where one per tensor and bin would be seven per micro-batch.

    With ``buckets`` (module doc, "Static shapes") a row of T tokens is padded to the smallest bucket >= T (a row
    longer than every bucket, e.g. one oversize sequence, keeps T), ``cu_seqlens`` to ``segment_capacity`` entries,
    and a padded row's ``max_seqlen`` is ``max_seqlen`` (the prompt + completion cap; a longer sequence is a
    ValueError, since the varlen kernels would read past it), or without it the row's bucket: either way the same
    at every step.
    """
    buckets = check_buckets(buckets)
    if buckets and max_seqlen is not None:
        if max_seqlen < 2:
            raise ValueError(f"max_seqlen must be the prompt + completion cap (>= 2), got {max_seqlen}")
        longest = max((len(p) + len(c) for p, c in zip(prompt_ids, completion_ids)), default=0)
        if longest > max_seqlen:
            raise ValueError(f"a sequence of {longest} tokens is longer than max_seqlen={max_seqlen} (the prompt + "
                             "completion cap the padded micro-batches are compiled for)")
    if len(prompt_ids) != len(completion_ids):
        raise ValueError(f"{len(prompt_ids)} prompts but {len(completion_ids)} completions")
    for name, seqs in (("prompt_ids", prompt_ids), ("completion_ids", completion_ids)):
        _check_lengths([len(s) for s in seqs], name)
    offsets = completion_offsets([len(c) for c in completion_ids])
    rows: list[list[int]] = []  # per bin: input ids, position ids  -> [1, T] each
    vectors: list[list[int]] = []  # per bin: hidden index, targets, flat index [N] each, segment ids [T]
    bounds: list[list[int]] = []  # per bin: cu_seqlens [K + 1]
    lengths: list[list[int]] = []
    pads: list[list[int]] = []
    longest: list[int] = []  # per bin: its max_seqlen
    for b in bins:
        ids: list[int] = []
        pos: list[int] = []
        hidden_index: list[int] = []
        targets: list[int] = []
        flat_index: list[int] = []
        seq_lengths: list[int] = []
        for i in b:
            p, c = prompt_ids[i], completion_ids[i]
            s, P, L = len(ids), len(p), len(c)
            ids.extend(p)
            ids.extend(c)
            pos.extend(range(P + L))
            hidden_index.extend(range(s + P - 1, s + P + L - 1))
            targets.extend(c)
            flat_index.extend(range(offsets[i], offsets[i] + L))
            seq_lengths.append(P + L)
        if not b:  # dummy row: one token so that the trunk (and its collectives) still runs
            ids, pos = [pad_token_id], [0]
        segments = seq_lengths or [1]
        bucket = bucket_for(len(ids), buckets)
        pad = _tail_segments(bucket - len(ids), max_seqlen or bucket) if bucket is not None else []
        for n in pad:  # the tail: dummy segments that predict nothing (no hidden_index entry: token weight 0)
            ids.extend([pad_token_id] * n)
            pos.extend(range(n))
        segments = segments + pad
        rows += [ids, pos]
        vectors += [hidden_index, targets, flat_index, [k for k, n in enumerate(segments) for _ in range(n)]]
        cu = [0, *itertools.accumulate(segments)]
        if bucket is not None:  # a fixed count per bucket: zero-length segments at the end
            assert len(cu) <= segment_capacity(bucket), (cu, bucket)
            cu += [cu[-1]] * (segment_capacity(bucket) - len(cu))
        bounds.append(cu)
        lengths.append(seq_lengths)
        pads.append(pad)
        longest.append(max(seq_lengths, default=1) if bucket is None else max_seqlen or bucket)

    def views(parts: list[list[int]], dtype: torch.dtype, row: bool = False) -> tuple[torch.Tensor, ...]:
        flat = torch.tensor([x for part in parts for x in part], dtype=dtype)
        flat = flat.to(device, non_blocking=True)
        return (flat[None] if row else flat).split([len(part) for part in parts], dim=-1)

    row_t, vec_t, cu_t = views(rows, torch.long, row=True), views(vectors, torch.long), views(bounds, torch.int32)
    return [MicroBatch(
        input_ids=row_t[2 * j],  # [1, T]
        position_ids=row_t[2 * j + 1],  # [1, T]
        hidden_index=vec_t[4 * j],  # [N]
        targets=vec_t[4 * j + 1],  # [N]
        flat_index=vec_t[4 * j + 2],  # [N]
        cu_seqlens=cu_t[j],  # [K + 1]
        segment_ids=vec_t[4 * j + 3],  # [T]
        seq_indices=list(b),
        seq_lengths=lengths[j],
        max_seqlen=longest[j],
        num_tokens=len(rows[2 * j]),
        num_completion_tokens=len(vectors[4 * j + 1]),
        pad_lengths=pads[j],
    ) for j, b in enumerate(bins)]
