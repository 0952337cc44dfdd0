"""Does a bf16 run with float32 masters (``parallel.master_weights``) track the float32 run? (CPU)

N SFT updates on the tiny model through the trainer's update path (``build_trained`` -> ``sft_update`` ->
``optimizer_update``) in three set-ups from the same weights and batches: float32 (the CPU default), bf16 compute
weights with float32 masters, and bf16 weights with AdamW on them directly (no masters, the failure the masters
prevent). Prints each step's NLL and, per bf16 set-up, the largest NLL gap to float32 and the relative error of the
whole update (final - initial weights) against float32's. tests/test_master_weights.py asserts on the same runs.

    python benchmarks/track_bf16.py --steps 8 --lr 1e-4
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from fastgrpo.algorithms.sft import sft_update  # noqa: E402
from fastgrpo.config import OptimConfig, ParallelConfig  # noqa: E402
from fastgrpo.models.tiny import build_tiny  # noqa: E402
from fastgrpo.runtime.metrics import StepMetrics  # noqa: E402
from fastgrpo.update.bundle import build_trained  # noqa: E402
from fastgrpo.update.master_weights import MasterAdamW  # noqa: E402

SETUPS = {"float32": ParallelConfig(), "bf16+masters": ParallelConfig(master_weights=True),
          "bf16 no masters": ParallelConfig(master_weights=True)}
"""Set-up name -> parallel config; 'bf16 no masters' swaps the optimizer for torch's AdamW on the bf16 weights."""


def sft_batches(n_distinct: int, *, seed: int = 5) -> list[tuple[list[list[int]], list[list[int]]]]:
    """``n_distinct`` batches of 6 (prompt, completion) pairs of random byte tokens."""
    r = random.Random(seed)
    return [([[r.randrange(3, 250) for _ in range(r.randint(3, 8))] for _ in range(6)],
             [[r.randrange(3, 250) for _ in range(r.randint(4, 12))] for _ in range(6)]) for _ in range(n_distinct)]


def sft_run(setup: str, batches, *, lr: float):
    """Per-step NLL, the float32 update (final - initial weights, flattened; the masters where there are) and the
    trained bundle, after ``batches`` of SFT in ``setup``."""
    model = AutoModelForCausalLM.from_pretrained(build_tiny(), dtype=torch.float32).train()
    start = torch.cat([p.detach().flatten() for p in model.parameters()])
    trained = build_trained(model, parallel=SETUPS[setup], optim=OptimConfig(lr=lr), device="cpu", world_size=1,
                            total_steps=len(batches))
    if setup == "bf16 no masters":
        trained.optimizer = torch.optim.AdamW(trained.model.parameters(), lr=lr, betas=(0.9, 0.99), foreach=True)
        trained.scheduler = None
    losses = []
    for prompts, completions in batches:
        metrics = StepMetrics()
        sft_update(trained.model, prompts, completions, normalization="token", max_tokens_per_microbatch=64,
                   head_backend="torch", optimizer=trained.optimizer, scheduler=trained.scheduler,
                   max_grad_norm=1.0, metrics=metrics, device="cpu")
        losses.append(metrics.reduce()["loss"])
    opt = trained.optimizer
    end = torch.cat([(opt.state[p]["master"] if isinstance(opt, MasterAdamW) else p).detach().float().flatten()
                     for p in trained.model.parameters()])
    return losses, end - start, trained


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=8, help="SFT updates (the distinct batches repeat)")
    ap.add_argument("--distinct", type=int, default=2, help="distinct batches")
    ap.add_argument("--lr", type=float, default=1e-4)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    batches = (sft_batches(args.distinct) * args.steps)[:args.steps]
    runs = {name: sft_run(name, batches, lr=args.lr) for name in SETUPS}
    ref_losses, ref_update, _ = runs["float32"]
    print(f"{args.steps} SFT updates, lr {args.lr}, tiny model, CPU, torch {torch.__version__}")
    print("NLL per step:")
    for name, (losses, _, _) in runs.items():
        print(f"  {name:16s} " + " ".join(f"{x:.4f}" for x in losses))
    print("| set-up | max NLL gap to float32 | update relative error vs float32 |\n|---|---|---|")
    for name, (losses, update, _) in runs.items():
        if name != "float32":
            gap = max(abs(a - b) for a, b in zip(losses, ref_losses))
            err = ((update - ref_update).norm() / ref_update.norm()).item()
            print(f"| {name} | {gap:.4f} | {err:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
