"""Policy-update throughput: packed micro-batches vs TRL-style padded batches.

One policy update = forward, backward and AdamW step over a GRPO batch (B prompts x G completions). The same
batch is run two ways on the same random-weight model:

  packed  fastgrpo.models.packing: token-budget micro-batches, one [1, T] row each, no padding, lm_head on
          completion tokens only.
  padded  TRL's layout: micro-batches of --padded-batch sequences in batch order, prompts left-padded and
          completions right-padded to the longest in the micro-batch, [B, Lmax] with an attention mask.

Both use the same loss head (fastgrpo.kernels.linear_grpo_loss; padded completion positions get token weight 0,
which the kernel skips, so the difference measures the trunk's padding waste only -- TRL also pays the lm_head
on padding). Lengths follow Countdown: prompts uniform in [100, 150] tokens (shared by a prompt's G samples),
completions lognormal with mean ~300, capped at 1024.

tokens/s counts real tokens (prompt + completion, no padding). MFU = useful FLOPs / time / peak, with
useful FLOPs = 6 * N_trunk * T + 6 * H * V * N_completion + 6 * layers * d_attn * sum_i len_i^2
(N_trunk: parameters without the embedding; the lm_head matmul counted on completion tokens only; causal
attention fwd+bwd). The same useful FLOPs are used for both modes, so MFU also ranks them.

    python benchmarks/bench_learner.py                 # GPU: Qwen2.5-0.5B shape, padded then packed (~2 min)
    python benchmarks/bench_learner.py --models qwen2.5-0.5b,qwen2.5-1.5b --budget-s 400   # both shapes
    python benchmarks/bench_learner.py --quick         # CPU smoke test with a tiny model (seconds)

Progress is printed as it goes (model built, each step's time: the first packed step on CUDA includes compiling
flex_attention, which is why it is a warm-up), and the table files are rewritten after every run, so a run
killed from outside still leaves the finished rows. --budget-s: no run starts, and no further timed step is
taken, once that many seconds have passed (rows say so); a single step cannot be interrupted.
    python benchmarks/bench_learner.py --cpu-packing   # CPU: packed attention choices, alternated (below)

--cpu-packing: on CPU, one float32 model per shape and the same batch, updates in alternated rounds (so that load
on a shared machine hits all alike), each round: packed rows with "sdpa" (a dense [T, T] block-causal mask),
packed rows with "sdpa_varlen" (sdpa per sequence, fastgrpo's CPU default), and one sequence per micro-batch
("single", sdpa with is_causal: no mask at all). Lengths: --prompts x --generations sequences, prompts uniform in
[100, 150] tokens, completions lognormal with mean --completion-mean capped at --completion-cap.
"""

from __future__ import annotations

import argparse
import csv
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from a checkout

from fastgrpo.runtime.peaks import device_peak_flops  # noqa: E402
from fastgrpo.runtime.step_cost import update_flops  # noqa: E402
from fastgrpo.models.attention import choose_attn_implementation  # noqa: E402
from fastgrpo.models.loading import packed_head_forward  # noqa: E402
from fastgrpo.models.packing import pack, plan_microbatches  # noqa: E402

# Shapes of the public Qwen2.5 configs (random weights, nothing downloaded).
MODEL_SHAPES = {
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "tiny": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=32, vocab_size=257, tie_word_embeddings=True),
    # The 108M random Qwen2 of the TRL comparison (bench_trl.py): hidden 512, 8 layers, Qwen2.5's vocabulary.
    "qwen2-108m": dict(hidden_size=512, intermediate_size=2048, num_hidden_layers=8, num_attention_heads=8,
                       num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
}

@dataclass(kw_only=True)
class Row:
    model: str
    mode: str
    attn: str
    device: str
    sequences: int
    real_tokens: int
    slots: int
    """tokens the trunk actually processed (padding included)."""
    microbatches: int
    step_s: float
    tokens_per_s: float
    mfu: float | None
    peak_mem_gb: float | None
    check_logp: float
    """sum(w * logp) of the first step: packed and padded must agree (a correctness check, not a figure)."""
    grad_norm: float
    """gradient norm of the first step: packed and padded must agree."""
    error: str = ""


