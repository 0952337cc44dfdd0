"""Rollout throughput (vLLM vs the transformers engine) and vLLM weight-sync speed.

    python benchmarks/bench_rollout.py                       # the tiny model, on whatever device there is
    python benchmarks/bench_rollout.py --model-path ~/Qwen2.5-0.5B-Instruct --prompts 32 --n 8 --max-tokens 256

Both engines get the same pre-tokenized prompts and sampling settings; tokens/s counts generated tokens
(EOS included) over the wall time of one generate() call after one warm-up call. Weight sync streams the
policy's parameters (``iter_full_tensors``) into the engine; seconds per GB is wall time / bytes sent.
Multi-turn rows (``--turns``, default 3): the same prompts rolled out as conversations of ``--turns`` model turns
(``max_tokens // turns`` tokens each) with a short user message after each, through the multi-turn driver that
training uses (fastgrpo.environments.trajectory), one generate() call per turn on the conversation so far; tokens/s
counts the model's tokens. Prints a markdown table and writes it, with a CSV, under --out.

    python benchmarks/bench_rollout.py --hf-vs-generate [--shape qwen2.5-0.5b] --rounds 3

--hf-vs-generate: the transformers engine's decode loop against transformers' own ``model.generate`` (sampling
with the same temperature, top_k=0 and top_p=1, so both draw from the same distribution), on the same model and
prompts, in alternated rounds; no vLLM. Reports median seconds, tokens, and the ratio per round.

    python benchmarks/bench_rollout.py --lean-vs-transformers --no-eos --prompts 2 --n 8 --prompt-len 272 \
        --max-tokens 64
    python benchmarks/bench_rollout.py --lean-vs-transformers --no-eos --shape tiny-small --prompts 16 --n 8 \
        --prompt-len 11 --max-tokens 40 --hf-batch-size 256

--lean-vs-transformers: the transformers engine with its lean decode step (``rollout.hf.decode=lean``) against the
same engine stepping through transformers' forward (``hf_decode=transformers``), same seed, alternated rounds; it
also checks that both produced the same tokens. The first line is bench_trl's tiny work (2 x 8 sequences, 272-token
prompts, 64 new tokens), the second the CPU demo's rollout (configs/tiny.yaml: 16 x 8, short prompts, 40 tokens,
the tiny:small shape with random weights).
"""

from __future__ import annotations

import argparse
import csv
import datetime
import platform
import random
import subprocess
import sys
import time
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fastgrpo.rollout.base import Completion, RolloutEngine, SamplingParams  # noqa: E402
from fastgrpo.models.policy_state import iter_full_tensors  # noqa: E402


def device_name() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        model = next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
        return f"{model} ({torch.get_num_threads()} torch threads)"
    except (OSError, subprocess.CalledProcessError, StopIteration):
        return platform.processor() or "cpu"


# Qwen2.5-0.5B's shapes (public config.json), for a random-weight model of realistic size without the hub.
QWEN25_05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                  num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768, tie_word_embeddings=True)


def random_model_folder(shape: dict, cache: Path) -> Path:
    """A random-weight Qwen2 folder with ``shape``, reusing the tiny model's tokenizer (ids < 263 only)."""
    from transformers import AutoConfig, AutoModelForCausalLM, Qwen2Config

    from fastgrpo.models.tiny import build_tiny

    out = cache / f"random-qwen2-{shape['hidden_size']}x{shape['num_hidden_layers']}"
    if (out / "config.json").is_file():
        return out
    tiny = build_tiny(seed=0)
    ids = AutoConfig.from_pretrained(tiny)
    cfg = Qwen2Config(**shape, head_dim=shape["hidden_size"] // shape["num_attention_heads"],
                      eos_token_id=ids.eos_token_id, pad_token_id=ids.pad_token_id, bos_token_id=ids.bos_token_id)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(out)
    for f in tiny.iterdir():
        if f.name.startswith("tokenizer") or f.name.startswith("chat_template") or f.name == "special_tokens_map.json":
            (out / f.name).write_bytes(f.read_bytes())
    return out


