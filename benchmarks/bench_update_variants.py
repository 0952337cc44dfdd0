"""The policy update in its variants, side by side on one device: float32 weights under autocast (the
one-GPU default), bf16 compute weights with float32 masters, + compiled blocks (static shapes), + CUDA graphs.

Per work (S sequences of prompt P + completion L tokens) and variant: seconds per update (median of the timed
updates after warm-up) and of its optimizer step alone, MFU (``fastgrpo.runtime.step_cost.update_flops`` / time / the
card's bf16 peak), peak memory and what stays allocated between updates, the compile counters (graph breaks, graphs
compiled) and the CUDA-graph counters of eager blocks (row shapes captured, block calls replayed) and of the head
loss (row counts captured, head calls replayed) after the run. A
variant that fails is a row with the error's first line, and its whole traceback (dynamo's explanation included)
goes to the output. ``--profile`` variants also get one more update under torch.profiler: the kernels launched, the
device's busy time against the update's wall time (a gap is host dispatch), and the top kernels by device time.
Every variant runs the trainer's own update (``build_trained`` -> ``grpo_update``), on a random-weight model of a
``benchmarks/peer_work.SHAPES`` shape (or the tiny model). TRL's update on the same works is ``bench_trl.py
--update-only`` (benchmarks/gpu_update_variants.sh runs both).

    python benchmarks/bench_update_variants.py                       # a GPU: Qwen2.5-0.5B shapes, the three works
    python benchmarks/bench_update_variants.py --smoke               # a CPU: the tiny model, a few seconds

On a CPU the figures are not the point (bf16 matmuls are slow there); ``--smoke`` checks that every variant that can
run here sets up and trains, and prints the compile counters.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from benchmarks.peer_work import SHAPES, build_model_folder  # noqa: E402
from fastgrpo.algorithms.grpo import GRPOBatch, grpo_update  # noqa: E402
from fastgrpo.config import GRPOConfig, OptimConfig, ParallelConfig, RolloutConfig  # noqa: E402
from fastgrpo.models.attention import choose_attn_implementation, register_with_transformers  # noqa: E402
from fastgrpo.models.packing import resolve_buckets  # noqa: E402
from fastgrpo.runtime.metrics import StepMetrics  # noqa: E402
from fastgrpo.runtime.peaks import device_peak_flops  # noqa: E402
from fastgrpo.runtime.step_cost import update_flops  # noqa: E402
from fastgrpo.update.bundle import build_trained  # noqa: E402

WORKS = {  # name: (sequences, prompt tokens, completion tokens)
    "s8": (8, 272, 32),  # the small, dispatch-bound work: 2,432 tokens
    "s64": (64, 272, 136),  # 26,112 tokens
    "long": (32, 272, 1024),  # long completions: 41,472 tokens
    "tiny": (6, 12, 20),  # --smoke
}


def variants(budget: int) -> dict[str, dict]:
    """Variant name -> ParallelConfig fields, the most telling first. Eager CUDA graphs need explicit buckets: the
    auto ones of the budget; ``bf16-masters+buckets`` pads to them without graphs (what the padding alone costs)."""
    buckets = resolve_buckets("auto", budget)
    return {
        "autocast": {},
        "bf16-masters": {"master_weights": True},
        "bf16-masters+compile": {"master_weights": True, "compile": True},
        "bf16-masters+graphs": {"master_weights": True, "cuda_graphs": True, "token_buckets": buckets},
        # the blocks graphed, the head loss eager: what the head's graphs add
        "bf16-masters+block-graphs": {"master_weights": True, "cuda_graphs": True, "cuda_graphs_head": False,
                                      "token_buckets": buckets},
        "compile": {"compile": True},
        "bf16-masters+compile+graphs": {"master_weights": True, "compile": True, "cuda_graphs": True},
        "bf16-masters+buckets": {"master_weights": True, "token_buckets": buckets},
    }


@dataclass
class Row:
    work: str
    variant: str
    tokens: int
    update_s: float | None = None
    mfu: float | None = None
    peak_gib: float | None = None
    held_gib: float | None = None
    optimizer_s: float | None = None
    graph_breaks: int = 0
    graphs: int = 0
    captured: int = 0
    replays: int = 0
    head_captured: int = 0
    head_replays: int = 0
    error: str = ""


def _batch(work: str, seed: int) -> GRPOBatch:
    s, p, c = WORKS[work]
    r = random.Random(seed)
    return GRPOBatch(prompt_ids=[[r.randrange(3, 250) for _ in range(p)] for _ in range(s)],
                     completion_ids=[[r.randrange(3, 250) for _ in range(c)] for _ in range(s)],
                     advantages=torch.randn(s, generator=torch.Generator().manual_seed(seed)))


class _StepTimer:
    """Times ``optimizer.step`` inside the update: CUDA events on a GPU (read after the update's sync, so no sync is
    added), the host clock on a CPU."""

    def __init__(self, optimizer: torch.optim.Optimizer, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: list = []
        step = optimizer.step

        def timed(*args, **kwargs):
            start = torch.cuda.Event(enable_timing=True) if self.cuda else time.perf_counter()
            if self.cuda:
                start.record()
            out = step(*args, **kwargs)
            end = torch.cuda.Event(enable_timing=True) if self.cuda else time.perf_counter()
            if self.cuda:
                end.record()
            self.marks.append((start, end))
            return out

        optimizer.step = timed

    def take(self) -> float:
        """Seconds in optimizer.step since the last call (after the device synchronised)."""
        total = sum(a.elapsed_time(b) / 1e3 if self.cuda else b - a for a, b in self.marks)
        self.marks.clear()
        return total


def _profile(update, sync, device: torch.device, top: int) -> str:
    """One more update under torch.profiler: kernels launched, device busy time against wall time, top kernels."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    sync()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        update(10_000)
        sync()
    wall = time.perf_counter() - t0
    events = prof.key_averages()
    if not cuda:
        return events.table(sort_by="self_cpu_time_total", row_limit=top)
    kernels = [e for e in events if e.device_type == DeviceType.CUDA]
    busy = sum(getattr(e, "self_device_time_total", 0) or getattr(e, "self_cuda_time_total", 0)
               for e in kernels) / 1e6
    head = (f"kernels launched {sum(e.count for e in kernels):,}, device busy {busy:.4f} s of {wall:.4f} s wall "
            f"(profiled; the gap is the host)")
    for key in ("self_device_time_total", "self_cuda_time_total"):
        try:
            return head + "\n" + events.table(sort_by=key, row_limit=top)
        except (AttributeError, KeyError, ValueError):
            continue
    return head