def countdown_lengths(num_prompts: int, generations: int, *, seed: int, quick: bool, mean: float = 300.0,
                      cap: int = 1024) -> tuple[list[int], list[int]]:
    """Prompt and completion lengths per sequence (prompt lengths repeat within a group of G)."""
    g = torch.Generator().manual_seed(seed)
    if quick:
        p_lo, p_hi, mean, cap = 4, 12, 10.0, 32
    else:
        p_lo, p_hi = 100, 150
    sigma = 0.6
    mu = math.log(mean) - sigma**2 / 2  # lognormal mean = exp(mu + sigma^2 / 2)
    prompts = torch.randint(p_lo, p_hi + 1, (num_prompts,), generator=g).repeat_interleave(generations)
    comp = torch.exp(mu + sigma * torch.randn(num_prompts * generations, generator=g)).round().clamp(1, cap)
    return prompts.int().tolist(), comp.int().tolist()


def build_model(name: str, attn: str, device: torch.device, dtype: torch.dtype, seed: int):
    from transformers import AutoModelForCausalLM, Qwen2Config

    from fastgrpo.models.attention import register_with_transformers

    register_with_transformers()  # "sdpa_varlen"

    cfg = Qwen2Config(max_position_embeddings=4096, attn_implementation=attn, **MODEL_SHAPES[name])
    torch.manual_seed(seed)
    with torch.device(device):  # initialise on the device: a 1.5B init on the host takes minutes
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    return model.train()


def loss_head(targets, advantages, weights):
    """head(hidden [N, H], weight [V, H]) -> (loss, stats) with the project's fused op, or a chunked fallback."""
    try:
        from fastgrpo.kernels import linear_grpo_loss
    except ImportError:  # kernels not installed: same maths, chunked so that no [N, V] tensor stays alive
        def linear_grpo_loss(hidden, weight, targets, advantages, token_weights):
            from torch.utils.checkpoint import checkpoint

            def chunk_logp(h, t):
                logits = (h @ weight.T).float()  # [C, V]
                return logits.gather(1, t[:, None])[:, 0] - logits.logsumexp(-1)

            logp = torch.cat([checkpoint(chunk_logp, h, t, use_reentrant=False)
                              for h, t in zip(hidden.split(2048), targets.split(2048))])
            loss = -(token_weights * advantages * torch.exp(logp - logp.detach())).sum()
            return loss, {"logprobs": logp.detach() * (token_weights != 0)}

    def head(hidden, weight):
        return linear_grpo_loss(hidden, weight, targets, advantages, weights)

    return head


def make_batch(prompt_lens, comp_lens, vocab, seed):
    g = torch.Generator().manual_seed(seed + 1)
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in prompt_lens]
    completions = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in comp_lens]
    F = sum(comp_lens)
    weights = torch.full((F,), 1.0 / F)  # dapo: 1 / sum_i L_i
    advantages = torch.randn(len(comp_lens), generator=g).repeat_interleave(torch.tensor(comp_lens))  # [F]
    return prompts, completions, weights, advantages


def packed_step(model, batch, device, max_tokens):
    """One update over packed micro-batches; returns (slots, micro-batches, sum(w * logp))."""
    prompts, completions, weights, advantages = batch
    lengths = [len(p) + len(c) for p, c in zip(prompts, completions)]
    mbs = pack(prompts, completions, plan_microbatches(lengths, max_tokens), device)
    w, adv = weights.to(device), advantages.to(device)
    check = torch.zeros((), device=device)
    for mb in mbs:
        head = loss_head(mb.targets, adv[mb.flat_index], w[mb.flat_index])
        loss, stats = packed_head_forward(model, mb, head)
        loss.backward()
        check += (w[mb.flat_index] * stats["logprobs"]).sum()
    return sum(mb.num_tokens for mb in mbs), len(mbs), check