def timed_generate(engine, prompts, n, sampling) -> tuple[float, int]:
    engine.generate(prompts[:2], n, sampling)  # warm-up (allocations, lazy init)
    start = time.perf_counter()
    out = engine.generate(prompts, n, sampling)
    seconds = time.perf_counter() - start
    return seconds, sum(len(c.token_ids) for row in out for c in row)


class TurnCap(RolloutEngine):
    """A rollout engine whose model turns end after ``k`` sampled tokens, as if the model had stopped there: a random
    model rarely samples EOS, and a turn that hits the length limit ends its trajectory. Its tokens and log-probs are
    the wrapped engine's own samples (tests/test_multiturn.py uses it too)."""

    def __init__(self, engine: RolloutEngine, k: int) -> None:
        self.engine, self.k = engine, k

    def sync_from(self, model) -> bool:
        return self.engine.sync_from(model)

    def update_weights(self, named_tensors) -> None:
        self.engine.update_weights(named_tensors)

    def wake(self) -> None:
        self.engine.wake()

    def sleep(self) -> None:
        self.engine.sleep()

    def generate(self, prompts, n, sampling):
        params = SamplingParams(**{**vars(sampling), "max_tokens": min(self.k, sampling.max_tokens)})
        cut = params.max_tokens < sampling.max_tokens
        return [[Completion(token_ids=c.token_ids, text=c.text, logprobs=c.logprobs,
                            finish_reason="stop" if cut else c.finish_reason) for c in g]
                for g in self.engine.generate(prompts, n, params)]