def run(folder: Path, work: str, variant: str, fields: dict, *, device: torch.device, budget: int, warmup: int,
        steps: int, profile_top: int = 0) -> Row:
    s, p, c = WORKS[work]
    row = Row(work=work, variant=variant, tokens=s * (p + c))
    torch._dynamo.reset()
    counters.clear()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    model = runner = None
    try:
        register_with_transformers()
        model = AutoModelForCausalLM.from_pretrained(
            folder, dtype=torch.float32, attn_implementation=choose_attn_implementation("auto", device)).train()
        parallel = ParallelConfig(**fields)
        parallel.validate("parallel")
        trained = build_trained(model, parallel=parallel, optim=OptimConfig(lr=1e-6), device=device, world_size=1,
                                total_steps=warmup + steps + 1)
        model, runner = trained.model, trained.runner
        timer = _StepTimer(trained.optimizer, device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)

        def update(seed: int) -> None:
            grpo_update(trained.runner, _batch(work, seed=seed), grpo=GRPOConfig(max_tokens_per_microbatch=budget),
                        rollout=RolloutConfig(max_completion_length=c), optimizer=trained.optimizer,
                        scheduler=trained.scheduler, max_grad_norm=1.0, metrics=StepMetrics(), device=device)

        times, optimizer_times = [], []
        for i in range(warmup + steps):
            sync()
            t0 = time.perf_counter()
            update(i)
            sync()
            if i >= warmup:
                times.append(time.perf_counter() - t0)
                optimizer_times.append(timer.take())
            timer.take()
        row.update_s = statistics.median(times)
        row.optimizer_s = statistics.median(optimizer_times)
        peak = device_peak_flops(device)
        if peak:
            row.mfu = update_flops(trained.model, [p] * s, [c] * s) / row.update_s / peak
        if device.type == "cuda":
            row.peak_gib = torch.cuda.max_memory_allocated(device) / 2**30
            row.held_gib = torch.cuda.memory_allocated(device) / 2**30  # between updates: weights, state, graphs
        if profile_top:
            print(f"--- profile: {work} {variant}\n{_profile(update, sync, device, profile_top)}", flush=True)
    except Exception as e:  # one failed variant is a row, not the end of the table
        row.error = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
        print(f"--- {work} {variant} failed:\n{traceback.format_exc()}", flush=True)
    row.graph_breaks = sum(counters["graph_break"].values())
    row.graphs = counters["stats"]["unique_graphs"]
    graphs = runner.block_graphs if runner is not None else None
    if graphs is not None:
        row.captured, row.replays = graphs.captures, graphs.replays
    heads = runner.head_graphs if runner is not None else None
    if heads is not None:
        row.head_captured, row.head_replays = heads.captures, heads.replays
    return row


