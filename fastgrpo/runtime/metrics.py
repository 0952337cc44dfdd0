"""A step's metrics: device-side accumulation, one reduction per step, timers and throughput.

Inside a micro-batch nothing leaves the device: values are added as tensors into a StepMetrics and only
``StepMetrics.reduce()`` (once per step) all-reduces across ranks and converts to Python floats, in one read. Where
a record goes: :mod:`fastgrpo.runtime.run_log` and :mod:`fastgrpo.runtime.sinks`.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from fastgrpo.runtime.step_cost import UpdateCost

__all__ = ["StepMetrics", "Timer", "add_throughput", "add_update_flops"]


# internal key prefix: a min is a max of negatives
_NEG = "__neg__/"


class StepMetrics:
    """Accumulates named scalars as device tensors; ``reduce()`` makes them global over ranks in one sync.

    ``add``: weighted mean (weights summed over micro-batches and ranks, so a rank with more tokens counts more);
    ``add_many``: ``add`` of several values with one weight, in three dispatched ops whatever their number (a
    micro-batch's statistics); ``set``: a step-level value, averaged over ranks; ``total``: a sum; ``max``/``min``:
    extremes; ``moments``: global mean and std of a set of values; ``host``: a float already on the host (rank 0's),
    not reduced. Nothing here reads a device value before ``reduce()``: weights are host floats, NaN values are
    left out of ``moments`` by masking, not by boolean indexing (whose output size is a host sync).
    """

    def __init__(self) -> None:
        # weighted means, in groups added together: names -> ([K] sums of weight * value, host sum of weights)
        self._sum: dict[tuple[str, ...], tuple[torch.Tensor, float]] = {}
        self._total: dict[str, torch.Tensor] = {}
        self._max: dict[str, torch.Tensor] = {}
        self._moments: dict[str, tuple[torch.Tensor, str | None]] = {}  # mean name -> ([3] sums, std name)
        self._host: dict[str, float] = {}
        self._group_of: dict[str, tuple[str, ...]] = {}  # name -> its key in _sum

    def add(self, name: str, value: torch.Tensor, weight: float = 1.0) -> None:
        """Running weighted mean of ``value`` (a 0-d tensor)."""
        self._accumulate((name,), value.detach().float().reshape(1), weight)

    def add_many(self, values: dict[str, torch.Tensor], weight: float = 1.0) -> None:
        """``add(name, value, weight)`` for every item of ``values`` (0-d tensors), with the same numbers."""
        with torch.no_grad():
            stacked = torch.stack(list(values.values())).float()  # [K]
        self._accumulate(tuple(values), stacked, weight)

    def _accumulate(self, names: tuple[str, ...], values: torch.Tensor, weight: float) -> None:
        for n in names:
            if self._group_of.setdefault(n, names) != names:
                raise ValueError(f"metric {n!r} was added with {self._group_of[n]}: add it the same way every time")
        weighted = values if weight == 1.0 else values * weight  # [K] (x * 1.0 is x: skip the op)
        if names in self._sum:
            acc, w = self._sum[names]
            self._sum[names] = (acc + weighted, w + float(weight))
        else:
            self._sum[names] = (weighted, float(weight))

    def set(self, name: str, value: torch.Tensor) -> None:
        """A step-level device value, averaged over ranks."""
        if self._group_of.get(name) == (name,):
            del self._sum[(name,)], self._group_of[name]
        self.add(name, value)

    def total(self, name: str, value: torch.Tensor) -> None:
        """A sum over micro-batches and ranks (e.g. the loss, whose token weights are global-batch shares)."""
        v = value.detach().float()
        self._total[name] = self._total[name] + v if name in self._total else v

    def moments(self, values: torch.Tensor, mean_name: str, std_name: str | None = None) -> None:
        """Mean (and unbiased std) of ``values`` over every rank's elements: a global statistic, not a mean of
        per-rank ones. NaN entries (a reward function that returned None) are left out."""
        v = values.detach().float().reshape(-1)
        nan = torch.isnan(v)
        v = v.masked_fill(nan, 0.0)  # the same values when there is no NaN: the same sums
        sums = torch.stack([v.sum(), (v * v).sum(), (v.numel() - nan.sum()).float()])  # [3]
        self._moments[mean_name] = (sums, std_name)

    def max(self, name: str, value: torch.Tensor) -> None:
        """A step-level maximum over micro-batches and ranks."""
        v = value.detach().float()
        self._max[name] = torch.maximum(self._max[name], v) if name in self._max else v

    def min(self, name: str, value: torch.Tensor) -> None:
        """A step-level minimum over micro-batches and ranks."""
        self.max(_NEG + name, -value.detach().float())

    def host(self, name: str, value: float) -> None:
        self._host[name] = float(value)

    def reduce(self) -> dict[str, float]:
        """One all-reduce per kind (sum, max), then one host transfer of everything; returns floats."""
        sums = list(self._sum.items())
        moments = list(self._moments.items())
        summed = ([acc for _, (acc, _) in sums] + list(self._total.values()) + [m for _, (m, _) in moments]
                  + [torch.tensor([w for _, (_, w) in sums], dtype=torch.float32)])
        maxed = list(self._max.values())
        # one device for the collective (NCCL reduces CUDA tensors only): a CUDA one if any value lives there
        device = next((v.device for v in summed + maxed if v.device.type != "cpu"), torch.device("cpu"))
        flat_sum = torch.cat([v.reshape(-1).to(device) for v in summed])
        flat_max = torch.cat([v.reshape(-1).to(device) for v in maxed]) if maxed else flat_sum[:0]
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(flat_sum, op=dist.ReduceOp.SUM)
            if maxed:
                dist.all_reduce(flat_max, op=dist.ReduceOp.MAX)
        values = iter(torch.cat([flat_sum, flat_max]).tolist())  # the metrics' one host sync

        def take(t: torch.Tensor) -> list[float]:
            return [next(values) for _ in range(t.numel())]

        sum_values = [take(acc) for _, (acc, _) in sums]
        totals = [take(v)[0] for v in self._total.values()]
        moment_values = [take(m) for _, (m, _) in moments]
        weights = take(summed[-1])
        out: dict[str, float] = {}
        for (names, _), vals, w in zip(sums, sum_values, weights):
            out.update((name, v / w if w else float("nan")) for name, v in zip(names, vals))
        out.update(zip(self._total, totals))
        for (mean_name, (_, std_name)), (s, sq, n) in zip(moments, moment_values):
            mean = s / n if n else float("nan")
            out[mean_name] = mean
            if std_name is not None:
                out[std_name] = (max(sq - n * mean * mean, 0.0) / (n - 1)) ** 0.5 if n > 1 else 0.0
        for key, v in self._max.items():
            first = take(v)[0]
            out[key[len(_NEG):] if key.startswith(_NEG) else key] = -first if key.startswith(_NEG) else first
        out.update(self._host)
        return out


class Timer:
    """Wall-clock seconds of a block (synchronises CUDA so GPU work is counted where it happens)."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def __enter__(self) -> "Timer":
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: Any) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.seconds = time.perf_counter() - self._t0


def add_throughput(record: dict[str, float], *, rollout_s: float, update_s: float, num_iterations: int) -> None:
    """Tokens per second of the rollout, the update (all num_iterations passes) and the whole step.

    Token counts are totals over ranks; ranks run in lockstep, so rank 0's seconds are the step's.
    """
    record["perf/rollout_tokens_per_s"] = record["perf/rollout_tokens"] / max(rollout_s, 1e-9)
    record["perf/update_tokens_per_s"] = record["perf/update_tokens"] * num_iterations / max(update_s, 1e-9)
    if "perf/update_tokens_forwarded" in record:  # the tokens the trunk ran (shared prefixes once), beside them
        record["perf/update_tokens_forwarded_per_s"] = (record["perf/update_tokens_forwarded"] * num_iterations
                                                        / max(update_s, 1e-9))
    record["perf/tokens_per_s"] = ((record["perf/rollout_tokens"] + record["perf/update_tokens"])
                                   / max(rollout_s + update_s, 1e-9))


def add_update_flops(record: dict[str, float], cost: UpdateCost, *, update_s: float, num_iterations: int,
                     peak_flops: float | None, world_size: int) -> None:
    """The update's useful FLOPs over all ranks from the work ``fastgrpo.update.step.count_update_tokens`` logged,
    counted two ways: ``perf/update_flops``, the sequences' as if unshared (every prompt forwarded with each of its
    completions, as other trainers do), and ``perf/update_flops_forwarded``, what the trunk ran (each shared prefix
    once, its completions' attention over it). With the device's ``peak_flops`` (CUDA): model FLOPs utilisation,
    ``perf/mfu`` of the forwarded FLOPs (the work the hardware did) and ``perf/mfu_sequences`` of the sequences'
    (what compares across trainers), per device: FLOPs / (update seconds * peak * ranks). Nothing without the
    counts (an update that logs none)."""
    if "perf/update_attention_pairs_forwarded" not in record:
        return
    head = record["perf/update_completion_tokens"]
    for key, suffix in (("perf/update_flops", ""), ("perf/update_flops_forwarded", "_forwarded")):
        record[key] = num_iterations * cost.flops(tokens=record[f"perf/update_tokens{suffix}"], head_tokens=head,
                                                  attention_pairs=record[f"perf/update_attention_pairs{suffix}"])
    if peak_flops:
        capacity = max(update_s, 1e-9) * peak_flops * world_size
        record["perf/mfu"] = record["perf/update_flops_forwarded"] / capacity
        record["perf/mfu_sequences"] = record["perf/update_flops"] / capacity