def padded_step(model, batch, device, micro_batch):
    """One update over TRL-style padded micro-batches; returns (slots, micro-batches, sum(w * logp))."""
    prompts, completions, weights, advantages = batch
    offsets = [0, *torch.tensor([len(c) for c in completions]).cumsum(0).tolist()]
    trunk, weight = model.get_decoder(), model.get_output_embeddings().weight
    check, slots, count = torch.zeros((), device=device), 0, 0
    for start in range(0, len(prompts), micro_batch):
        idx = range(start, min(start + micro_batch, len(prompts)))
        P = max(len(prompts[i]) for i in idx)
        C = max(len(completions[i]) for i in idx)
        ids = torch.zeros(len(idx), P + C, dtype=torch.long)  # [B, Lmax]
        mask = torch.zeros(len(idx), P + C, dtype=torch.long)  # [B, Lmax]
        targets = torch.zeros(len(idx), C, dtype=torch.long)  # [B, C]
        w = torch.zeros(len(idx), C)
        adv = torch.zeros(len(idx), C)
        for r, i in enumerate(idx):
            p, c = prompts[i], completions[i]
            ids[r, P - len(p):P] = torch.tensor(p)  # left-pad the prompt
            ids[r, P:P + len(c)] = torch.tensor(c)  # right-pad the completion
            mask[r, P - len(p):P + len(c)] = 1
            targets[r, :len(c)] = torch.tensor(c)
            w[r, :len(c)] = weights[offsets[i]:offsets[i + 1]]
            adv[r, :len(c)] = advantages[offsets[i]:offsets[i + 1]]
        ids, mask = ids.to(device), mask.to(device)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)  # [B, Lmax] so that positions match the unpadded model
        hidden = trunk(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).last_hidden_state
        hidden = hidden[:, P - 1:P + C - 1].reshape(-1, hidden.shape[-1])  # [B * C, H]: predicts completions
        w, adv, targets = w.flatten().to(device), adv.flatten().to(device), targets.flatten().to(device)
        loss, stats = loss_head(targets, adv, w)(hidden, weight)
        loss.backward()
        check += (w * stats["logprobs"]).sum()
        slots += ids.numel()
        count += 1
    return slots, count, check


CPU_PACKING = {  # name -> (attention implementation, token budget per micro-batch: None = --max-tokens)
    "packed sdpa (dense mask)": ("sdpa", None),
    "packed sdpa_varlen": ("sdpa_varlen", None),
    "single (one sequence per micro-batch)": ("sdpa", 1),
}


def cpu_packing(args) -> str:
    """Alternated rounds of one update per CPU_PACKING choice on the same model and batch; a markdown table."""
    import statistics

    device = torch.device("cpu")
    lengths = countdown_lengths(args.prompts, args.generations, seed=args.seed, quick=False,
                                mean=args.completion_mean, cap=args.completion_cap)
    lines = ["| model | choice | micro-batches | step s (median) | spread | rounds | x single | tokens/s |",
             "|---|---|---|---|---|---|---|---|"]
    for name in args.models.split(","):
        model = build_model(name, "sdpa", device, torch.float32, args.seed)
        batch = make_batch(*lengths, model.config.vocab_size, args.seed)
        real = sum(lengths[0]) + sum(lengths[1])
        times: dict[str, list[float]] = {c: [] for c in CPU_PACKING}
        mbs_count, checks = {}, {}
        for rnd in range(args.warmup + args.steps):
            for choice, (attn, budget) in CPU_PACKING.items():
                model.set_attn_implementation(attn)
                t0 = time.perf_counter()
                _, mbs_count[choice], check = packed_step(model, batch, device, budget or args.max_tokens)
                if rnd >= args.warmup:
                    times[choice].append(time.perf_counter() - t0)
                checks.setdefault(choice, float(check))
                model.zero_grad(set_to_none=True)  # no optimizer step: every round sees the same weights
        ref = checks[next(iter(CPU_PACKING))]
        for choice, check in checks.items():  # the three compute the same log-probs
            assert abs(check - ref) <= 1e-4 * abs(ref) + 1e-6, (name, choice, check, ref)
        single = times["single (one sequence per micro-batch)"]
        for choice, ts in times.items():
            ratio = statistics.median(t / s for t, s in zip(ts, single))
            lines.append(f"| {name} | {choice} | {mbs_count[choice]} | {statistics.median(ts):.3f} | "
                         f"{min(ts):.3f}-{max(ts):.3f} | {len(ts)} | {ratio:.2f} | {real / statistics.median(ts):,.0f} |")
        print("\n".join(lines[-len(CPU_PACKING):]), flush=True)
        del model
    return "\n".join(lines)


