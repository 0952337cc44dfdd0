"""Accuracy of every loss path against the float64 reference, side by side (not speed).

    python benchmarks/kernel_accuracy.py                       # CUDA: real bf16 kernels
    TRITON_INTERPRET=1 python benchmarks/kernel_accuracy.py    # CPU: Triton paths under the interpreter

Inputs: harness.make_inputs in bf16 (20% zero token weights), old log-probs = exact ones + N(0, 0.3^2).
Prints relative errors of the loss and both gradients for: plain bf16 torch (TRL's computation), and each
available backend of fastgrpo.kernels.linear_grpo_loss.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.bench_kernels import fk  # noqa: E402  (fastgrpo.kernels, installed or from the source tree)
from benchmarks.harness import Shape, make_inputs, perturbed, rel_err  # noqa: E402


def errors(shape: Shape, *, device: str, chunk_size: int, seed: int = 3,
           paths: tuple[str, ...] | None = None) -> list[tuple[str, float, float, float]]:
    inp = make_inputs(shape, dtype=torch.bfloat16, device=device, seed=seed, zero_weight_frac=0.2)
    args = [inp[k] for k in ("hidden", "weight", "targets", "advantages", "token_weights")]
    h64, w64 = (x.detach().double().requires_grad_() for x in args[:2])
    old = perturbed(fk.reference_linear_logprobs(h64, w64, args[2]), std=0.3)
    exact, _ = fk.reference_linear_grpo_loss(h64, w64, *args[2:], old_logprobs=old.double())
    exact_g = torch.autograd.grad(exact, (h64, w64))
    on_triton = device == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
    if paths is None:
        paths = ["plain bf16 torch"] + (["cublas", "triton"] if on_triton else []) + ["torch"]
    out = []
    for name in paths:
        if name == "plain bf16 torch":
            loss, _ = fk.reference_linear_grpo_loss(*args, old_logprobs=old)
        else:
            loss, _ = fk.linear_grpo_loss(*args, old_logprobs=old, backend=name, chunk_size=chunk_size)
        g = torch.autograd.grad(loss, args[:2])
        assert g[0].dtype == args[0].dtype and g[1].dtype == args[1].dtype, f"{name}: gradients not in bf16"
        out.append((name, rel_err(loss, exact), rel_err(g[0], exact_g[0]), rel_err(g[1], exact_g[1])))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=300)
    ap.add_argument("--h", type=int, default=64)
    ap.add_argument("--v", type=int, default=1000)
    ap.add_argument("--chunk-size", type=int, default=64)
    ap.add_argument("--seeds", default="3", help="comma list of input seeds")
    ap.add_argument("--sweep-chunks", action="store_true",
                    help="also: the cublas path's grad_weight error for 1, N/8 and N/32 rows per chunk "
                         "(grad_weight is summed over chunks in bf16)")
    args = ap.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    shape = Shape(n=args.n, h=args.h, v=args.v)
    dev_name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    print(f"device: {dev_name}; torch {torch.__version__}; date {datetime.datetime.now().isoformat(timespec='seconds')}; "
          f"TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '0')}; command: {' '.join(sys.argv)}")
    print(f"bf16, N={shape.n} H={shape.h} V={shape.v}, chunk {args.chunk_size}; relative error vs float64\n")
    seeds = [int(x) for x in args.seeds.split(",")]
    print("| seed | path | loss | grad_hidden | grad_weight |\n|---|---|---|---|---|")
    for seed in seeds:
        for name, e_loss, e_h, e_w in errors(shape, device=device, chunk_size=args.chunk_size, seed=seed):
            print(f"| {seed} | {name} | {e_loss:.3g} | {e_h:.3g} | {e_w:.3g} |", flush=True)
    if args.sweep_chunks and (device == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"):
        print("\n| seed | cublas chunks | grad_weight error | x plain bf16 torch |\n|---|---|---|---|")
        for seed in seeds:
            for chunks in (1, 8, 32):
                chunk = max(1, shape.n // chunks)
                rows = errors(shape, device=device, chunk_size=chunk, seed=seed, paths=("plain bf16 torch", "cublas"))
                plain, ours = rows[0][3], rows[1][3]
                print(f"| {seed} | {-(-shape.n // chunk)} | {ours:.4g} | {ours / plain:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
