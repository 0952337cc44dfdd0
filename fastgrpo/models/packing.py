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
  K  sequences in one micro-batch                   C  entries of cu_seqlens (segments + 1)
  Tk keys the segments of a shared-prefix row attend, segment by segment (the shared prefix once per sequence)

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

Shared prefixes (``groups``, :class:`PrefixGroups`): in GRPO every prompt is sampled G times, so a row of unshared
sequences forwards each prompt G times. Sequences of one group (by default: the same prompt tokens) that land in one
row hold their common prompt prefix of S tokens once, as a segment of its own, followed by each sequence's own
segment (the rest of its prompt, then its completion)::

    row       [ p0 .. pS-1 | a_S .. a_end | b_S .. b_end | ... ]      (one group: prefix, then sequences a, b, ...)
    positions [ 0  ..  S-1 | S   ..       | S   ..       | ... ]      (an own segment continues from the prefix)
    sees      prefix: causal within it; own segment: the whole prefix, then causal within itself

so every token attends to exactly the keys it attends to in its unshared sequence, at the same positions: outputs and
gradients are those of the unshared rows (the prefix's gradient is the sum over the sequences that read it). S is at
most the shortest prompt of the group, so an own segment is never empty, and every completion token but the first
is predicted from its own segment; the first is predicted from the sequence's last prompt token, which for S = P is
the prefix's last position: ``hidden_index`` then holds that position once per sequence (the head reads the same
hidden state for each, and its gradients add up in the backward of the gather). Attention backends read the layout
from ``kv_index`` (the row's keys each segment attends, segment by segment: a shared sequence's are its prefix's,
then its own; ``cu_seqlens_k`` their boundaries), or for a dense mask from ``context_ids`` (the prefix segment each
token sees in full). A group shares only when it pays (:meth:`PrefixGroups.shares`); the planner
(:func:`plan_shared_microbatches`) keeps a group in one row, and splits one that exceeds the budget into parts that
each repeat the prefix.
"""

from __future__ import annotations

import heapq
import itertools
import os
from collections.abc import Hashable, Sequence
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


MIN_SAVED_TOKENS = 16
"""A group's sequences in one row hold their prefix once only where that saves at least this many tokens: below it
the prefix's extra segment and the key gather of the attention cost about what the saved tokens do."""


@dataclass(frozen=True)
class PrefixGroups:
    """Which sequences of a batch may hold a common prompt prefix once per packed row (module doc, "Shared
    prefixes"). Built by :func:`prefix_groups`."""

    group_of: list[int]
    """Per sequence: its group, or -1 (it shares with no other sequence)."""
    prefix_lengths: list[int]
    """Per group: S >= 1, the tokens its sequences' prompts have in common from the start."""
    min_saved_tokens: int = MIN_SAVED_TOKENS
    """Sequences of a group in one row share its prefix when that saves at least this many tokens."""

    def shares(self, group: int, members: int) -> bool:
        """Whether ``members`` sequences of ``group`` in one row hold its prefix once: at least two of them, saving
        ``(members - 1) * S >= min_saved_tokens`` tokens."""
        return group >= 0 and members >= 2 and (members - 1) * self.prefix_lengths[group] >= self.min_saved_tokens


def common_prefix_length(seqs: Sequence[Sequence[int]]) -> int:
    """How many tokens ``seqs`` have in common from the start (at most the shortest one's length; 0 for none)."""
    return len(os.path.commonprefix([list(q) for q in seqs])) if seqs else 0