def peak_flops(device: torch.device, override_tflops: float | None) -> float | None:
    return override_tflops * 1e12 if override_tflops else device_peak_flops(device)


def _say(msg: str) -> None:
    print(msg, flush=True)


def run_one(name, mode, attn, args, device, dtype, lengths, deadline: float = math.inf) -> Row:
    prompt_lens, comp_lens = lengths
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    tag = f"[{name} {mode} {attn}]"
    t_build = time.perf_counter()
    model = build_model(name, attn, device, dtype, args.seed)
    _say(f"{tag} model built in {time.perf_counter() - t_build:.1f}s")
    batch = make_batch(prompt_lens, comp_lens, model.config.vocab_size, args.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=device.type == "cuda")
    step = (lambda: packed_step(model, batch, device, args.max_tokens)) if mode == "packed" else \
        (lambda: padded_step(model, batch, device, args.padded_batch))
    times, first = [], None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for i in range(args.warmup + args.steps):
        if i > args.warmup and time.perf_counter() > deadline:  # at least one timed step, then the budget rules
            _say(f"{tag} time budget spent: {len(times)} of {args.steps} timed steps")
            break
        sync()
        t0 = time.perf_counter()
        slots, count, check = step()
        if first is None:  # before any update: both modes see the same weights
            norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
            first = (float(check), float(norm))
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        dt = time.perf_counter() - t0
        _say(f"{tag} step {i + 1}/{args.warmup + args.steps}{' (warm-up)' if i < args.warmup else ''}: {dt:.2f}s")
        if i >= args.warmup:
            times.append(dt)
    step_s = sorted(times)[len(times) // 2]
    real = sum(prompt_lens) + sum(comp_lens)
    peak = peak_flops(device, args.peak_tflops)
    row = Row(model=name, mode=mode, attn=attn, device=_device_name(device), sequences=len(comp_lens),
              real_tokens=real, slots=slots, microbatches=count, step_s=step_s, tokens_per_s=real / step_s,
              mfu=update_flops(model, prompt_lens, comp_lens) / step_s / peak if peak else None,
              peak_mem_gb=torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
              check_logp=first[0], grad_norm=first[1])
    del model, opt
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def markdown(rows: list[Row]) -> str:
    head = "| model | mode | attn | seqs | real tokens | slots | mbs | step s | tokens/s | MFU | peak GB | error |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        mfu = f"{100 * r.mfu:.1f}%" if r.mfu is not None else "n/a"
        mem = f"{r.peak_mem_gb:.1f}" if r.peak_mem_gb is not None else "n/a"
        lines.append(f"| {r.model} | {r.mode} | {r.attn} | {r.sequences} | {r.real_tokens} | {r.slots} | "
                     f"{r.microbatches} | {r.step_s:.3f} | {r.tokens_per_s:,.0f} | {mfu} | {mem} | {r.error} |")
    return "\n".join(lines)


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="CPU smoke test: tiny model, 8 short sequences, fp32")
    ap.add_argument("--models", default="qwen2.5-0.5b", help=f"comma list of {list(MODEL_SHAPES)}")
    ap.add_argument("--prompts", type=int, default=16, help="B prompts per step")
    ap.add_argument("--generations", type=int, default=8, help="G completions per prompt")
    ap.add_argument("--max-tokens", type=int, default=16384, help="packed token budget per micro-batch")
    ap.add_argument("--padded-batch", type=int, default=8, help="sequences per padded micro-batch")
    ap.add_argument("--steps", type=int, default=3, help="timed steps (median reported)")
    ap.add_argument("--budget-s", type=float, default=110.0,
                    help="start no run and no further timed step after this many seconds (module docstring)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--attn", default="auto", help="packed attention: auto|flash_attention_2|flex_attention|sdpa")
    ap.add_argument("--padded-attn", default="sdpa", help="padded attention (TRL default: sdpa)")
    ap.add_argument("--peak-tflops", type=float, default=None, help="override the device's dense bf16 peak")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="benchmarks/results/bench_learner", help="writes OUT.csv and OUT.md")
    ap.add_argument("--cpu-packing", action="store_true", help="CPU: packed attention choices (module docstring)")
    ap.add_argument("--completion-mean", type=float, default=300.0, help="mean completion length (lognormal)")
    ap.add_argument("--completion-cap", type=int, default=1024, help="longest completion")
    args = ap.parse_args(argv)
    if args.quick:
        args.models, args.prompts, args.generations = "tiny", 2, 4
        args.max_tokens, args.padded_batch, args.steps, args.warmup = 64, 4, 1, 0
    return args


