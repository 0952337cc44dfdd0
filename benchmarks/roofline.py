"""A model, not a measurement: predicted time of every kernel of each loss path on an H100 / H200.

    python benchmarks/roofline.py                               # compiles the kernels for sm_90 first (~1 min)
    python benchmarks/roofline.py --hopper-json /tmp/hopper.json  # or reads check_hopper.py --json output
    python benchmarks/roofline.py --hopper-json benchmarks/hopper_sm90.json --measured results/bench_kernels.csv
                                                # model next to bench_kernels.py's times (what run_gpu.sh runs)

Paths (forward + backward of the GRPO loss, bf16, every token weighted, V = 151936):
  floor            three cuBLAS products on all N rows (what any exact method must do)
  cublas           ``backend="cublas"`` (kernels/_gradfwd.py): the three products per chunk plus two row kernels
  triton           ``backend="triton"`` (kernels/_triton.py): four Triton products (forward, dlogits, dhidden,
                   dweight), with the launch schedule of the code as it is
  triton-before    the same kernels with the naive schedule (pid_m / pid_v fast grids, 2 programs per SM
                   assumed, unbalanced chunks, no split-K, dW zeroed / read-modify-written / converted per chunk)
  liger-flce       Liger-Kernel's fused linear cross entropy (chunk = next_pow2(N / ceil(V / H)) rows, cuBLAS
                   products per chunk, grad_weight accumulated in the weight's dtype), modelled the same way

Per kernel launch: ``time = max(FLOPs / (peak x mma efficiency x wave efficiency), HBM bytes / (bandwidth x hbm
efficiency)) + exposed epilogue + launch``. Wave efficiency = programs / (waves x resident programs), resident =
SMs x CTAs per SM from the sm_90 compile (registers, shared memory). HBM bytes follow the launch order: operands
that the resident programs share are read once when their working set fits half the L2, else once per reuse.
Exposed epilogue: kernels with one CTA per SM run in lockstep waves, so a program's softmax arithmetic (fp32 and
MUFU throughput per SM) and its end-of-program memory traffic are not hidden behind another program's MMA.
cuBLAS products are modelled without wave quantization (its heuristics and split-K / stream-K kernels are assumed
to avoid tails). The constants in ``Assumptions`` are guesses to be calibrated by the first GPU run: the floor row
measures ``cublas_mma`` directly.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks import check_hopper  # noqa: E402

_triton = check_hopper._load_triton_backend()
from fastgrpo.kernels import _gradfwd, _schedule  # noqa: E402

V = 151936
SHAPES = [(n, h) for h in (2048, 3584) for n in (4096, 16384)]
ELT = 2  # bf16


@dataclass(frozen=True)
class Device:
    name: str
    flops: float  # dense bf16 peak, FLOP/s
    hbm: float  # bytes/s
    sms: int
    l2: int  # bytes
    clock: float = 1.83e9  # Hz at which the peak is quoted (4096 dense bf16 FLOP / clock / SM)


DEVICES = {
    "h100": Device("H100 SXM", 989e12, 3.35e12, 132, 50 << 20),
    "h200": Device("H200 SXM", 989e12, 4.8e12, 132, 50 << 20),
}


@dataclass(frozen=True)
class Assumptions:
    """Efficiencies the model cannot derive; each is a guess until a GPU run calibrates it."""

    cublas_mma: float = 0.80  # cuBLAS bf16 GEMM, large shapes, fraction of peak
    triton_mma: float = 0.70  # Triton 128x128x64 wgmma mainloop with cp.async loads (no TMA, no warp specialisation)
    hbm: float = 0.90  # streaming kernels, fraction of peak bandwidth
    launch_s: float = 4e-6  # per launch, back to back in one stream
    fp32_per_clk: int = 128  # fp32 lanes per SM per clock
    mufu_per_clk: int = 16  # exp2 per SM per clock
    fwd_ops: int = 10  # fp32 ops per logit in the forward's online softmax (scale, mask, max, sub, sums, ...)
    dlogits_ops: int = 16  # ... in _dlogits_kernel (softmax, onehot, entropy term, scale, convert)


@dataclass
class Launch:
    kernel: str
    flops: float = 0.0
    bytes: float = 0.0
    wave_eff: float = 1.0
    exposed_s: float = 0.0
    mma: str = "triton"  # which efficiency applies to the FLOPs
    launches: int = 1

    def seconds(self, dev: Device, a: Assumptions) -> float:
        mma = a.cublas_mma if self.mma == "cublas" else a.triton_mma
        compute = self.flops / (dev.flops * mma * self.wave_eff)
        memory = self.bytes / (dev.hbm * a.hbm)
        return max(compute, memory) + self.exposed_s + self.launches * a.launch_s


@dataclass
class LossPath:
    name: str
    launches: list[Launch] = field(default_factory=list)

    def seconds(self, dev, a) -> float:
        return sum(x.seconds(dev, a) for x in self.launches)

    def by_kernel(self, dev, a) -> dict[str, float]:
        out: dict[str, float] = {}
        for x in self.launches:
            out[x.kernel] = out.get(x.kernel, 0.0) + x.seconds(dev, a)
        return out


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def wave_eff(programs: int, slots: int) -> float:
    return programs / (cdiv(programs, slots) * slots) if programs else 1.0


def fits(bytes_: float, dev: Device) -> bool:
    return bytes_ <= dev.l2 // 2


def epilogue_alu_s(elements: float, ops: int, dev: Device, a: Assumptions) -> float:
    cycles = elements * (ops / a.fp32_per_clk + 1 / a.mufu_per_clk)
    return cycles / (dev.sms * dev.clock)


# ----------------------------------------------------------------------------------------------- paths


def gemm(kernel: str, m: int, n: int, k: int, extra_bytes: float = 0.0) -> Launch:
    """A cuBLAS product [m, k] x [k, n]: reads both operands once, writes the output once."""
    return Launch(kernel, flops=2.0 * m * n * k, bytes=ELT * (m * k + k * n + m * n) + extra_bytes, mma="cublas")


def floor_path(n: int, h: int) -> LossPath:
    return LossPath("floor", [gemm("logits = hidden @ W.T", n, V, h), gemm("grad_hidden = dZ @ W", n, h, V),
                           gemm("grad_W = dZ.T @ hidden", V, h, n)])


def cublas_path(n: int, h: int) -> LossPath:
    chunk = min(max(1, _gradfwd._BUFFER_BYTES // (V * ELT)), n)
    p = LossPath("cublas")
    small = 24  # index_select / index_copy / the closed-form token gradient: [c]-sized kernels per chunk
    acc32 = cdiv(n, chunk) > _gradfwd._BF16_SUM_MAX_CHUNKS  # grad_W summed in a float32 [V, H] buffer
    for i, start in enumerate(range(0, n, chunk)):
        c = min(chunk, n - start)
        p.launches += [
            Launch("gather rows + small ops", bytes=2 * ELT * c * h, launches=small, mma="cublas"),
            gemm("product 1 (logits)", c, V, h),
            Launch("_rowstats_kernel", bytes=ELT * c * V),
            Launch("_softmax_grad_kernel", bytes=2 * ELT * c * V),
            gemm("product 2 (grad_hidden)", c, h, V),
        ]
        if acc32:  # product into grad_W (scratch), then acc32 (+)= it: reads ELT + 4, writes 4 bytes per entry
            p.launches += [gemm("product 3 (grad_W, mm)", V, h, c),
                           Launch("float32 grad_W sum", bytes=(ELT + (4 if i else 0) + 4) * V * h)]
        else:
            p.launches.append(gemm("product 3 (grad_W, addmm)", V, h, c,
                                   extra_bytes=0 if i == 0 else ELT * V * h))  # reads C
    if acc32:
        p.launches.append(Launch("grad_W <- float32 sum", bytes=(4 + ELT) * V * h))
    p.launches.append(Launch("_scale_kernel (x2, return at once)", launches=2))
    return p


def triton_path(n: int, h: int, dev: Device, a: Assumptions, ctas: dict[str, int], *, before: bool = False) -> LossPath:
    cfg = _triton.GPU_BLOCKS
    bm, bv, bh, bk = cfg["BLOCK_M"], cfg["BLOCK_V"], cfg["BLOCK_H"], cfg["BLOCK_K"]
    p = LossPath("triton-before" if before else "triton")
    w_bytes, h_bytes = ELT * V * h, ELT * n * h
    n_tiles, row_blocks = cdiv(V, bv), cdiv(n, bm)

    # forward
    slots = dev.sms * ctas["_fwd_kernel"]
    if before:
        splits = min(n_tiles, max(1, cdiv(2 * dev.sms, row_blocks)))
        per = cdiv(n_tiles, splits)
        splits = cdiv(n_tiles, per)
        # pid_m fast: all row blocks of a split are resident together and re-read their hidden rows every tile,
        # from HBM when they do not fit: once per vocabulary tile over all splits
        hidden_traffic = h_bytes if fits(h_bytes, dev) else h_bytes * per * splits
        weight_traffic = w_bytes * cdiv(row_blocks, slots)
    else:
        splits, per = _schedule.fwd_splits(n, V, bm, bv, slots)
        group = _schedule.l2_group(bm * h * ELT, row_blocks, dev.l2)
        hidden_traffic = h_bytes
        weight_traffic = w_bytes * cdiv(row_blocks, group)
    programs = row_blocks * splits
    exposed = epilogue_alu_s(n * n_tiles * bv, a.fwd_ops, dev, a) if ctas["_fwd_kernel"] == 1 else 0.0
    p.launches.append(Launch("_fwd_kernel", flops=2.0 * programs * per * bm * bv * h,
                             bytes=hidden_traffic + weight_traffic, wave_eff=wave_eff(programs, slots),
                             exposed_s=exposed))
    p.launches.append(Launch("forward merge + row order (torch)", bytes=4 * 4 * splits * n * 2, launches=12))

    # backward chunks
    if before:
        chunk = max(bm, min(_schedule._DX_BUDGET_BYTES // (V * ELT), cdiv(n, bm) * bm) // bm * bm)
    else:
        chunk = _schedule.backward_chunk(n, V, h, ELT, bm, None)
    n_chunks = cdiv(n, chunk)
    num_h = cdiv(h, bh)
    if before:
        p.launches.append(Launch("grad_W zero fill (float32)", bytes=4 * V * h))
    for i, start in enumerate(range(0, n, chunk)):
        c = min(chunk, n - start)
        num_m = cdiv(c, bm)
        # _dlogits_kernel: one tile per program; hidden row blocks re-read for every vocabulary tile
        slots = dev.sms * ctas["_dlogits_kernel"]
        group = num_m if before else _schedule.l2_group(bm * h * ELT, num_m, dev.l2)
        chunk_hidden = ELT * c * h
        hidden_traffic = chunk_hidden if fits(chunk_hidden if before else group * bm * h * ELT, dev) \
            else chunk_hidden * n_tiles
        programs = num_m * n_tiles
        exposed = epilogue_alu_s(num_m * bm * n_tiles * bv, a.dlogits_ops, dev, a) \
            if ctas["_dlogits_kernel"] == 1 else 0.0
        p.launches.append(Launch("_dlogits_kernel", flops=2.0 * programs * bm * bv * h,
                                 bytes=hidden_traffic + w_bytes * cdiv(num_m, group) + ELT * c * V,
                                 wave_eff=wave_eff(programs, slots), exposed_s=exposed))
        # _dhidden_kernel: K loop over V, optionally split
        k_tiles = cdiv(V, bk)
        if before:
            n_split, slots = 1, dev.sms * 2
        else:
            key = "_dhidden_kernel split-K"
            slots1 = dev.sms * ctas["_dhidden_kernel"]
            n_split = _schedule.split_k(num_m * num_h, k_tiles, slots1)
            slots = dev.sms * ctas[key if n_split > 1 else "_dhidden_kernel"]
        programs = num_m * num_h * n_split
        part = 2 * 4 * n_split * c * h if n_split > 1 else 0  # float32 partials written, then summed
        group_dh = num_m if before else 8
        p.launches.append(Launch("_dhidden_kernel", flops=2.0 * num_m * bm * num_h * bh * V,
                                 bytes=ELT * c * V + w_bytes * cdiv(num_m, group_dh) + ELT * c * h + part,
                                 wave_eff=wave_eff(programs, slots)))
        # _dweight_kernel: K loop over the chunk's rows; epilogue writes / accumulates the [V, H] gradient
        slots = dev.sms * ctas["_dweight_kernel"]
        programs = n_tiles * num_h
        if before:
            dx_traffic = ELT * c * V * num_h  # pid_v fast: every H tile streams all of dx again
            epilogue = 8 * V * h  # float32 read-modify-write
        else:
            group_h = _schedule.l2_group(chunk * bh * ELT, num_h, dev.l2)
            dx_traffic = ELT * c * V * cdiv(num_h, group_h)
            mode = 0 if i == 0 else (2 if i == n_chunks - 1 else 1)
            epilogue = {0: (ELT if n_chunks == 1 else 4), 1: 8, 2: 4 + ELT}[mode] * V * h
        exposed = epilogue / (dev.hbm * a.hbm) if ctas["_dweight_kernel"] == 1 else 0.0
        p.launches.append(Launch("_dweight_kernel", flops=2.0 * programs * bv * bh * c,
                                 bytes=dx_traffic + ELT * c * h + (0 if exposed else epilogue),
                                 wave_eff=wave_eff(programs, slots), exposed_s=exposed))
        p.launches.append(Launch("backward small ops", launches=4 if n_split > 1 else 1,
                                 bytes=(2 * 4 * n_split * c * h) if n_split > 1 else 0))
    if before:
        p.launches.append(Launch("grad_W to bf16", bytes=(4 + ELT) * V * h))
    p.launches.append(Launch("backward row order (torch)", launches=6))
    return p


def liger_flce_path(n: int, h: int) -> LossPath:
    chunk = min(2 ** math.ceil(math.log2(cdiv(n, cdiv(V, h)))), n)
    p = LossPath("liger-flce", [Launch("target count (.item() sync)", launches=2)])
    for start in range(0, n, chunk):
        c = min(chunk, n - start)
        p.launches += [
            gemm("logits chunk", c, V, h),
            Launch("cross-entropy kernel (2 reads, 1 write)", bytes=3 * ELT * c * V),
            gemm("grad_input chunk", c, h, V),
            gemm("grad_W addmm (weight dtype)", V, h, c, extra_bytes=ELT * V * h),
        ]
    return p


# ------------------------------------------------------------------------------------------------ driver


def ctas_per_sm(reports: list[dict]) -> dict[str, int]:
    """CTAs per SM of the bf16 kernels, from check_hopper reports (the forward the loss uses: rows=True)."""
    out = {}
    for r in reports:
        if not r["variant"].startswith("bf16"):
            continue
        rep = check_hopper.Report(**r)
        name = r["kernel"]
        if name == "_fwd_kernel" and "rows=False" in r["variant"]:
            continue
        if name == "_dhidden_kernel" and "split-K=True" in r["variant"]:
            name = "_dhidden_kernel split-K"
        out[name] = rep.programs_per_sm
    return out


def predict(dev: Device, a: Assumptions, ctas: dict[str, int], shapes) -> list[dict]:
    rows = []
    for n, h in shapes:
        paths = [floor_path(n, h), cublas_path(n, h), triton_path(n, h, dev, a, ctas),
                 triton_path(n, h, dev, a, ctas, before=True), liger_flce_path(n, h)]
        floor_s = paths[0].seconds(dev, a)
        for p in paths:
            s = p.seconds(dev, a)
            rows.append(dict(device=dev.name, n=n, h=h, path=p.name, ms=1e3 * s, x_floor=s / floor_s,
                             kernels={k: 1e3 * v for k, v in p.by_kernel(dev, a).items()}))
    return rows


TARGETS = {"cublas": 1.15, "triton": 1.5}


def summary_table(rows: list[dict]) -> str:
    lines = ["| device | N | H | floor ms | cublas ms (x floor) | triton ms (x floor) | triton, naive schedule "
             "(x floor) | Liger FLCE ms (x floor) |", "|---|---|---|---|---|---|---|---|"]
    keyed = {(r["device"], r["n"], r["h"], r["path"]): r for r in rows}
    for dev, n, h in dict.fromkeys((r["device"], r["n"], r["h"]) for r in rows):
        cell = lambda p: f"{keyed[dev, n, h, p]['ms']:.1f} ({keyed[dev, n, h, p]['x_floor']:.2f}x)"  # noqa: E731
        lines.append(f"| {dev} | {n} | {h} | {keyed[dev, n, h, 'floor']['ms']:.1f} | {cell('cublas')} "
                     f"| {cell('triton')} | {cell('triton-before')} | {cell('liger-flce')} |")
    return "\n".join(lines)


def kernel_table(rows: list[dict], device: str) -> str:
    """Per-kernel milliseconds (summed over chunks) of the Triton path with the naive and the current schedule, and of
    the cublas path."""
    tri = ("_fwd_kernel", "_dlogits_kernel", "_dhidden_kernel", "_dweight_kernel")
    lines = [f"{device}, per kernel (ms, summed over chunks)",
             "| N | H | path | " + " | ".join(tri) + " | other | total |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["device"] != device or r["path"] not in ("triton", "triton-before"):
            continue
        k = r["kernels"]
        lines.append(f"| {r['n']} | {r['h']} | {r['path']} | " + " | ".join(f"{k[x]:.2f}" for x in tri)
                     + f" | {sum(v for x, v in k.items() if x not in tri):.2f} | {r['ms']:.2f} |")
    lines += ["", "| N | H | path | products 1+2+3 | _rowstats_kernel | _softmax_grad_kernel | other | total |",
              "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["device"] != device or r["path"] != "cublas":
            continue
        k = r["kernels"]
        prod = sum(v for x, v in k.items() if x.startswith("product"))
        rk = k["_rowstats_kernel"], k["_softmax_grad_kernel"]
        lines.append(f"| {r['n']} | {r['h']} | cublas | {prod:.2f} | {rk[0]:.2f} | {rk[1]:.2f} "
                     f"| {r['ms'] - prod - sum(rk):.2f} | {r['ms']:.2f} |")
    return "\n".join(lines)


def verdicts(rows: list[dict], a: Assumptions, ctas: dict[str, int]) -> list[str]:
    out = []
    for r in rows:
        limit = TARGETS.get(r["path"])
        if limit is None:
            continue
        ok = r["x_floor"] <= limit
        line = (f"{'meets' if ok else 'MISSES'} target: {r['device']} N={r['n']} H={r['h']} {r['path']} "
                f"{r['x_floor']:.3f}x floor (target <= {limit}x)")
        if not ok and r["path"] == "triton":
            need = break_even_triton_mma(r, a, ctas, limit)
            line += (f"; would need the Triton mainloop at {need:.2f} of peak (assumed {a.triton_mma}, cuBLAS "
                     f"{a.cublas_mma})" if need else "; not reachable by mainloop efficiency alone")
        out.append(line)
    return out


def break_even_triton_mma(row: dict, a: Assumptions, ctas: dict[str, int], limit: float) -> float | None:
    """The Triton mainloop efficiency at which the triton path would meet ``limit`` x floor (bisection)."""
    dev = next(d for d in DEVICES.values() if d.name == row["device"])
    floor_s = floor_path(row["n"], row["h"]).seconds(dev, a)

    def ratio(eff):
        b = replace(a, triton_mma=eff)
        return triton_path(row["n"], row["h"], dev, b, ctas).seconds(dev, b) / floor_s

    if ratio(1.0) > limit:
        return None
    lo, hi = a.triton_mma, 1.0
    for _ in range(30):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if ratio(mid) > limit else (lo, mid)
    return hi


METHOD_TO_PATH = {"floor": "floor", "ours": "cublas", "ours_recompute": "triton"}


def compare_measured(csv_path: Path, a: Assumptions, ctas: dict[str, int]) -> str:
    """Model next to bench_kernels.py's measurement, shape by shape (the first GPU run tests the model)."""
    text = csv_path.read_text().splitlines()
    header = text[0] if text and text[0].startswith("#") else ""
    dev = DEVICES["h200"] if "H200" in header else DEVICES["h100"]
    measured = [r for r in csv.DictReader(line for line in text if not line.startswith("#"))
                if r["method"] in METHOD_TO_PATH and r["ms"] and int(r["v"]) == V]
    shapes = sorted({(int(r["n"]), int(r["h"])) for r in measured})
    model = {(r["n"], r["h"], r["path"]): r["ms"] for r in predict(dev, a, ctas, shapes)}
    lines = [f"model ({dev.name}) vs measured ({header.lstrip('# ')[:80]})",
             "| N | H | path | model ms | measured ms | measured / model |", "|---|---|---|---|---|---|"]
    for r in measured:
        n, h, path = int(r["n"]), int(r["h"]), METHOD_TO_PATH[r["method"]]
        ms = float(r["ms"])
        lines.append(f"| {n} | {h} | {path} | {model[n, h, path]:.2f} | {ms:.2f} | {ms / model[n, h, path]:.2f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hopper-json", type=Path, help="check_hopper.py --json output (else compile now)")
    parser.add_argument("--measured", type=Path, help="bench_kernels.py CSV to print next to the model")
    parser.add_argument("--out", type=Path, help="also write the printed tables here (markdown)")
    parser.add_argument("--kernels", action="store_true", help="also print the per-kernel breakdown (H100)")
    for name in ("cublas_mma", "triton_mma", "hbm"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=float, default=getattr(Assumptions, name),
                            help=f"override Assumptions.{name} (calibrate from a GPU run)")
    args = parser.parse_args(argv)
    if args.hopper_json is not None:
        data = json.loads(args.hopper_json.read_text())
    else:
        if check_hopper.cuobjdump_path() is None:
            print("roofline: cuobjdump not found (triton's nvidia backend); pass --hopper-json")
            return 2
        import triton

        data = {"triton": triton.__version__,
                "reports": [check_hopper.asdict(r) for r in check_hopper.run(bf16_only=True)]}
    ctas = ctas_per_sm(data["reports"])
    a = Assumptions(cublas_mma=args.cublas_mma, triton_mma=args.triton_mma, hbm=args.hbm)
    rows = [r for dev in DEVICES.values() for r in predict(dev, a, ctas, SHAPES)]
    parts = [f"MODEL, not a measurement (benchmarks/roofline.py; CTAs/SM from the sm_90 compile with triton "
             f"{data['triton']}: {ctas}; {a})", summary_table(rows), "\n".join(verdicts(rows, a, ctas))]
    if args.kernels:
        parts.append(kernel_table(rows, DEVICES["h100"].name))
    if args.measured is not None:
        parts.append(compare_measured(args.measured, a, ctas))
    text = "\n\n".join(parts)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return 0

if __name__ == "__main__":
    sys.exit(main())
