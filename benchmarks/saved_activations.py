"""What autograd keeps for backward in one packed training pass, by module type, with and without the lean norm and
MLP forwards (``parallel.lean_activations``), and the pass's time with each, alternated.

The micro-batch is bench_trl's shape of work: ``--groups`` prompts of ``--prompt`` tokens, each with
``--generations`` completions of ``--completion`` tokens, each group's prompt held once (``grpo.shared_prefix``).
Saved tensors are counted once per storage (views of one buffer, and a tensor saved by two ops, count once); the
parameters are left out.

    python benchmarks/saved_activations.py --model smollm2-135m-instruct --reps 12
    python benchmarks/saved_activations.py --model tiny --reps 2          # seconds: the embedded model
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fastgrpo.config import ModelConfig, ParallelConfig  # noqa: E402
from fastgrpo.distributed.runner import prepare_model  # noqa: E402
from fastgrpo.kernels import linear_logprobs  # noqa: E402
from fastgrpo.models.loading import load_model  # noqa: E402
from fastgrpo.update.step import plan_step  # noqa: E402


def census(model, runner, mb) -> tuple[collections.Counter, float, float]:
    """(bytes saved by module type, forward s, backward s) of one packed pass (loss: the summed log-probs)."""
    stack: list[str] = []

    def enter(module, *_):
        stack.append(type(module).__name__)

    def leave(*_):  # returns None: the module's output stays
        stack.pop()

    hooks = [h for m in model.modules() for h in (m.register_forward_pre_hook(enter), m.register_forward_hook(leave))]
    seen = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: collections.Counter = collections.Counter()

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in seen:
            seen.add(ptr)
            saved[stack[-1] if stack else "(outside modules)"] += t.untyped_storage().nbytes()
        return t

    model.zero_grad(set_to_none=True)
    try:
        t0 = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            logp = runner.packed_forward(mb, lambda h, w: linear_logprobs(h, w, mb.targets))
        t1 = time.perf_counter()
        logp.sum().backward()
        t2 = time.perf_counter()
    finally:
        for h in hooks:
            h.remove()
    return saved, t1 - t0, t2 - t1


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct", help="a model source or folder (model.name_or_path)")
    ap.add_argument("--groups", type=int, default=2)
    ap.add_argument("--generations", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=117)
    ap.add_argument("--completion", type=int, default=32)
    ap.add_argument("--reps", type=int, default=6, help="timed passes per setting, alternated (the first dropped)")
    args = ap.parse_args(argv)
    if args.reps < 2:
        ap.error("--reps must be >= 2 (the first pass of each setting is dropped)")

    torch.manual_seed(0)
    model = load_model(ModelConfig(name_or_path=args.model), device="cpu").train()
    vocab = model.get_output_embeddings().weight.shape[0]
    prompts = [torch.randint(0, vocab, (args.prompt,)).tolist() for _ in range(args.groups)]
    prompt_ids = [p for p in prompts for _ in range(args.generations)]
    completion_ids = [torch.randint(0, vocab, (args.completion,)).tolist() for _ in prompt_ids]
    (mb,) = plan_step(prompt_ids, completion_ids, 1 << 30, device="cpu", shared_prefix=True).mbs
    tokens, layers = mb.input_ids.numel(), model.config.num_hidden_layers
    runners = {lean: prepare_model(model, ParallelConfig(lean_activations=lean), device="cpu", world_size=1)
               for lean in (False, True)}
    saved, times = {}, {False: [], True: []}
    for i in range(args.reps):
        for lean in ((False, True) if i % 2 == 0 else (True, False)):
            saved[lean], fwd, bwd = census(model, runners[lean], mb)
            times[lean].append((fwd, bwd))

    print(f"{args.model}: {tokens} tokens forwarded ({args.groups} x {args.prompt} prompt + "
          f"{args.groups * args.generations} x {args.completion} completion), {layers} layers; "
          f"{len(runners[True].lean_forwards)} modules with a lean forward\n")
    print("| module type | saved, autograd (MB) | saved, lean (MB) | autograd, bytes per token and layer | "
          "lean, bytes per token and layer |")
    print("|---|---|---|---|---|")
    kinds = sorted(set(saved[False]) | set(saved[True]), key=lambda k: -saved[False][k])
    for kind in [*kinds, "total"]:
        a, b = ((sum(saved[x].values()) if kind == "total" else saved[x][kind]) for x in (False, True))
        per_token = f"{a / tokens / layers:,.0f} | {b / tokens / layers:,.0f}"
        print(f"| {kind} | {a / 2**20:.1f} | {b / 2**20:.1f} | {per_token} |")
    print()
    for lean in (False, True):
        runs = times[lean][1:]
        total = [f + b for f, b in runs]
        print(f"{'lean' if lean else 'autograd'}: forward {statistics.median(f for f, _ in runs):.3f} s, backward "
              f"{statistics.median(b for _, b in runs):.3f} s, both {statistics.median(total):.3f} s "
              f"({min(total):.3f}-{max(total):.3f}) over {len(runs)} passes")


if __name__ == "__main__":
    main()