def main(argv: list[str] | None = None) -> list[Row]:
    args = parse_args(argv)
    if args.cpu_packing:
        table = cpu_packing(args)
        cmd = "python benchmarks/bench_learner.py " + " ".join(argv if argv is not None else sys.argv[1:])
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_suffix(".md").write_text(f"{time.strftime('%Y-%m-%d')} on cpu ({torch.get_num_threads()} threads), "
                                          f"torch {torch.__version__}\n\n`{cmd}`\n\n{table}\n")
        print(table)
        return []
    device = torch.device("cpu" if args.quick or not torch.cuda.is_available() else "cuda")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    lengths = countdown_lengths(args.prompts, args.generations, seed=args.seed, quick=args.quick)
    cmd = "python benchmarks/bench_learner.py " + " ".join(argv if argv is not None else sys.argv[1:])
    start = time.perf_counter()
    deadline = start + args.budget_s
    _say(f"bench_learner on {_device_name(device)}, torch {torch.__version__}, {dtype}; {len(lengths[1])} sequences, "
         f"{sum(lengths[0]) + sum(lengths[1])} real tokens per step; models {args.models}; budget {args.budget_s:.0f}s")
    rows = []
    for name in args.models.split(","):
        # padded first: no compile, so its figure comes in even if packed's warm-up (flex_attention's compile on
        # CUDA) is long
        for mode, attn in (("padded", args.padded_attn), ("packed", choose_attn_implementation(args.attn, device))):
            t0 = time.perf_counter()
            if t0 > deadline:
                rows.append(_error_row(name, mode, attn, device, lengths, "skipped: time budget"))
                _say(f"[{name} {mode} {attn}] skipped: time budget")
                continue
            try:
                rows.append(run_one(name, mode, attn, args, device, dtype, lengths, deadline))
            except Exception as e:  # one failing backend must not hide the other figures
                if args.quick:
                    raise
                rows.append(_error_row(name, mode, attn, device, lengths, f"{type(e).__name__}: {str(e)[:120]}"))
            r = rows[-1]
            _say(f"[{name} {mode} {attn}] {time.perf_counter() - t0:.1f}s in all: step {r.step_s:.3f}s, "
                 f"{r.tokens_per_s:,.0f} tokens/s {r.error}")
            _write(rows, args.out, cmd, device)  # after every run: a kill from outside keeps what is done
    table = markdown(rows)
    print(table, flush=True)
    return rows


def _error_row(name, mode, attn, device, lengths, error: str) -> Row:
    return Row(model=name, mode=mode, attn=attn, device=_device_name(device), sequences=len(lengths[1]),
               real_tokens=0, slots=0, microbatches=0, step_s=float("nan"), tokens_per_s=float("nan"), mfu=None,
               peak_mem_gb=None, check_logp=float("nan"), grad_norm=float("nan"), error=error)


def _write(rows: list[Row], out: str, cmd: str, device: torch.device) -> None:
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_suffix(".csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(asdict(rows[0])))
        writer.writeheader()
        writer.writerows(asdict(r) for r in rows)
    out.with_suffix(".md").write_text(f"{time.strftime('%Y-%m-%d')} on {_device_name(device)}, torch "
                                      f"{torch.__version__}\n\n`{cmd}`\n\n{markdown(rows)}\n")


if __name__ == "__main__":
    main()