def prefix_groups(prompt_ids: Sequence[Sequence[int]], *, keys: Sequence[Hashable] | None = None,
                  min_saved_tokens: int = MIN_SAVED_TOKENS) -> PrefixGroups:
    """The sharing groups of a batch: sequences with the same key (default: the same prompt tokens, as GRPO's G
    samples of a prompt) form a group whose prefix is their prompts' common prefix. A sequence alone with its key,
    or a group whose prompts differ from the first token, shares with none (-1)."""
    if min_saved_tokens < 1:
        raise ValueError(f"min_saved_tokens must be >= 1, got {min_saved_tokens}")
    keys = [tuple(p) for p in prompt_ids] if keys is None else list(keys)
    if len(keys) != len(prompt_ids):
        raise ValueError(f"{len(keys)} group keys for {len(prompt_ids)} prompts")
    members: dict[Hashable, list[int]] = {}
    for i, key in enumerate(keys):
        members.setdefault(key, []).append(i)
    group_of, lengths = [-1] * len(keys), []
    for idx in members.values():
        shared = common_prefix_length([prompt_ids[i] for i in idx]) if len(idx) > 1 else 0
        if shared >= 1:
            for i in idx:
                group_of[i] = len(lengths)
            lengths.append(shared)
    return PrefixGroups(group_of=group_of, prefix_lengths=lengths, min_saved_tokens=min_saved_tokens)