def multi_turn_generate(engine, tokenizer, prompts, n, sampling, turns: int) -> tuple[float, int, int]:
    """One multi-turn rollout (fastgrpo.environments.trajectory.run_trajectories) of ``turns`` model turns of
    ``sampling.max_tokens // turns`` tokens each, a short user message between them, after one warm-up; returns
    (seconds, model tokens, all tokens after the prompts)."""
    from fastgrpo.environments import Environment
    from fastgrpo.environments.trajectory import ObservationRenderer, run_trajectories

    class Ack(Environment):
        def step(self, text):
            return "ok, go on", None, False

    render = ObservationRenderer(tokenizer)
    per_turn = max(1, sampling.max_tokens // turns)
    env_tokens = len(render([{"role": "user", "content": "ok, go on"}]))
    budget = SamplingParams(**{**vars(sampling), "max_tokens": turns * (per_turn + env_tokens)})

    def once(ps):
        return run_trajectories(TurnCap(engine, per_turn), [Ack() for _ in range(len(ps) * n)], ps, group_size=n,
                                sampling=budget, max_turns=turns, render=render, tokenizer=tokenizer)

    once(prompts[:2])  # warm-up
    start = time.perf_counter()
    trajs = once(prompts)
    seconds = time.perf_counter() - start
    return seconds, sum(sum(t.model_mask) for t in trajs), sum(len(t.ids) for t in trajs)


def alternated(fns: dict, base: str, rounds: int, what: str = "decode loop") -> tuple[str, dict[str, list[float]]]:
    """Run each fn (returning its token count) once to warm up, then ``rounds`` times in turn; a markdown table with
    median seconds, spread, tokens/s and the median per-round ratio to ``base``, and the seconds of every round."""
    import statistics

    for fn in fns.values():  # warm-up
        fn()
    secs = {k: [] for k in fns}
    toks = {k: [] for k in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            toks[name].append(fn())
            secs[name].append(time.perf_counter() - t0)
    lines = [f"| {what} | s (median) | spread | tokens (median) | tokens/s | x {base} (median of per-round ratios) |",
             "|---|---|---|---|---|---|"]
    for name in fns:
        s_med, t_med = statistics.median(secs[name]), statistics.median(toks[name])
        ratios = [a / b for a, b in zip(secs[name], secs[base])]
        lines.append(f"| {name} | {s_med:.3f} | {min(secs[name]):.3f}-{max(secs[name]):.3f} | {t_med:.0f} | "
                     f"{t_med / s_med:,.0f} | {statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f}) |")
    return "\n".join(lines), secs


def lean_vs_transformers(model, tokenizer, prompts, n, sampling, rounds: int, batch_size: int) -> str:
    """Alternated rounds: HFEngine with the lean decode step vs with transformers' forward; same seed, same tokens.

    A third contender generates one token only (prompt forward + one draw, no decode step: the same for both paths);
    each path's decode phase per round is its time minus that one's, divided by the max_tokens - 1 steps."""
    import dataclasses
    import statistics

    from fastgrpo.rollout.hf import HFEngine

    engines = {f"HFEngine, hf_decode={d}": HFEngine(model, tokenizer, batch_size=batch_size, decode=d)
               for d in ("transformers", "lean")}
    outputs = {}

    def runner(name):
        def fn():
            out = engines[name].generate(prompts, n, sampling)
            outputs[name] = [c.token_ids for row in out for c in row]
            return sum(len(ids) for ids in outputs[name])
        return fn

    base, prefill = "HFEngine, hf_decode=transformers", "prompt forward + 1 token (max_tokens=1)"
    one_token = dataclasses.replace(sampling, max_tokens=1)
    fns = {name: runner(name) for name in engines}
    fns[prefill] = lambda: sum(len(c.token_ids) for row in engines[base].generate(prompts, n, one_token) for c in row)
    table, secs = alternated(fns, base, rounds)
    same = outputs[base] == outputs["HFEngine, hf_decode=lean"]
    steps = sampling.max_tokens - 1
    per_step = {name: [1e3 * (a - b) / steps for a, b in zip(secs[name], secs[prefill])] for name in engines}
    ratios = [a / b for a, b in zip(per_step["HFEngine, hf_decode=lean"], per_step[base])]
    lines = [f"- {name}: decode phase {statistics.median(ms):.2f} ms per step ({min(ms):.2f}-{max(ms):.2f})"
             for name, ms in per_step.items()]
    lines.append(f"- lean / transformers, decode phase per round: median {statistics.median(ratios):.2f} "
                 f"({min(ratios):.2f}-{max(ratios):.2f}), i.e. {1 / statistics.median(ratios):.2f}x faster")
    lines.append(decode_floor_line(model, len(prompts) * n, batch_size, prompt_len=len(prompts[0]) if prompts else 0,
                                   steps=steps, lean_ms=statistics.median(per_step["HFEngine, hf_decode=lean"])))
    return table + "\n\n" + "\n".join(lines) + f"\n\nsame tokens from both paths: {same}"


def decode_floor_line(model, sequences: int, batch_size: int, *, prompt_len: int, steps: int, lean_ms: float) -> str:
    """The decode step's memory-bandwidth floor (weights and the key / value cache read once per step, at the card's
    peak bandwidth; ``fastgrpo.runtime.step_cost.decode_step_bytes``) against the lean step's measured time. The mean
    context of a step is the prompt plus half the new tokens (every sequence runs all steps under --no-eos)."""
    from fastgrpo.runtime.peaks import device_peak_bandwidth
    from fastgrpo.runtime.step_cost import decode_step_bytes

    context = prompt_len + (steps + 1) / 2
    need = decode_step_bytes(model, sequences=sequences, batch_size=batch_size, context=context)
    bandwidth = device_peak_bandwidth(next(model.parameters()).device)
    head = (f"- memory-bandwidth floor of a decode step ({sequences} sequences, batches of {batch_size}, mean context "
            f"{context:.0f} tokens): {need / 1e9:.3f} GB read")
    if bandwidth is None:
        return head + " (no bandwidth figure for this device: no floor in ms)"
    floor_ms = 1e3 * need / bandwidth
    return (head + f" / {bandwidth / 1e12:.2f} TB/s = {floor_ms:.3f} ms; the lean step takes {lean_ms:.3f} ms, "
            f"{lean_ms / floor_ms:.1f}x the floor")


def hf_vs_generate(model, tokenizer, prompts, n, sampling, rounds: int, batch_size: int) -> str:
    """Alternated rounds: HFEngine.generate vs transformers' generate on the same prompts; a markdown table."""
    from fastgrpo.rollout.hf import HFEngine

    engine = HFEngine(model, tokenizer, batch_size=batch_size)
    seqs = [p for p in prompts for _ in range(n)]

    def ours():
        out = engine.generate(prompts, n, sampling)
        return sum(len(c.token_ids) for row in out for c in row)

    def theirs():
        total = 0
        for start in range(0, len(seqs), batch_size):
            chunk = seqs[start:start + batch_size]
            enc = tokenizer.pad({"input_ids": chunk}, return_tensors="pt").to(model.device)
            with torch.no_grad():
                out = model.generate(**enc, do_sample=sampling.temperature > 0, temperature=sampling.temperature or None,
                                     top_k=0, top_p=1.0, max_new_tokens=sampling.max_tokens,
                                     pad_token_id=tokenizer.pad_token_id)
            new = out[:, enc["input_ids"].shape[1]:]  # [B, T]
            eos = torch.isin(new, torch.tensor(engine.eos_ids, device=new.device))
            total += int(torch.where(eos.any(-1), eos.int().argmax(-1) + 1, new.shape[1]).sum())
        return total

    return alternated({"fastgrpo HFEngine": ours, "transformers generate": theirs}, "transformers generate", rounds)[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default=None, help="local HF folder (default: the tiny model)")
    ap.add_argument("--shape", choices=["tiny", "tiny-small", "108m", "qwen2.5-0.5b"], default="tiny",
                    help="without --model-path: the tiny model, its 'small' preset (the demo's shape), or a random "
                         "model: bench_trl's 108M-style one or one of Qwen2.5-0.5B's shapes")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=8, help="completions per prompt")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--hf-batch-size", type=int, default=64)
    ap.add_argument("--sync-repeats", type=int, default=3)
    ap.add_argument("--dtype", default=None, help="float32 / bfloat16 (default: float32 on CPU, bfloat16 on CUDA)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--turns", type=int, default=3,
                    help="multi-turn rows: model turns of max_tokens // turns tokens each (0: no such rows)")
    ap.add_argument("--out", default="benchmarks/out")
    ap.add_argument("--hf-vs-generate", action="store_true", help="HFEngine vs transformers' generate (no vLLM)")
    ap.add_argument("--no-eos", action="store_true",
                    help="edit the loaded model so that it never samples EOS (benchmarks/peer_work.suppress_eos, as "
                         "bench_trl does): every completion has max_tokens tokens")
    ap.add_argument("--lean-vs-transformers", action="store_true",
                    help="HFEngine's lean decode step vs transformers' forward (no vLLM)")
    ap.add_argument("--rounds", type=int, default=3,
                    help="--hf-vs-generate / --lean-vs-transformers: alternated rounds")
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fastgrpo.rollout.hf import HFEngine
    from fastgrpo.rollout.vllm import VLLMEngine
    from fastgrpo.models.tiny import build_tiny

    cuda = torch.cuda.is_available()
    dtype_name = args.dtype or ("bfloat16" if cuda else "float32")
    dtype = getattr(torch, dtype_name)
    if args.model_path:
        path = Path(args.model_path).expanduser()
    elif args.shape in ("108m", "qwen2.5-0.5b"):
        from benchmarks.peer_work import SHAPES

        shape = QWEN25_05B if args.shape == "qwen2.5-0.5b" else {**SHAPES["108m"], "max_position_embeddings": 4096}
        path = random_model_folder(shape, Path.home() / ".cache" / "fastgrpo")
    else:
        path = build_tiny(seed=0, preset="small" if args.shape == "tiny-small" else "default")
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to("cuda" if cuda else "cpu").eval()
    if args.no_eos:
        from benchmarks.peer_work import eos_ids_of, suppress_eos

        suppress_eos(model, eos_ids_of(path))
    n_params = sum(p.numel() for p in model.parameters())
    rng = random.Random(0)
    vocab = len(tokenizer) if args.model_path else 256  # byte tokens of the tiny tokenizer
    prompts = [[rng.randrange(3, vocab) for _ in range(args.prompt_len)] for _ in range(args.prompts)]
    sampling = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=0)
    if args.hf_vs_generate or args.lean_vs_transformers:
        compare = lean_vs_transformers if args.lean_vs_transformers else hf_vs_generate
        table = compare(model, tokenizer, prompts, args.n, sampling, args.rounds, args.hf_batch_size)
        header = (f"device: {device_name()}; model: {path.name} ({n_params / 1e6:.2f} M params, {dtype_name}); "
                  f"{args.prompts} prompts x {args.n} samples, prompt {args.prompt_len} tokens, max_tokens "
                  f"{args.max_tokens}{' (no EOS)' if args.no_eos else ''}, T={args.temperature}; "
                  f"torch {torch.__version__}, transformers {transformers.__version__}; "
                  f"date {datetime.date.today().isoformat()}; command: python {' '.join(sys.argv)}")
        print(header + "\n\n" + table)
        return

    rows = []
    # multi-turn: the user messages between turns add tokens to the context (a few dozen per turn)
    vllm_engine = VLLMEngine(path, dtype=dtype_name, max_model_len=args.prompt_len + args.max_tokens + 64 * args.turns,
                             gpu_memory_utilization=args.gpu_memory_utilization, sleep_level=0)
    engines = {"vllm": vllm_engine}
    if not args.skip_hf:
        engines["hf"] = HFEngine(model, tokenizer, batch_size=args.hf_batch_size)
    for name, engine in engines.items():
        seconds, tokens = timed_generate(engine, prompts, args.n, sampling)
        rows.append({"what": "generate", "engine": name, "tokens": tokens, "seconds": seconds,
                     "tokens_per_s": tokens / seconds})
    for name, engine in engines.items() if args.turns > 0 else ():
        # tokens/s counts the model's tokens; the tool/user tokens between turns are prefilled, not sampled
        seconds, tokens, all_tokens = multi_turn_generate(engine, tokenizer, prompts, args.n, sampling, args.turns)
        rows.append({"what": f"multi_turn_generate ({args.turns} turns, {all_tokens} tokens with the user's)",
                     "engine": name, "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds})
    for _ in range(args.sync_repeats):
        vllm_engine.update_weights(iter_full_tensors(model))
        gb = vllm_engine.last_sync_bytes / 1e9
        rows.append({"what": "weight_sync", "engine": "vllm", "bytes": vllm_engine.last_sync_bytes,
                     "seconds": vllm_engine.last_sync_seconds, "seconds_per_gb": vllm_engine.last_sync_seconds / gb})
    vllm_engine.close()

    device = device_name()
    header = (f"device: {device}; model: {path.name} ({n_params / 1e6:.2f} M params, {dtype_name}); "
              f"{args.prompts} prompts x {args.n} samples, prompt {args.prompt_len} tokens, "
              f"max_tokens {args.max_tokens}, T={args.temperature}; "
              f"date {datetime.date.today().isoformat()}; command: python {' '.join(sys.argv)}")
    lines = ["| what | engine | tokens or bytes | seconds | tokens/s | s/GB |", "|---|---|---|---|---|---|"]
    for r in rows:
        amount = r.get("tokens", r.get("bytes"))
        tps = f"{r['tokens_per_s']:.0f}" if "tokens_per_s" in r else ""
        spg = f"{r['seconds_per_gb']:.2f}" if "seconds_per_gb" in r else ""
        lines.append(f"| {r['what']} | {r['engine']} | {amount} | {r['seconds']:.3f} | {tps} | {spg} |")
    table = header + "\n\n" + "\n".join(lines) + "\n"
    print(table)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "rollout.md").write_text(table)
    with open(out / "rollout.csv", "w", newline="") as f:
        fields = ["what", "engine", "tokens", "bytes", "seconds", "tokens_per_s", "seconds_per_gb"]
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        for r in rows:
            w.writerow({k: r.get(k, "") for k in fields} | {"what": r["what"]})
        f.write(f"# {header}\n")


if __name__ == "__main__":
    main()
