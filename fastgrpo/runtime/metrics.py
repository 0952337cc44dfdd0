"""Metrics: device-side accumulation, one reduction per step, and sinks (progress bar, jsonl, wandb).

Inside a micro-batch nothing leaves the device: values are added as tensors into a StepMetrics and only
``StepMetrics.reduce()`` (once per step) all-reduces across ranks and converts to Python floats, in one read.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from fastgrpo.runtime.errors import DiskFullError, is_disk_full
from fastgrpo.runtime.files import write_atomic


# Dense bf16 peak FLOP/s by device-name substring (vendor data sheets, no sparsity).
PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12, "L4": 121e12}


def _by_device_name(table: dict[str, float], device: torch.device | str) -> float | None:
    """The first value of ``table`` whose key is in the CUDA device's name; None off CUDA or for an unknown GPU."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in table.items() if k in name), None)


def device_peak_flops(device: torch.device | str) -> float | None:
    """The device's dense bf16 peak FLOP/s, or None off CUDA / for an unknown GPU (then no MFU is reported)."""
    return _by_device_name(PEAK_BF16, device)


# Peak memory bandwidth in bytes/s by device-name substring, most specific first (vendor data sheets).
PEAK_BANDWIDTH = {"H200": 4.8e12, "H100 PCIe": 2.0e12, "H100": 3.35e12, "A100-PCIE-40GB": 1.555e12,
                  "A100": 2.039e12, "L40S": 0.864e12, "A10G": 0.6e12, "L4": 0.3e12}


def device_peak_bandwidth(device: torch.device | str) -> float | None:
    """The device's peak memory bandwidth in bytes/s, or None off CUDA / for an unknown GPU."""
    return _by_device_name(PEAK_BANDWIDTH, device)


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


def drop_records_after(path: Path, step: int) -> None:
    """Remove records with ``step`` > step from a jsonl log (atomically), so a resumed run does not log twice.

    A last line that is not valid JSON is what a run killed in the middle of a write leaves: it is dropped (with a
    note). An invalid line elsewhere was not written by a kill: ValueError naming the file and the line.
    """
    if not path.is_file():
        return
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines(keepends=True)
    kept = []
    for i, ln in enumerate(lines):
        if not ln.strip():
            continue
        try:
            record = json.loads(ln)
        except ValueError:
            if i == len(lines) - 1:
                print(f"[fastgrpo] {path}: dropping a torn last line (a run killed while writing it)", flush=True)
                continue
            raise ValueError(f"{path} line {i + 1} is not valid JSON; fix or delete that line to resume") from None
        if isinstance(record, dict) and record.get("step", 0) <= step:
            kept.append(ln if ln.endswith("\n") else ln + "\n")  # the next append must start a new line
    if kept != lines:
        write_atomic(path, "".join(kept))


def json_safe(value: Any) -> Any:
    """``value`` with every number a JSON number: JSON has no NaN or Infinity (Python writes them, and strict readers
    reject the line), so a non-finite number becomes null; tensors and numpy scalars become floats."""
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if value is None or isinstance(value, (str, bool, int)):
        return value
    value = float(value)
    return value if math.isfinite(value) else None


class JsonlSink:
    """Appends one JSON object per line (non-finite numbers as null); flushed per write so a killed run keeps every
    finished step."""

    @classmethod
    def for_run(cls, run_dir: Path, *, name: str, project: str, config: dict) -> "JsonlSink":
        return cls(run_dir / "metrics.jsonl")

    @staticmethod
    def check_available() -> None:
        pass

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._f = open(path, "a", encoding="utf-8")

    def write(self, record: dict) -> None:
        try:
            self._f.write(json.dumps(json_safe(record), allow_nan=False) + "\n")
            self._f.flush()
        except OSError as e:
            if is_disk_full(e):
                raise DiskFullError(f"no space left on the device while writing {self.path}; free some space "
                                    "and run the same command again (it resumes from the last checkpoint)") from None
            raise

    def close(self) -> None:
        try:
            self._f.close()
        except OSError:  # the failed flush of a full disk again; already reported by write()
            pass


def check_wandb_available() -> None:
    """Fail early, with the install command, when report_to names wandb but it is not installed."""
    try:
        import wandb  # noqa: F401
    except ImportError:
        raise ImportError("log.report_to includes 'wandb' but wandb is not installed: "
                          "pip install 'fastgrpo[wandb]'  (or remove wandb from log.report_to)") from None


