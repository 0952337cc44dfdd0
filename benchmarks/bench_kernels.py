"""Fused lm_head -> GRPO loss: forward + backward time and peak memory against the alternatives.

    python benchmarks/bench_kernels.py --out results/kernels.csv      # full grid, one H100, < 10 min
    python benchmarks/bench_kernels.py --quick                        # tiny shapes, CPU is fine
    python benchmarks/bench_kernels.py --cpu --out results/kernels_cpu.csv   # CPU mode (below), float32

Methods (same inputs from harness.make_inputs, bf16, DAPO-style token weights, old_logprobs = None):
  ours         fastgrpo.kernels.linear_grpo_loss, backend "auto": on CUDA the "cublas" path (gradient formed in
               forward: three cuBLAS products plus two Triton row kernels); chunked torch on CPU
  ours_recompute  backend "triton": all-Triton, online log-sum-exp forward, logits recomputed in backward (four
               products, no host sync)
  naive        full fp32 logits, log_softmax, gather (reference_linear_grpo_loss; TRL's path before its fused head)
  trl          TRL's own fused head, when trl is installed: the forward ``trl.trainer.utils.add_fused_lm_head``
               installs, patched onto a stand-in model whose backbone returns the benchmark's hidden states, and
               called as TRL's GRPOTrainer calls it (temperature 1, outputs log-probs and entropy, labels -100 where
               the token weight is 0, under autocast in bf16); its chunked log-prob function runs Triton on CUDA
               and folds its tiles in torch on CPU. The same token loss follows (TokenObjective).
  liger        Liger-Kernel's LigerFusedLinearGRPOLoss (chunked torch), when installed
  liger_triton Liger-Kernel's Triton grpo_loss op on materialised bf16 logits, when installed
  floor        three cuBLAS matmuls: hidden @ W.T, dZ @ W, dZ.T @ hidden (what any exact method must do)
Peak MB is CUDA max_memory_allocated above the inputs, gradients included; "over grads MB" subtracts the two
gradients every method must return (N x H and V x H in the inputs' dtype): the method's "extra memory".
The x-floor column is each method's time over the floor's for the same shape. --quick runs do not measure memory.

CPU mode (--cpu): float32 forward + backward at the `issue` shape (N=4096, H=896, V=151936: Qwen2.5-0.5B's head)
and the embedded tiny model's (H=64, V=263), methods called in turn (floor, ours, naive, ...) and repeated, so
that load on a shared machine hits all alike; medians with the spread, and x-floor as the median of each round's
ratio. Extra method there:
  ours_logprobs  fastgrpo.kernels.linear_logprobs (backend "auto", what a caller gets: chunked torch on CPU, the
               Triton recompute path on CUDA) with the loss's upstream gradient: the recompute path (four products)
               that the loss path avoids. (Forcing backend "torch" on CUDA measured 15-21x the floor on an H100:
               that path's products run in float32, without tensor cores; it is the CPU path.)
Memory, from one untimed call per method: "peak MB" is torch's CPU allocator above the inputs (profiler events,
as CUDA's max_memory_allocated), "RSS MB" the process's resident high-water mark above its start, "% [N,V]" the
extra memory over the gradients as a share of one [N, V] float32 tensor.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import platform
import statistics
import sys
import time
import types
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # benchmarks.harness when run as a script; fastgrpo.kernels is installed
    sys.path.insert(0, str(REPO))

from benchmarks.harness import Shape, make_inputs, time_fwd_bwd  # noqa: E402

import fastgrpo.kernels as fk  # noqa: E402

LIGER_T = 1024  # tokens per sequence in the Liger benchmark grid
FULL_SHAPES = (
    [Shape(n=b * LIGER_T, h=4096, v=128256, label=f"liger B={b}") for b in (2, 4, 8, 16)]
    + [Shape(n=n, h=h, v=151936, label=f"qwen2.5 H={h}") for h in (1536, 2048, 3584) for n in (4096, 16384, 32768)]
)
QUICK_SHAPES = [Shape(n=64, h=32, v=509, label="quick"), Shape(n=256, h=72, v=4231, label="quick odd")]
CPU_SHAPES = {  # --cpu-shapes picks by key
    "issue": Shape(n=4096, h=896, v=151936, label="issue (0.5B head)"),
    "tiny": Shape(n=4096, h=64, v=263, label="tiny 32x128"),
    "tiny-demo": Shape(n=1536, h=64, v=263, label="tiny 32x48"),
}
TRL_T = 256  # tokens per sequence in the [B, T] layout TRL's head is given


def _ours(inp, backend="auto"):
    loss, _ = fk.linear_grpo_loss(inp["hidden"], inp["weight"], inp["targets"], inp["advantages"],
                                  inp["token_weights"], backend=backend)
    torch.autograd.grad(loss, (inp["hidden"], inp["weight"]))


class Unavailable(Exception):
    """A method that cannot run here (the row's note says why)."""


def _make_ours_recompute(inp):
    if inp["hidden"].device.type != "cuda":
        raise Unavailable("needs CUDA (the Triton backend)")
    return lambda i: _ours(i, backend="triton")


def _naive(inp):
    loss, _ = fk.reference_linear_grpo_loss(inp["hidden"], inp["weight"], inp["targets"], inp["advantages"],
                                            inp["token_weights"])
    torch.autograd.grad(loss, (inp["hidden"], inp["weight"]))


def _ours_logprobs(inp):
    logp = fk.linear_logprobs(inp["hidden"], inp["weight"], inp["targets"])  # "auto": triton on CUDA, torch on CPU
    torch.autograd.grad((logp * inp["advantages"] * inp["token_weights"]).sum(), (inp["hidden"], inp["weight"]))


class _HiddenStatesLM(torch.nn.Module):
    """A stand-in causal LM for TRL's ``add_fused_lm_head``: its backbone returns fixed hidden states [B, T+1, H] and
    its output embedding is the benchmark's weight, so the patched forward runs TRL's head code on our inputs."""

    def __init__(self, hidden_bt1h, weight):
        from transformers import PretrainedConfig

        super().__init__()
        self.config = PretrainedConfig()
        self._hidden, self._head = hidden_bt1h, types.SimpleNamespace(weight=weight, bias=None)
        self.base_model = lambda **_: types.SimpleNamespace(last_hidden_state=self._hidden)

    def get_output_embeddings(self):
        return self._head

    def forward(self, **kwargs):  # replaced by add_fused_lm_head; never called unpatched here
        raise NotImplementedError


def trl_loss(inp):
    """TRL's fused head as its GRPOTrainer installs and calls it (module docstring), then the token loss:
    ``(loss_fn, leaves)``, where ``loss_fn()`` is the scalar loss and ``leaves`` the (hidden, weight) it flows to."""
    try:
        from trl.trainer.utils import add_fused_lm_head
    except ImportError as exc:
        raise Unavailable("not run: trl not installed (pip install trl)") from exc
    from fastgrpo.kernels import TokenObjective

    b, t_len = _liger_sequences(inp, TRL_T)
    h3 = inp["hidden"].detach().view(b, t_len, -1)
    # GRPOTrainer's labels are the input ids shifted by one: position t's hidden state predicts label t + 1. One
    # extra position per sequence (the last, which predicts nothing) keeps all N rows scored; made once, untimed.
    hidden = torch.cat([h3, h3[:, -1:]], dim=1).requires_grad_()  # [B, T+1, H]
    labels = torch.full((b, t_len + 1), -100, dtype=torch.long, device=h3.device)  # [B, T+1]
    labels[:, 1:] = inp["targets"].view(b, t_len).masked_fill(inp["token_weights"].view(b, t_len) == 0, -100)
    model = _HiddenStatesLM(hidden, inp["weight"])
    add_fused_lm_head(model, temperature=1.0, cast_lm_head_to_fp32=False, outputs=("log_probs", "entropy"))
    bf16 = hidden.device.type == "cuda" and hidden.dtype == torch.bfloat16
    objective = TokenObjective(advantages=inp["advantages"])

    def loss_fn():
        with torch.autocast(hidden.device.type, dtype=torch.bfloat16, enabled=bf16):  # accelerator.autocast()
            out = model(labels=labels, fused_lm_head=True)
        logp = out.log_probs.reshape(-1)  # [N]
        per_token, _, _ = objective.token_loss(logp, inp["token_weights"] != 0)
        return (inp["token_weights"] * per_token).sum()

    return loss_fn, (hidden, inp["weight"])


def _make_trl(inp):
    loss_fn, leaves = trl_loss(inp)
    return lambda _inp: torch.autograd.grad(loss_fn(), leaves)


def _floor(inp):
    h, w = inp["hidden"].detach(), inp["weight"].detach()
    logits = h @ w.T  # [N, V]; stands in for dZ too: same shape and dtype, so the same cost
    logits @ w  # [N, H]
    logits.T @ h  # [V, H]


def _liger_sequences(inp, t_len):
    n, h_dim = inp["hidden"].shape
    if n % t_len:
        t_len = n  # one sequence when N is not a multiple (quick shapes)
    b = n // t_len
    return b, t_len


def _liger_batch(inp):
    """Liger's [B, T] layout: hidden [B, T, H], ids and mask [B, T], one advantage per sequence [B]."""
    b, t_len = _liger_sequences(inp, LIGER_T)
    ids = inp["targets"].view(b, t_len)
    adv = inp["advantages"].view(b, t_len)[:, 0].contiguous()
    return inp["hidden"].view(b, t_len, -1), ids, torch.ones_like(ids), adv


def _make_liger(inp):
    from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

    module = LigerFusedLinearGRPOLoss(beta=0.0, use_ref_model=False)
    h3, ids, mask, adv = _liger_batch(inp)

    def run(_inp):
        out = module(h3, inp["weight"], ids, mask, adv)
        loss = out[0] if isinstance(out, tuple) else out
        torch.autograd.grad(loss, (inp["hidden"], inp["weight"]))

    return run


def _make_liger_triton(inp):
    from liger_kernel.transformers.grpo_loss import triton_grpo_loss

    h3, ids, mask, adv = _liger_batch(inp)

    def run(_inp):
        # The op wants logits for L+1 positions (it drops the last): append one row per sequence.
        logits = torch.cat([h3, h3[:, -1:]], dim=1) @ inp["weight"].T  # [B, T+1, V] bf16
        out = triton_grpo_loss(logits, None, None, ids, adv, mask, temperature=1.0, beta=0.0,
                               eps_low=0.2, eps_high=0.2)
        loss = out[0] if isinstance(out, tuple) else out
        if loss.dim() > 0:
            loss = (loss * mask).sum() / mask.sum()
        torch.autograd.grad(loss, (inp["hidden"], inp["weight"]))

    return run


METHODS = {
    "ours": lambda inp: _ours,
    "ours_recompute": _make_ours_recompute,
    "naive": lambda inp: _naive,
    "liger": _make_liger,
    "liger_triton": _make_liger_triton,
    "floor": lambda inp: _floor,
    "trl": _make_trl,
    "ours_logprobs": lambda inp: _ours_logprobs,
}
CPU_METHODS = ("floor", "ours", "naive", "trl", "liger", "ours_logprobs")


def bench(shapes, *, device, dtype, methods, warmup, reps, zero_weight_frac, budget_s=None) -> list[dict]:
    rows = []
    t_start = time.monotonic()
    for shape in shapes:
        if budget_s is not None and time.monotonic() - t_start > budget_s:
            print(f"  time budget of {budget_s:.0f} s spent: skipping {shape.label} N={shape.n}", flush=True)
            rows += [dict(label=shape.label, n=shape.n, h=shape.h, v=shape.v, method=name, ms="", x_floor="",
                          peak_mb="", over_grads_mb="", note="skipped: time budget") for name in methods]
            continue
        inp = make_inputs(shape, dtype=dtype, device=device, seed=0, zero_weight_frac=zero_weight_frac)
        for name in methods:
            row = dict(label=shape.label, n=shape.n, h=shape.h, v=shape.v, method=name, ms="", x_floor="",
                       peak_mb="", over_grads_mb="", note="")
            try:
                fn = METHODS[name](inp)
                ms, peak = time_fwd_bwd(lambda: fn(inp), warmup=warmup, reps=reps)
                row.update(ms=f"{ms:.2f}", peak_mb="" if peak != peak else f"{peak:.0f}")
                if peak == peak:
                    grads_mb = (shape.n + shape.v) * shape.h * inp["hidden"].element_size() / 2**20
                    row["over_grads_mb"] = f"{peak - grads_mb:.0f}"
            except ImportError as exc:
                row["note"] = f"not installed ({exc.name or exc})"
            except Unavailable as exc:
                row["note"] = str(exc)
            except torch.cuda.OutOfMemoryError:
                row["note"] = "OOM"
            except Exception as exc:  # a baseline's API changed: report, keep going
                row["note"] = f"error: {type(exc).__name__}: {str(exc)[:80]}"
            finally:
                if device == "cuda":
                    torch.cuda.empty_cache()
            rows.append(row)
            print(f"  {shape.label:>18} N={shape.n:<6} {name:<15} {row['ms'] or '-':>9} ms "
                  f"{row['peak_mb'] or '-':>8} MB {row['note']}", flush=True)
        floor = next((r for r in rows[-len(methods):] if r["method"] == "floor" and r["ms"]), None)
        for r in rows[-len(methods):]:
            if floor is not None and r["ms"]:
                r["x_floor"] = f"{float(r['ms']) / float(floor['ms']):.2f}"
        del inp
    return rows


def bench_cpu(shapes, *, methods, reps, zero_weight_frac, budget_s=None) -> list[dict]:
    """CPU mode: per shape, one untimed call per method for memory (also the warm-up), then ``reps`` rounds of
    alternated timed calls (at least one round; none started after ``budget_s`` per shape)."""
    from benchmarks.harness import peak_cpu_alloc_mb, peak_rss_mb, time_alternating

    rows = []
    for shape in shapes:
        inp = make_inputs(shape, dtype=torch.float32, device="cpu", seed=0, zero_weight_frac=zero_weight_frac)
        grads_mb = (shape.n + shape.v) * shape.h * 4 / 2**20
        nv_mb = shape.n * shape.v * 4 / 2**20
        fns, out = {}, {}
        for name in methods:
            row = out[name] = dict(label=shape.label, n=shape.n, h=shape.h, v=shape.v, method=name, s="",
                                   spread="", x_floor="", peak_mb="", over_grads_mb="", pct_nv="", rss_mb="",
                                   rounds=0, note="")
            try:
                fn = METHODS[name](inp)
                call = (lambda f: lambda: f(inp))(fn)
                peak = peak_cpu_alloc_mb(call)
                row.update(peak_mb=f"{peak:.1f}", over_grads_mb=f"{peak - grads_mb:.1f}",
                           pct_nv=f"{100 * (peak - grads_mb) / nv_mb:.1f}", rss_mb=f"{peak_rss_mb(call):.1f}")
                fns[name] = call
            except ImportError as exc:
                row["note"] = f"not installed ({exc.name or exc})"
            except Unavailable as exc:
                row["note"] = str(exc)
            except Exception as exc:  # a baseline's API changed: report, keep going
                row["note"] = f"error: {type(exc).__name__}: {str(exc)[:80]}"
            print(f"  {shape.label:>18} {name:<14} peak {row['peak_mb'] or '-':>9} MB  "
                  f"({row['pct_nv'] or '-'} % of [N,V] over grads) {row['note']}", flush=True)
        times = time_alternating(fns, reps=reps, budget_s=budget_s)
        for name, ts in times.items():
            row = out[name]
            ratios = [t / f for t, f in zip(ts, times.get("floor", []))]
            row.update(s=f"{statistics.median(ts):.4g}", spread=f"{min(ts):.4g}-{max(ts):.4g}", rounds=len(ts),
                       x_floor=f"{statistics.median(ratios):.2f}" if ratios else "")
            print(f"  {shape.label:>18} {name:<14} {row['s']:>9} s  [{row['spread']}]  x floor {row['x_floor']}",
                  flush=True)
        rows += out.values()
        del inp, fns
    return rows


def markdown_cpu(rows: list[dict]) -> str:
    lines = ["| shape | N | H | V | method | s (median) | spread | rounds | x floor | peak MB | over grads MB "
             "| % of [N,V] f32 | RSS MB | note |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['label']} | {r['n']} | {r['h']} | {r['v']} | {r['method']} | {r['s'] or '-'} "
                     f"| {r['spread'] or '-'} | {r['rounds']} | {r['x_floor'] or '-'} | {r['peak_mb'] or '-'} "
                     f"| {r['over_grads_mb'] or '-'} | {r['pct_nv'] or '-'} | {r['rss_mb'] or '-'} | {r['note']} |")
    return "\n".join(lines)


def markdown(rows: list[dict]) -> str:
    lines = ["| shape | N | H | V | method | fwd+bwd ms | x floor | peak MB | over grads MB | note |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['label']} | {r['n']} | {r['h']} | {r['v']} | {r['method']} | {r['ms'] or '-'} "
                     f"| {r['x_floor'] or '-'} | {r['peak_mb'] or '-'} | {r['over_grads_mb'] or '-'} | {r['note']} |")
    return "\n".join(lines)


def _write_csv(path: Path, header: str, rows: list[dict]) -> None:
    """The rows as CSV under a ``# header`` line (device, versions, date, command)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        f.write(f"# {header}\n")
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def _shape_arg(text: str) -> Shape:
    """``--shape N,H,V`` -> a Shape labelled with its H."""
    try:
        n, h, v = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shape wants N,H,V (three integers), got {text!r}") from None
    if min(n, h, v) < 1:
        raise argparse.ArgumentTypeError(f"--shape: N, H and V must be >= 1, got {text!r}")
    return Shape(n=n, h=h, v=v, label=f"H={h}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes; runs on CPU")
    parser.add_argument("--cpu", action="store_true", help="CPU mode: float32, alternated rounds, memory per method")
    parser.add_argument("--cpu-shapes", default=",".join(CPU_SHAPES), help="CPU mode: subset of " + ",".join(CPU_SHAPES))
    parser.add_argument("--out", type=Path, help="CSV output path")
    parser.add_argument("--shape", action="append", type=_shape_arg, metavar="N,H,V",
                        help="GPU mode: run this shape instead of the full grid (repeatable)")
    parser.add_argument("--methods", default=None,
                        help=f"comma-separated subset of {','.join(METHODS)} (default: all; --cpu: {','.join(CPU_METHODS)})")
    parser.add_argument("--zero-weight-frac", type=float, default=0.0, help="fraction of tokens with weight 0")
    parser.add_argument("--reps", type=int, default=5, help="timed calls per method (--cpu: alternated rounds)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--budget-s", type=float, default=None,
                        help="start no new shape after this many seconds (the rest are listed as skipped); "
                             "--cpu: no new round of a shape after this many seconds")
    args = parser.parse_args(argv)

    cuda = torch.cuda.is_available() and not args.cpu
    if not args.quick and not args.cpu and not cuda:
        print("bench_kernels: the full grid needs a CUDA GPU (none found); use --cpu or --quick (smoke run)")
        return 2
    methods_arg = args.methods or ",".join(CPU_METHODS if args.cpu else METHODS)
    methods = [m.strip() for m in methods_arg.split(",") if m.strip()]
    unknown = set(methods) - set(METHODS)
    if unknown:
        parser.error(f"unknown methods {sorted(unknown)}; choose from {list(METHODS)}")
    if args.cpu:
        return _main_cpu(args, methods, parser)
    device = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16 if cuda else torch.float32
    shapes = args.shape or (QUICK_SHAPES if args.quick else FULL_SHAPES)
    dev_name = torch.cuda.get_device_name() if cuda else platform.processor() or "cpu"
    header = (f"device: {dev_name}; torch {torch.__version__}; dtype {dtype}; "
              f"date {datetime.datetime.now().isoformat(timespec='seconds')}; "
              f"command: {' '.join(sys.argv)}")
    print(header, flush=True)
    rows = bench(shapes, device=device, dtype=dtype, methods=methods, warmup=args.warmup, reps=args.reps,
                 zero_weight_frac=args.zero_weight_frac, budget_s=args.budget_s)
    print()
    print(markdown(rows))
    if args.out is not None:
        _write_csv(args.out, header, rows)
    return 0


def _main_cpu(args, methods, parser) -> int:
    keys = [k.strip() for k in args.cpu_shapes.split(",") if k.strip()]
    unknown = set(keys) - set(CPU_SHAPES)
    if unknown:
        parser.error(f"unknown --cpu-shapes {sorted(unknown)}; choose from {list(CPU_SHAPES)}")
    header = (f"device: cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads); "
              f"torch {torch.__version__}; dtype float32; date {datetime.datetime.now().isoformat(timespec='seconds')}; "
              f"command: {' '.join(sys.argv)}")
    print(header, flush=True)
    rows = bench_cpu([CPU_SHAPES[k] for k in keys], methods=methods, reps=args.reps,
                     zero_weight_frac=args.zero_weight_frac, budget_s=args.budget_s)
    print()
    print(markdown_cpu(rows))
    if args.out is not None:
        _write_csv(args.out, header, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