def plan_shared_microbatches(lengths: Sequence[int], groups: PrefixGroups, max_tokens: int) -> list[list[int]]:
    """:func:`plan_microbatches` with shared prefixes: the sequences of a group that shares (:meth:`PrefixGroups.
    shares`) are one item of ``S + sum(L_i - S)`` tokens, placed whole in one bin; a group over ``max_tokens`` is
    first split (first-fit-decreasing on its sequences' own tokens, under the budget less S) into parts that each
    repeat the prefix, and a part that does not pay is its sequences alone. ``lengths[i]``: sequence i's prompt +
    completion. Bins list sequence indices in ascending order, as :func:`plan_microbatches`'s."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    _check_lengths(lengths)
    if len(groups.group_of) != len(lengths):
        raise ValueError(f"groups cover {len(groups.group_of)} sequences, the batch has {len(lengths)}")
    units: list[list[int]] = []
    members: dict[int, list[int]] = {}
    for i, g in enumerate(groups.group_of):
        if g < 0:
            units.append([i])
        else:
            members.setdefault(g, []).append(i)
    for g, idx in members.items():
        prefix = groups.prefix_lengths[g]
        own = [lengths[i] - prefix for i in idx]  # >= 1: S is at most the prompt, the completion has a token
        parts = [idx] if prefix + sum(own) <= max_tokens else [
            [idx[j] for j in part] for part in plan_microbatches(own, max(1, max_tokens - prefix))]
        for part in parts:
            units.extend([part] if groups.shares(g, len(part)) else ([i] for i in part))
    costs = [lengths[u[0]] if len(u) == 1 else sum(lengths[i] for i in u) - (len(u) - 1) * groups.prefix_lengths[
        groups.group_of[u[0]]] for u in units]
    return [sorted(i for u in b for i in units[u]) for b in plan_microbatches(costs, max_tokens)]


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


def power_of_two(n: int, least: int) -> int:
    """The smallest power of two >= ``n`` and >= ``least``."""
    return max(least, 1 << max(0, n - 1).bit_length())


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
    """[1, T] int64: prompt + completion of each sequence, back to back (a shared prefix once, module doc)."""
    position_ids: torch.Tensor
    """[1, T] int64: restarts at 0 at every sequence start (a shared sequence's own segment continues its prefix)."""
    hidden_index: torch.Tensor
    """[N] int64: positions in T whose hidden state predicts a completion token (per-sequence shift)."""
    targets: torch.Tensor
    """[N] int64: the completion tokens those positions predict."""
    flat_index: torch.Tensor
    """[N] int64: where each target sits in the flat per-token layout of the step."""
    cu_seqlens: torch.Tensor
    """[C] int32: cumulative segment lengths in the row (flash-attention varlen format)."""
    segment_ids: torch.Tensor
    """[T] int64: which segment of the row each token belongs to (built here, so masks need no host copy)."""
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
    kv_index: torch.Tensor | None = None
    """[Tk] int64, a row with a shared prefix: the row positions whose keys and values each segment attends, segment
    by segment (a shared sequence's own segment: its prefix's, then its own); None: each segment attends its own."""
    cu_seqlens_k: torch.Tensor | None = None
    """[C] int32 with ``kv_index``: the boundaries of each segment's keys in it."""
    context_ids: torch.Tensor | None = None
    """[T] int64 with ``kv_index``: the prefix segment each token sees in full besides its own (-1: none)."""
    row_segments: list[int] = field(default_factory=list)
    """With ``kv_index``: the lengths of the row's real segments in row order (each shared prefix, then the own
    segments of its sequences; an unshared sequence is one segment); empty: one segment per sequence."""
    key_lengths: list[int] = field(default_factory=list)
    """With ``kv_index``: how many keys each real segment attends (an own segment: its prefix's length more)."""

    @property
    def num_real_tokens(self) -> int:
        """Tokens the trunk forwards without the bucket padding (1 for a dummy row)."""
        return self.num_tokens - sum(self.pad_lengths)

    @property
    def num_sequence_tokens(self) -> int:
        """The sequences' own tokens, prompt + completion each, as an unshared row holds them (0 for a dummy row):
        what throughput counts; ``num_real_tokens`` is what was forwarded."""
        return sum(self.seq_lengths)

    @property
    def segment_lengths(self) -> list[int]:
        """Every segment of the row in order: the real ones (a sequence, or a shared prefix and its sequences' own
        segments), then the padding's dummy segments (a dummy row is one segment of its tokens); they add up to
        ``num_tokens``."""
        return [*(self.row_segments or self.seq_lengths or [self.num_tokens - sum(self.pad_lengths)]),
                *self.pad_lengths]

    @property
    def key_segment_lengths(self) -> list[int]:
        """The keys each segment of ``segment_lengths`` attends; they add up to ``kv_index``'s length (to
        ``num_tokens`` without a shared prefix)."""
        return [*self.key_lengths, *self.pad_lengths] if self.kv_index is not None else self.segment_lengths

    @property
    def shares_prefix(self) -> bool:
        """Whether the row holds a shared prefix (its attention needs ``kv_index`` or ``context_ids``)."""
        return self.kv_index is not None

    @property
    def is_dummy(self) -> bool:
        """A placeholder that keeps FSDP collectives in step across ranks (see ``split_to_count``)."""
        return not self.seq_indices


def _row_units(b: Sequence[int], groups: PrefixGroups | None) -> list[tuple[int, list[int]]]:
    """Bin ``b``'s sequences in row order as ``(S, sequences)``: the sequences of a group that shares in this row
    (:meth:`PrefixGroups.shares`) in one run after its prefix of S tokens, every other sequence alone with S = 0;
    in the order of each unit's first sequence in ``b``."""
    if groups is None:
        return [(0, [i]) for i in b]
    members: dict[int, list[int]] = {}
    for i in b:
        if groups.group_of[i] >= 0:
            members.setdefault(groups.group_of[i], []).append(i)
    units: list[tuple[int, list[int]]] = []
    placed: set[int] = set()
    for i in b:
        g = groups.group_of[i]
        if not groups.shares(g, len(members.get(g, ()))):
            units.append((0, [i]))
        elif g not in placed:
            placed.add(g)
            units.append((groups.prefix_lengths[g], members[g]))
    return units


def pack(
    prompt_ids: Sequence[Sequence[int]],
    completion_ids: Sequence[Sequence[int]],
    bins: Sequence[Sequence[int]],
    device: torch.device | str,
    *,
    pad_token_id: int = 0,
    buckets: Sequence[int] = (),
    max_seqlen: int | None = None,
    groups: PrefixGroups | None = None,
    min_boundaries: int | None = None,
) -> list[MicroBatch]:
    """Build one ``MicroBatch`` per bin.

    For a sequence at row offset s with prompt length P >= 1 and completion length L >= 1, positions
    s+P-1 ... s+P+L-2 predict the tokens at s+P ... s+P+L-1: the shift is per sequence, so nothing predicts
    across a boundary and the last token of a sequence predicts nothing. An empty bin becomes a dummy row of
    one ``pad_token_id`` token with N = 0. Index tensors are built on the host, in three buffers for all the bins
    (``[1, *]`` rows, ``[*]`` int64 vectors, int32 boundaries), each copied to the device once and split into
    views: three copies per step where one per tensor and bin would be seven per micro-batch.

    With ``groups`` the sequences of a group that shares in a bin hold its prefix once (module doc, "Shared
    prefixes"; a sequence whose prompt does not start with its group's prefix is a ValueError); the rows without a
    shared prefix are exactly those built without ``groups``.

    With ``buckets`` (module doc, "Static shapes") a row of T tokens is padded to the smallest bucket >= T (a row
    longer than every bucket, e.g. one oversize sequence, keeps T), ``cu_seqlens`` to ``segment_capacity`` entries
    (a row with a shared prefix may hold more segments, each of one token at least: it keeps what it uses), and a
    padded row's ``max_seqlen`` is ``max_seqlen`` (the prompt + completion cap; a longer sequence is a ValueError,
    since the varlen kernels would read past it), or without it the row's bucket: either way the same at every step.

    ``min_boundaries`` (what a step's plan passes): a padded row's ``cu_seqlens`` has the power of two >= the entries
    it uses (at least ``min_boundaries``, at most ``segment_capacity``) instead of the bucket's worst case, and its
    ``max_seqlen`` is at most its bucket. Why: the varlen kernels launch a block per (sequence slot, ``max_seqlen``
    tile, head), empty slots included (at a bucket of 8192 tokens with ``max_seqlen`` the bucket, ~3.7M blocks per
    attention kernel, most returning at once); a power of two keeps the boundary tensor to a few shapes per bucket,
    one compiled or captured graph each.
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
    if groups is not None and len(groups.group_of) != len(prompt_ids):
        raise ValueError(f"groups cover {len(groups.group_of)} sequences, the batch has {len(prompt_ids)}")
    for name, seqs in (("prompt_ids", prompt_ids), ("completion_ids", completion_ids)):
        _check_lengths([len(s) for s in seqs], name)
    offsets = completion_offsets([len(c) for c in completion_ids])
    rows: list[list[int]] = []  # per bin: input ids, position ids  -> [1, T] each
    # per bin: hidden index, targets, flat index [N] each, segment ids [T]; a shared row: kv index [Tk], context [T]
    vectors: list[list[int]] = []
    bounds: list[list[int]] = []  # per bin: cu_seqlens [C]; a shared row: cu_seqlens_k [C]
    plans: list[dict] = []  # per bin: the host-side fields
    for b in bins:
        ids: list[int] = []
        pos: list[int] = []
        hidden_index: list[int] = []
        targets: list[int] = []
        flat_index: list[int] = []
        seq_lengths: list[int] = []
        segments: list[int] = []  # per real segment: its tokens (queries) ...
        keys: list[int] = []  # ... and the keys it attends
        context: list[int] = []  # per token: the prefix segment it sees in full, -1 none
        kv: list[int] = []  # per key of each segment: its row position
        for prefix, seqs in _row_units(b, groups):
            head = len(ids)  # where the shared prefix starts (prefix > 0)
            if prefix:
                shared = list(prompt_ids[seqs[0]][:prefix])
                ids.extend(shared)
                pos.extend(range(prefix))
                context.extend([-1] * prefix)
                kv.extend(range(head, head + prefix))
                prefix_segment = len(segments)
                segments.append(prefix)
                keys.append(prefix)
            for i in seqs:
                p, c = prompt_ids[i], completion_ids[i]
                s, P, L = len(ids), len(p), len(c)
                own = P + L - prefix  # >= 1: the prefix is at most the prompt
                if prefix and (P < prefix or list(p[:prefix]) != shared):
                    raise ValueError(f"groups: the prompt of sequence {i} does not start with its group's shared "
                                     f"prefix of {prefix} tokens (group them by prompt: prefix_groups)")
                ids.extend(p[prefix:])
                ids.extend(c)
                pos.extend(range(prefix, P + L))
                # sequence position q >= prefix sits at row position s + q - prefix, q < prefix at head + q: the
                # first completion token is predicted from position P - 1, in the prefix when P = prefix
                hidden_index.append(s + P - 1 - prefix if P > prefix else head + P - 1)
                hidden_index.extend(range(s + P - prefix, s + P + L - 1 - prefix))
                targets.extend(c)
                flat_index.extend(range(offsets[i], offsets[i] + L))
                seq_lengths.append(P + L)
                segments.append(own)
                keys.append(prefix + own)
                context.extend([prefix_segment if prefix else -1] * own)
                if prefix:
                    kv.extend(range(head, head + prefix))
                kv.extend(range(s, s + own))
        is_shared = len(segments) > len(seq_lengths)  # a prefix segment
        if not b:  # dummy row: one token so that the trunk (and its collectives) still runs
            ids, pos, segments = [pad_token_id], [0], [1]
        bucket = bucket_for(len(ids), buckets)
        pad = _tail_segments(bucket - len(ids), max_seqlen or bucket) if bucket is not None else []
        for n in pad:  # the tail: dummy segments that predict nothing (no hidden_index entry: token weight 0)
            kv.extend(range(len(ids), len(ids) + n))
            ids.extend([pad_token_id] * n)
            pos.extend(range(n))
        rows += [ids, pos]
        segment_ids = [k for k, n in enumerate(segments + pad) for _ in range(n)]
        vectors += [hidden_index, targets, flat_index, segment_ids]
        cu = [0, *itertools.accumulate(segments + pad)]
        cu_k = [0, *itertools.accumulate(keys + pad)]
        if bucket is not None:  # a fixed count per bucket: zero-length segments at the end
            assert is_shared or len(cu) <= segment_capacity(bucket), (cu, bucket)
            slots = max(len(cu), segment_capacity(bucket))
            if min_boundaries is not None:  # the power of two >= what the row uses (docstring)
                slots = min(slots, power_of_two(len(cu), min_boundaries))
            cu += [cu[-1]] * (slots - len(cu))
            cu_k += [cu_k[-1]] * (len(cu) - len(cu_k))
        bounds.append(cu)
        if is_shared:
            vectors += [kv, context + [-1] * sum(pad)]
            bounds.append(cu_k)
        if bucket is None:
            row_seqlen = max(seq_lengths, default=1)
        else:  # padded: the run's cap, or the bucket (at most the bucket with min_boundaries: no sequence is longer)
            row_seqlen = max_seqlen or bucket
            row_seqlen = row_seqlen if min_boundaries is None else min(row_seqlen, bucket)
        plans.append(dict(seq_lengths=seq_lengths, pad=pad, shared=is_shared, segments=segments, keys=keys,
                          max_seqlen=row_seqlen))

    def views(parts: list[list[int]], dtype: torch.dtype, row: bool = False) -> tuple[torch.Tensor, ...]:
        flat = torch.tensor([x for part in parts for x in part], dtype=dtype)
        flat = flat.to(device, non_blocking=True)
        return (flat[None] if row else flat).split([len(part) for part in parts], dim=-1)

    row_t, vec_t, cu_t = views(rows, torch.long, row=True), views(vectors, torch.long), views(bounds, torch.int32)
    out, v, c = [], 0, 0  # v, c: the bin's first entry in vec_t, cu_t (a shared row has more)
    for j, b in enumerate(bins):
        plan = plans[j]
        shared = plan["shared"]
        out.append(MicroBatch(
            input_ids=row_t[2 * j],  # [1, T]
            position_ids=row_t[2 * j + 1],  # [1, T]
            hidden_index=vec_t[v],  # [N]
            targets=vec_t[v + 1],  # [N]
            flat_index=vec_t[v + 2],  # [N]
            cu_seqlens=cu_t[c],  # [C]
            segment_ids=vec_t[v + 3],  # [T]
            seq_indices=[i for _, seqs in _row_units(b, groups) for i in seqs],
            seq_lengths=plan["seq_lengths"],
            max_seqlen=plan["max_seqlen"],
            num_tokens=len(rows[2 * j]),
            num_completion_tokens=len(vectors[v + 1]),
            pad_lengths=plan["pad"],
            kv_index=vec_t[v + 4] if shared else None,  # [Tk]
            cu_seqlens_k=cu_t[c + 1] if shared else None,  # [C]
            context_ids=vec_t[v + 5] if shared else None,  # [T]
            row_segments=plan["segments"] if shared else [],
            key_lengths=plan["keys"] if shared else [],
        ))
        v, c = v + (6 if shared else 4), c + (2 if shared else 1)
    return out