def table(rows: list[Row]) -> str:
    lines = ["| work | variant | tokens | update s | optimizer s | MFU | peak GiB | held GiB | graph breaks | "
             "graphs compiled | CUDA graph shapes (replays) | head graph shapes (replays) | error |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        def fmt(x, f):
            return "n/a" if x is None else format(x, f)
        lines.append(f"| {r.work} | {r.variant} | {r.tokens:,} | {fmt(r.update_s, '.4f')} | "
                     f"{fmt(r.optimizer_s, '.4f')} | {'n/a' if r.mfu is None else f'{100 * r.mfu:.1f}%'} | "
                     f"{fmt(r.peak_gib, '.2f')} | {fmt(r.held_gib, '.2f')} | {r.graph_breaks} | {r.graphs} | "
                     f"{r.captured} ({r.replays:,}) | {r.head_captured} ({r.head_replays:,}) | {r.error} |")
    return "\n".join(lines)


def _write(out: Path, rows: list[Row], head: str) -> None:
    """OUT.json and OUT.md, each written atomically."""
    out.parent.mkdir(parents=True, exist_ok=True)
    for suffix, body in ((".json", json.dumps([asdict(r) for r in rows], indent=1)),
                         (".md", f"{head}\n\n{table(rows)}\n")):
        tmp_path = out.with_suffix(suffix + ".tmp")
        tmp_path.write_text(body)
        tmp_path.replace(out.with_suffix(suffix))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen2.5-0.5b", help=f"'tiny' or one of {sorted(SHAPES)}")
    ap.add_argument("--works", default="s64,s8,long", help=f"comma list of {sorted(WORKS)} (in this order)")
    ap.add_argument("--variants", default=None, help="comma list (default: every variant the device runs)")
    ap.add_argument("--budget", type=int, default=8192, help="micro-batch token budget")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--profile", default="", help="comma list of variants to profile once more after timing")
    ap.add_argument("--profile-top", type=int, default=15, help="kernels listed per profile")
    ap.add_argument("--smoke", action="store_true", help="CPU check: tiny model, work 'tiny', 1 + 1 updates")
    ap.add_argument("--out", default=None, help="write OUT.json and OUT.md")
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.smoke:
        args.shape, args.works, args.warmup, args.steps, args.budget = "tiny", "tiny", 1, 1, 64
    chosen = variants(args.budget)
    names = args.variants.split(",") if args.variants else [
        n for n, f in chosen.items() if device.type == "cuda" or not f.get("cuda_graphs")]
    profiled = set(filter(None, args.profile.split(",")))
    unknown = [n for n in [*names, *profiled] if n not in chosen] + [w for w in args.works.split(",") if w not in WORKS]
    if unknown:
        ap.error(f"unknown variant or work: {', '.join(unknown)}")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    head = (f"{name}, torch {torch.__version__}, shape {args.shape}, budget {args.budget} tokens, "
            f"{args.warmup} warm-up + {args.steps} timed updates (median)")
    rows: list[Row] = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = build_model_folder(args.shape, Path(tmp) / args.shape, seed=0)
        for work in args.works.split(","):
            for variant in names:
                rows.append(run(folder, work, variant, chosen[variant], device=device, budget=args.budget,
                                warmup=args.warmup, steps=args.steps,
                                profile_top=args.profile_top if variant in profiled else 0))
                print(table(rows[-1:]).splitlines()[-1], flush=True)
                if args.out:  # after every row: a step cut short by its time limit keeps what it measured
                    _write(Path(args.out), rows, head)
    print(f"\n{head}\n\n{table(rows)}")
    return 1 if any(r.error for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
