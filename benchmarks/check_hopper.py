"""Compile the Triton kernels for Hopper (sm_90) without a GPU and report what the hardware would run.

For each kernel, at the block sizes the launchers use on an H100, prints: registers per thread, spills (local
memory bytes and STL/LDL instructions in the SASS), shared memory (static + dynamic) and whether ``tl.dot``
became Hopper warpgroup MMA (HGMMA / wgmma) instructions. Uses triton.compile with a GPUTarget, then the
cuobjdump shipped in triton/backends/nvidia/bin.

    python benchmarks/check_hopper.py            # bf16 and fp32 variants
    python benchmarks/check_hopper.py --bf16-only --json /tmp/hopper.json    # for benchmarks/roofline.py

Exit status 1 when a kernel spills, a ``tl.dot`` is not lowered to wgmma (no HGMMA, or pre-Hopper HMMA), or the
target check lost its device assert. CTAs/SM is ``_schedule.programs_per_sm`` of the registers and shared memory:
what the launchers use, at run time, to size their grids.

Integer arguments that are multiples of 16 in real use (strides, H, V) and all pointers are declared 16-aligned,
as Triton's JIT specialisation would do at launch.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _load_triton_backend():
    """The Triton kernels module of the installed fastgrpo.kernels."""
    from fastgrpo.kernels import _triton

    return _triton


@dataclass
class Report:
    kernel: str
    variant: str
    regs: int
    local_bytes: int
    spill_instrs: int
    smem_bytes: int
    hgmma: int
    num_warps: int
    hmma: int = 0  # pre-Hopper mma.sync: a tl.dot that did not become wgmma
    asserts: int = 0  # calls to __assertfail (device asserts compiled in)

    @property
    def spills(self) -> bool:
        return self.local_bytes > 0 or self.spill_instrs > 0

    @property
    def programs_per_sm(self) -> int:
        """CTAs of this kernel one SM holds (registers, shared memory, threads), as the launcher computes it."""
        from fastgrpo.kernels import _schedule

        return _schedule.programs_per_sm(self.regs, self.smem_bytes, self.num_warps)


def cuobjdump_path() -> str | None:
    import triton

    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    return str(path) if path.exists() else shutil.which("cuobjdump")


def _signature(fn, ptr_types: dict, constexprs: dict, aligned: set):
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = ptr_types.get(name, "*fp32")
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name == "inv_temp":
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
            if name in aligned or name.startswith("stride"):
                attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, attrs


def compile_one(fn, *, ptr_types, constexprs, num_warps, num_stages, variant, debug=False) -> Report:
    import triton
    from triton.backends.compiler import GPUTarget

    sig, attrs = _signature(fn, ptr_types, constexprs, aligned={"V", "Hdim", "N", "row_start", "chunk_rows", "k_len"})
    src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": num_warps, "num_stages": num_stages,
                                       "enable_fp_fusion": True, "debug": debug})
    tool = cuobjdump_path()
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "k.cubin")
        with open(cubin, "wb") as f:
            f.write(compiled.asm["cubin"])
        res = subprocess.run([tool, "-res-usage", cubin], capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([tool, "--dump-sass", cubin], capture_output=True, text=True, check=True).stdout
    field = lambda key: int(re.search(rf"{key}:(\d+)", res).group(1))  # noqa: E731
    return Report(
        kernel=fn.__name__, variant=variant, regs=field("REG"), local_bytes=field("LOCAL") + field("STACK"),
        spill_instrs=len(re.findall(r"\b(?:STL|LDL)\b", sass)), smem_bytes=field("SHARED") + compiled.metadata.shared,
        hgmma=len(re.findall(r"\bHGMMA\b", sass)), num_warps=num_warps, hmma=len(re.findall(r"\bHMMA\b", sass)),
        asserts=compiled.asm["ptx"].count("call.uni __assertfail") + compiled.asm["ptx"].count("call __assertfail"),
    )


DOT_KERNELS = ("_fwd_kernel", "_dlogits_kernel", "_dhidden_kernel", "_dweight_kernel")
ROW_KERNELS = ("_rowstats_kernel", "_softmax_grad_kernel", "_scale_kernel")  # the "cublas" path's: no dot
CHECK_KERNELS = ("_check_targets_kernel",)  # device-side target check (debug build: keeps tl.device_assert)


def kernel_specs(bf16_only: bool = False):
    """(kernel, pointer dtypes, constexprs, launch options, variant label, debug) at the launchers' GPU sizes."""
    tr = _load_triton_backend()
    from fastgrpo.kernels import _gradfwd as gf
    from fastgrpo.kernels import _targets
    variants = [("bf16", "*bf16", tr.GPU_BLOCKS, "ieee")]
    if not bf16_only:
        variants.append(("fp32-tf32", "*fp32", tr.GPU_BLOCKS_FP32, "tf32"))
    specs = []
    for label, dt, cfg, precision in variants:
        base = dict(UPCAST=False, PRECISION=precision)
        launch = dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
        mvk = {k: cfg[k] for k in ("BLOCK_M", "BLOCK_V", "BLOCK_K")}
        for has_rows in (False, True):
            specs.append((tr._fwd_kernel, {"h_ptr": dt, "w_ptr": dt, "tgt_ptr": "*i64", "rows_ptr": "*i32",
                                           "n_active_ptr": "*i32"},
                          dict(base, HAS_ROWS=has_rows, HAS_BIAS=False, **mvk), launch, f"{label} rows={has_rows}",
                          False))
        specs.append((tr._dlogits_kernel, {"h_ptr": dt, "w_ptr": dt, "tgt_ptr": "*i64", "rows_ptr": "*i32",
                                           "n_active_ptr": "*i32", "dx_ptr": dt},
                      dict(base, HAS_ENT=True, HAS_BIAS=False, **mvk), launch, f"{label} entropy", False))
        for split in (False, True):
            specs.append((tr._dhidden_kernel, {"dx_ptr": dt, "w_ptr": dt, "rows_ptr": "*i32", "n_active_ptr": "*i32",
                                               "dh_ptr": dt, "part_ptr": "*fp32"},
                          dict(base, SPLIT_K=split, **{k: cfg[k] for k in ("BLOCK_M", "BLOCK_H", "BLOCK_K")}), launch,
                          f"{label} split-K={split}", False))
        specs.append((tr._dweight_kernel, {"dx_ptr": dt, "h_ptr": dt, "rows_ptr": "*i32", "n_active_ptr": "*i32",
                                           "acc_ptr": "*fp32", "out_ptr": dt},
                      dict(base, **{k: cfg[k] for k in ("BLOCK_V", "BLOCK_H", "BLOCK_K")}), launch, label, False))
        # The "cublas" loss path's row kernels (memory-bound, no dot): one program per row / row slice.
        rows = dict(BLOCK_V=gf._ROW_BLOCK_V)
        row_launch = dict(num_warps=gf._ROW_WARPS, num_stages=1)
        specs.append((gf._rowstats_kernel, {"x_ptr": dt, "tgt_ptr": "*i64", "n_active_ptr": "*i32"}, rows,
                      row_launch, label, False))
        specs.append((gf._softmax_grad_kernel, {"x_ptr": dt, "tgt_ptr": "*i64"}, rows, row_launch, label, False))
        specs.append((gf._scale_kernel, {"x_ptr": dt}, dict(BLOCK=4096), row_launch, label, False))
    specs.append((_targets._check_targets_kernel, {"t_ptr": "*i64"}, dict(BLOCK=_targets._BLOCK),
                  dict(num_warps=4, num_stages=1), "int64 debug", True))
    return specs