class WandbSink:
    """wandb run; offline mode when no API key is configured, so a run never blocks on a login prompt."""

    @classmethod
    def for_run(cls, run_dir: Path, *, name: str, project: str, config: dict) -> "WandbSink":
        return cls(project, name, config, run_dir)

    check_available = staticmethod(check_wandb_available)

    def __init__(self, project: str, name: str, config: dict, run_dir: Path) -> None:
        check_wandb_available()
        import wandb

        mode = None
        if not os.environ.get("WANDB_API_KEY") and not os.environ.get("WANDB_MODE"):
            mode = "offline"
        self._run = wandb.init(project=project, name=name, config=config, dir=str(run_dir), mode=mode,
                               resume="allow")

    def write(self, record: dict) -> None:
        step = int(record.get("step", 0))
        self._run.log({k: v for k, v in record.items() if k != "step"}, step=step)

    def close(self) -> None:
        self._run.finish()


class ProgressBar:
    """tqdm bar: step, ETA and those of reward (GRPO), loss (SFT), completion length, tokens/s the record has."""

    FIELDS = (("reward", "reward/mean", "{:.3f}"), ("loss", "sft/nll", "{:.3f}"), ("len", "completion/len_mean", "{:.0f}"),
              ("tok/s", "perf/tokens_per_s", "{:.0f}"))

    def __init__(self, total: int, initial: int, enabled: bool, desc: str = "grpo") -> None:
        from tqdm.auto import tqdm

        self._bar = tqdm(total=total, initial=initial, disable=not enabled, desc=desc, unit="step",
                         dynamic_ncols=True)

    def update(self, record: dict, advance: bool = True) -> None:
        self._bar.set_postfix({name: fmt.format(record[key]) for name, key, fmt in self.FIELDS if key in record},
                              refresh=not advance)
        if advance:
            self._bar.update(1)

    def write(self, msg: str) -> None:
        self._bar.write(msg)

    def close(self) -> None:
        self._bar.close()


SINKS: dict[str, type] = {"jsonl": JsonlSink, "wandb": WandbSink}
"""Metric sink name (the choices of log.report_to) -> class with ``for_run(run_dir, name=, project=, config=)``,
``check_available()``, ``write(record)`` and ``close()``."""


class RunLog:
    """Rank 0's outputs of a run: the metric sinks, completions.jsonl and the progress bar (all no-ops elsewhere).

    A resumed run redoes the steps after its checkpoint, so records after ``step`` are dropped first.
    """

    def __init__(self, run_dir: Path, *, report_to: list[str], name: str, project: str, config: dict,
                 step: int, max_steps: int, enabled: bool, progress: bool, desc: str = "grpo") -> None:
        self.sinks: list = []
        self.completions = None
        if enabled:
            run_dir.mkdir(parents=True, exist_ok=True)
            for log in ("metrics.jsonl", "completions.jsonl"):
                drop_records_after(run_dir / log, step)
            try:  # atomic: a full disk leaves the old config.json whole, and the run can resume once there is room
                write_atomic(run_dir / "config.json", json.dumps(config, indent=2))
            except OSError as e:
                if not is_disk_full(e):
                    raise
                raise DiskFullError(f"no space left on the device while writing {run_dir / 'config.json'} (the "
                                    "previous one is intact); free some space and run the same command again") \
                    from None
            self.sinks = [SINKS[s].for_run(run_dir, name=name, project=project, config=config) for s in report_to]
            self.completions = JsonlSink(run_dir / "completions.jsonl")
        self.bar = ProgressBar(max_steps, step, enabled=enabled and progress, desc=desc)

    def write(self, record: dict, completions: list[dict], advance: bool = True) -> None:
        """Log one record; ``advance=False`` for one that is no step (an evaluation before the first)."""
        for s in self.sinks:
            s.write(record)
        if self.completions is not None:
            for row in completions:
                self.completions.write(row)
        self.bar.update(record, advance=advance)

    def close(self) -> None:
        self.bar.close()
        for s in self.sinks:
            s.close()
        if self.completions is not None:
            self.completions.close()


def add_throughput(record: dict[str, float], *, rollout_s: float, update_s: float, num_iterations: int) -> None:
    """Tokens per second of the rollout, the update (all num_iterations passes) and the whole step.

    Token counts are totals over ranks; ranks run in lockstep, so rank 0's seconds are the step's.
    """
    record["perf/rollout_tokens_per_s"] = record["perf/rollout_tokens"] / max(rollout_s, 1e-9)
    record["perf/update_tokens_per_s"] = record["perf/update_tokens"] * num_iterations / max(update_s, 1e-9)
    record["perf/tokens_per_s"] = ((record["perf/rollout_tokens"] + record["perf/update_tokens"])
                                   / max(rollout_s + update_s, 1e-9))