def run(bf16_only: bool = False) -> list[Report]:
    reports = []
    for fn, ptr_types, constexprs, launch, label, debug in kernel_specs(bf16_only):
        reports.append(compile_one(fn, ptr_types=ptr_types, constexprs=constexprs, variant=label, debug=debug,
                                   **launch))
    return reports


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bf16-only", action="store_true")
    parser.add_argument("--json", type=Path, help="also write the reports here (benchmarks/roofline.py reads them)")
    args = parser.parse_args(argv)
    if cuobjdump_path() is None:
        print("cuobjdump not found (triton's nvidia backend missing): cannot inspect sm_90 code")
        return 2
    reports = run(args.bf16_only)
    import triton

    print(f"triton {triton.__version__}, target sm_90")
    print("| kernel | variant | warps | regs/thread | spills (local B / STL+LDL) | smem KiB | CTAs/SM | HGMMA | HMMA |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in reports:
        print(f"| {r.kernel} | {r.variant} | {r.num_warps} | {r.regs} | {r.local_bytes} / {r.spill_instrs} "
              f"| {r.smem_bytes / 1024:.1f} | {r.programs_per_sm} | {r.hgmma} | {r.hmma} |")
    problems = problems_of(reports)
    print(f"\n{len(reports)} kernels compiled for sm_90; {len(problems)} problems")
    for p in problems:
        print(f"  {p}")
    if args.json is not None:
        args.json.write_text(json.dumps({"triton": triton.__version__, "reports": [asdict(r) for r in reports]},
                                        indent=1))
    return 1 if problems else 0


def problems_of(reports: list[Report]) -> list[str]:
    """What check_hopper fails on: spills, a tl.dot not lowered to wgmma, a device assert compiled out."""
    out = [f"{r.kernel} {r.variant}: spills ({r.local_bytes} B local, {r.spill_instrs} STL/LDL)"
           for r in reports if r.spills]
    out += [f"{r.kernel} {r.variant}: tl.dot not lowered to wgmma (HGMMA {r.hgmma}, HMMA {r.hmma})"
            for r in reports if r.kernel in DOT_KERNELS and (r.hgmma == 0 or r.hmma > 0)]
    out += [f"{r.kernel} {r.variant}: no device assert in the code" for r in reports
            if r.kernel in CHECK_KERNELS and r.asserts == 0]
    return out

if __name__ == "__main__":
    sys.exit(main())
