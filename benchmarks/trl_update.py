"""``bench_trl.py --update-only``: TRL's policy update against fastgrpo's on one fixed rollout batch.

No generation, no rewards: one rollout batch of S sequences is drawn once (Countdown-like lengths, as
``bench_learner.countdown_lengths`` draws them: prompts uniform in [100, 150] tokens shared by a group of G,
completions lognormal around --completion-mean, capped at --completion-cap), with one advantage per sequence, and
both trainers run their own update on it, in one process, on two copies of the same random-weight model (one
folder, ``peer_work.build_model_folder``):

  TRL       its GRPOTrainer, built as a user builds it (model folder, GRPOConfig), fed the batch in the layout its
            rollout returns (``_generate_and_score_completions`` replaced by one returning the batch: prompts
            left-padded and completions right-padded to the longest of the whole batch, masks, advantages,
            num_items_in_batch); then what its training loop does per optimizer step: ``training_step`` on each of
            the S / per_device_train_batch_size micro-batches (its ``_prepare_inputs`` shuffles and splits the batch,
            its ``compute_loss`` runs the model with TRL's fused lm_head, its backward), gradient clipping, the
            optimizer's step, zeroed gradients. bf16 on CUDA as TRL's ``bf16=True``: float32 weights under autocast.
  fastgrpo  ``fastgrpo.algorithms.grpo.grpo_update`` on the same sequences, packed, with the model built as the trainer
            builds it (``load_model`` float32, ``parallelize_model``: on one CUDA rank autocast to bf16 over float32
            masters; float32 on CPU) and the trainer's AdamW.

Checked first: one step's gradients, before clipping and with no optimizer step, agree between the two (max
absolute difference, and that over the largest gradient entry). Then alternated pairs of steps, order A B, B A,
...; per step the seconds (synchronised) and the peak memory above what was allocated before it (weights and
optimizer state of both models are resident throughout; CUDA ``max_memory_allocated``, or on CPU torch's allocator
from profiler events in one extra untimed step per side, ``harness.peak_cpu_alloc_mb``). The control batch has the
same sequences at one length (every prompt and every completion at the batch's rounded mean length): no padding
in TRL's layout, so the ratio there is what the two updates cost apart from padding.
"""

from __future__ import annotations

import json
import platform
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

LOSS_TYPES = ("dapo", "dr_grpo", "grpo", "bnpo")
"""Loss types both updates run under the same name and normaliser (the parity check confirms it)."""


@dataclass(frozen=True, kw_only=True)
class Batch:
    """One rollout batch: S sequences in G-sized groups, one advantage per sequence."""

    name: str
    prompts: list[list[int]]
    completions: list[list[int]]
    advantages: torch.Tensor
    """[S] float32."""

    @property
    def real_tokens(self) -> int:
        return sum(len(p) + len(c) for p, c in zip(self.prompts, self.completions))

    @property
    def padded_slots(self) -> int:
        """Token slots of TRL's layout: S x (longest prompt + longest completion of the batch)."""
        return len(self.prompts) * (max(map(len, self.prompts)) + max(map(len, self.completions)))

    @property
    def padding_frac(self) -> float:
        return 1.0 - self.real_tokens / self.padded_slots


def draw_batches(sequences: int, generations: int, vocab: int, *, seed: int, completion_mean: float,
                 completion_cap: int) -> tuple[Batch, Batch]:
    """The Countdown-like batch and its one-length control (the same token ids, cut or extended to the means)."""
    from benchmarks.bench_learner import countdown_lengths

    if sequences % generations:
        raise ValueError(f"--sequences {sequences} must be a multiple of --generations {generations}")
    p_lens, c_lens = countdown_lengths(sequences // generations, generations, seed=seed, quick=False,
                                       mean=completion_mean, cap=completion_cap)
    g = torch.Generator().manual_seed(seed + 1)
    adv = torch.randn(sequences, generator=g)  # [S]; non-zero everywhere: no side can skip a sequence
    p_mean, c_mean = round(statistics.mean(p_lens)), round(statistics.mean(c_lens))
    longest_p, longest_c = max(max(p_lens), p_mean), max(max(c_lens), c_mean)
    ids_p = torch.randint(3, vocab, (sequences, longest_p), generator=g).tolist()  # [S, Pmax]; 0-2: special ids
    ids_c = torch.randint(3, vocab, (sequences, longest_c), generator=g).tolist()  # [S, Cmax]
    countdown = Batch(name="countdown lengths", prompts=[r[:n] for r, n in zip(ids_p, p_lens)],
                      completions=[r[:n] for r, n in zip(ids_c, c_lens)], advantages=adv)
    control = Batch(name="one length (control)", prompts=[r[:p_mean] for r in ids_p],
                    completions=[r[:c_mean] for r in ids_c], advantages=adv)
    return countdown, control


def trl_rollout_output(batch: Batch, device: torch.device, pad_id: int) -> dict:
    """The dict TRL's ``_generate_and_score_completions`` returns for ``batch`` (no old / reference log-probs:
    num_iterations 1, beta 0): prompts left-padded, completions right-padded, both to the batch's longest."""
    S, P, C = len(batch.prompts), max(map(len, batch.prompts)), max(map(len, batch.completions))
    prompt_ids = torch.full((S, P), pad_id, dtype=torch.long)  # [S, P]
    prompt_mask = torch.zeros(S, P, dtype=torch.long)
    completion_ids = torch.full((S, C), pad_id, dtype=torch.long)  # [S, C]
    completion_mask = torch.zeros(S, C, dtype=torch.long)
    for i, (p, c) in enumerate(zip(batch.prompts, batch.completions)):
        prompt_ids[i, P - len(p):] = torch.tensor(p)
        prompt_mask[i, P - len(p):] = 1
        completion_ids[i, :len(c)] = torch.tensor(c)
        completion_mask[i, :len(c)] = 1
    out = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
           "completion_mask": completion_mask, "advantages": batch.advantages.clone(),
           "num_items_in_batch": completion_mask.sum()}
    return {k: v.to(device) for k, v in out.items()}


# -- the two sides ----------------------------------------------------------------------------------------------


class TRLSide:
    """TRL's GRPOTrainer doing its optimizer step on a fixed batch (module docstring)."""

    name = "trl"

    def __init__(self, model_dir: Path, *, sequences: int, generations: int, micro_batch: int, loss_type: str,
                 max_completion_length: int, lr: float, device: torch.device, workdir: Path):
        import datasets
        from transformers import AutoTokenizer
        from trl import GRPOConfig, GRPOTrainer

        if sequences % micro_batch:
            raise ValueError(f"--trl-micro-batch {micro_batch} must divide --sequences {sequences}")
        cuda = device.type == "cuda"
        args = GRPOConfig(
            output_dir=str(workdir), per_device_train_batch_size=micro_batch,
            gradient_accumulation_steps=sequences // micro_batch, num_generations=generations,
            max_completion_length=max_completion_length, loss_type=loss_type, beta=0.0, epsilon=0.2,
            learning_rate=lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, adam_beta1=0.9,
            adam_beta2=0.99, max_grad_norm=1.0, gradient_checkpointing=False, bf16=cuda, use_cpu=not cuda,
            model_init_kwargs={"dtype": "float32", "attn_implementation": "sdpa"}, report_to="none",
            save_strategy="no", disable_tqdm=True, log_completions=False, dataloader_num_workers=0)
        tok = AutoTokenizer.from_pretrained(model_dir)
        never_called = [lambda completions, **_: [0.0] * len(completions)]  # no rollout, so no rewards
        self.trainer = GRPOTrainer(model=str(model_dir), reward_funcs=never_called, args=args, processing_class=tok,
                                   train_dataset=datasets.Dataset.from_list([{"prompt": "x"}] * sequences))
        tr = self.trainer
        tr.create_optimizer()
        # What Trainer's training loop does before its first step (accelerate: autocast under bf16, device).
        self.model, tr.optimizer = tr.accelerator.prepare(tr.model, tr.optimizer)
        tr.current_gradient_accumulation_steps = args.gradient_accumulation_steps
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else 0
        self.device, self.batch, self.steps = device, None, args.gradient_accumulation_steps

    def set_batch(self, batch: Batch) -> None:
        out = trl_rollout_output(batch, self.device, self.pad_id)
        # Its rollout phase, replaced: _prepare_inputs still shuffles, splits and buffers as in training.
        self.trainer._generate_and_score_completions = lambda _generation_batch: dict(out)
        self.trainer._buffered_inputs = None
        self.trainer._step = 0

    def backward(self) -> None:
        """Gradients of one optimizer step, summed over its micro-batches (not clipped, not applied)."""
        tr = self.trainer
        for _ in range(self.steps):
            tr.training_step(self.model, {}, None)

    def step(self) -> None:
        tr = self.trainer
        self.backward()
        tr.accelerator.clip_grad_norm_(self.model.parameters(), tr.args.max_grad_norm)  # as Trainer's loop
        tr.optimizer.step()
        self.model.zero_grad()

    def named_grads(self) -> dict[str, torch.Tensor]:
        return {_plain_name(n): p.grad for n, p in self.trainer.model.named_parameters() if p.grad is not None}

    def zero_grad(self) -> None:
        self.model.zero_grad(set_to_none=True)


class FastGRPOSide:
    """fastgrpo's ``grpo_update`` with the model and optimizer the trainer builds (module docstring)."""

    name = "fastgrpo"

    def __init__(self, model_dir: Path, *, loss_type: str, max_completion_length: int, lr: float,
                 device: torch.device, microbatch_tokens: int | None, overrides: list[str] = ()):
        from fastgrpo.config import GRPOConfig, ModelConfig, OptimConfig, RolloutConfig, load_config
        from fastgrpo.models.loading import load_model
        from fastgrpo.update.bundle import build_trained

        # --fastgrpo-set: the parallel section (bf16 masters, buckets, graphs...) and the micro-batch budget
        cfg = load_config(None, list(overrides))
        model = load_model(ModelConfig(name_or_path=str(model_dir), dtype="float32"), device=device,
                           dtype=torch.float32)
        trained = build_trained(model, parallel=cfg.parallel, optim=OptimConfig(lr=lr, betas=[0.9, 0.99],
                                weight_decay=0.0), device=device, world_size=1, total_steps=1)  # as the trainer
        self.model, self.runner, self.optimizer = trained.model, trained.runner, trained.optimizer
        self.grpo = GRPOConfig(loss_type=loss_type, beta=0.0, epsilon_low=0.2, epsilon_high=0.2,
                               max_tokens_per_microbatch=cfg.grpo.max_tokens_per_microbatch or microbatch_tokens)
        self.rollout = RolloutConfig(max_completion_length=max_completion_length)
        self.device, self.batch = device, None
        self.sized_tokens = None  # the trainer's CUDA default: sized from free memory at the first update

    def _budget(self) -> int | None:
        """As ``Trainer.microbatch_tokens``: None on a CPU or with --microbatch-tokens; else sized once."""
        from fastgrpo.update.microbatch import auto_microbatch_tokens

        if self.grpo.max_tokens_per_microbatch is not None or self.device.type != "cuda":
            return None
        if self.sized_tokens is None:
            sizing = auto_microbatch_tokens(self.model, self.optimizer, device=self.device, compute_bytes=2)
            self.sized_tokens = sizing.tokens
            print(f"fastgrpo micro-batch budget: {sizing.describe()}", flush=True)
        return self.sized_tokens

    def set_batch(self, batch: Batch) -> None:
        from fastgrpo.algorithms.grpo import GRPOBatch

        self.batch = GRPOBatch(prompt_ids=batch.prompts, completion_ids=batch.completions,
                               advantages=batch.advantages.to(self.device))

    def _update(self, optimizer, max_grad_norm: float) -> None:
        from fastgrpo.runtime.metrics import StepMetrics
        from fastgrpo.algorithms.grpo import grpo_update

        metrics = StepMetrics()
        grpo_update(self.runner, self.batch, grpo=self.grpo, rollout=self.rollout, optimizer=optimizer,
                    max_grad_norm=max_grad_norm, metrics=metrics, device=self.device,
                    max_tokens_per_microbatch=self._budget())
        metrics.reduce()  # the trainer reads its metrics once per step

    def backward(self) -> None:
        """Gradients of one update (no clipping: max_grad_norm 0; an optimizer that moves nothing)."""
        self._update(torch.optim.SGD(self.model.parameters(), lr=0.0), 0.0)

    def step(self) -> None:
        self._update(self.optimizer, 1.0)

    def named_grads(self) -> dict[str, torch.Tensor]:
        return {_plain_name(n): p.grad for n, p in self.model.named_parameters() if p.grad is not None}

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)


def _plain_name(name: str) -> str:
    """A parameter's name without wrappers' prefixes (torch.compile, checkpointing, accelerate)."""
    for wrapper in ("_orig_mod.", "_checkpoint_wrapped_module.", "module."):
        name = name.replace(wrapper, "")
    return name


def grad_parity(a, b) -> dict:
    """One step's gradients of both sides on the current batch: max |diff| and that over max |grad|."""
    a.backward()
    b.backward()
    ga, gb = a.named_grads(), b.named_grads()
    if set(ga) != set(gb):
        raise RuntimeError(f"parameters differ between the sides: {sorted(set(ga) ^ set(gb))[:6]}")
    diff = max(float((ga[k].float() - gb[k].float()).abs().max()) for k in ga)
    scale = max(float(gb[k].float().abs().max()) for k in gb)
    a.zero_grad()
    b.zero_grad()
    return {"max_abs_diff": diff, "max_rel_diff": diff / scale if scale else float("nan"), "max_abs_grad": scale,
            "parameters": len(ga)}


# -- timing -----------------------------------------------------------------------------------------------------


def timed_step(side, device: torch.device) -> tuple[float, float | None]:
    """(seconds, peak MB above the allocation before the step; None on CPU)."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    side.step()
    if cuda:
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    return dt, (torch.cuda.max_memory_allocated() - base) / 2**20 if cuda else None


def measure(sides: dict, batches: list[Batch], *, pairs: int, device: torch.device, budget_s: float | None,
            say=print) -> dict:
    """Per batch: a warm-up step per side, the CPU memory step, then alternated pairs (A B, B A, ...), batches taking
    turns pair by pair; no pair starts that the batch's previous pair says would end past ``budget_s``."""
    from benchmarks.harness import peak_cpu_alloc_mb

    start = time.perf_counter()
    res = {b.name: {"seconds": {n: [] for n in sides}, "peak_mb": {n: [] for n in sides}, "pairs": 0}
           for b in batches}
    for b in batches:
        for name, side in sides.items():
            side.set_batch(b)
            t0 = time.perf_counter()
            side.step()  # warm-up: optimizer state, kernel caches
            say(f"[{b.name}] {name} warm-up step {time.perf_counter() - t0:.2f}s")
            if device.type != "cuda":
                res[b.name]["peak_mb"][name].append(peak_cpu_alloc_mb(side.step))
    last_pair: dict[str, float] = {}
    names = list(sides)
    for rep in range(pairs):
        order = names if rep % 2 == 0 else names[::-1]
        for b in batches:
            if budget_s is not None and rep and time.perf_counter() - start + last_pair.get(b.name, 0.0) > budget_s:
                say(f"[{b.name}] pair {rep}: skipped (time budget)")
                continue
            t0 = time.perf_counter()
            for name in order:
                sides[name].set_batch(b)
                dt, peak = timed_step(sides[name], device)
                res[b.name]["seconds"][name].append(dt)
                if peak is not None:
                    res[b.name]["peak_mb"][name].append(peak)
            res[b.name]["pairs"] += 1
            last_pair[b.name] = time.perf_counter() - t0
            s = res[b.name]["seconds"]
            say(f"[{b.name}] pair {rep} ({' then '.join(order)}): fastgrpo {s['fastgrpo'][-1]:.3f}s, "
                f"trl {s['trl'][-1]:.3f}s, ratio {s['fastgrpo'][-1] / s['trl'][-1]:.3f}")
    return res


def _spread(xs: list[float], digits: int = 3) -> str:
    if not xs:
        return "n/a"
    return f"{statistics.median(xs):.{digits}f} ({min(xs):.{digits}f}-{max(xs):.{digits}f})"


def markdown(report: dict) -> str:
    head = (f"{report['device']}, {report['dtype']}; model {report['shape']} (random weights), S = "
            f"{report['sequences']} sequences (G = {report['generations']}), loss {report['loss_type']}, TRL "
            f"micro-batch {report['trl_micro_batch']} sequences, fastgrpo's {report['fastgrpo_microbatch_tokens']} "
            f"tokens{' (' + ' '.join(report['fastgrpo_set']) + ')' if report.get('fastgrpo_set') else ''}; "
            f"gradient parity (one step, before clipping): max abs diff "
            f"{report['parity']['max_abs_diff']:.3g}, over the largest gradient {report['parity']['max_rel_diff']:.3g}"
            f"\n\n")
    lines = ["| batch | real tokens | TRL slots | padding | pairs | fastgrpo s | TRL s | fastgrpo / TRL, median "
             "(range) | peak MB fastgrpo | peak MB TRL | peak ratio |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for b in report["batches"]:
        s, m = b["seconds"], b["peak_mb"]
        ratios = [x / y for x, y in zip(s["fastgrpo"], s["trl"])]
        mem = [x / y for x, y in zip(m["fastgrpo"], m["trl"])]
        lines.append(f"| {b['name']} | {b['real_tokens']:,} | {b['padded_slots']:,} | {100 * b['padding_frac']:.0f}% "
                     f"| {b['pairs']} | {_spread(s['fastgrpo'])} | {_spread(s['trl'])} | {_spread(ratios, 2)} | "
                     f"{_spread(m['fastgrpo'], 0)} | {_spread(m['trl'], 0)} | {_spread(mem, 2)} |")
    return head + "\n".join(lines) + "\n"


def run(args, argv_text: str, root: Path, say=print) -> dict:
    """The whole --update-only run (``bench_trl.main`` parses the arguments; model folders under ``root``, shared
    with bench_trl's runs); writes OUT.json and OUT.md."""
    from benchmarks.peer_work import SHAPES, build_model_folder

    if args.shape not in ("tiny", *SHAPES):
        raise SystemExit(f"bench_trl --update-only: --shape must be 'tiny' or one of {sorted(SHAPES)}, got "
                         f"{args.shape!r}")
    if args.loss_type not in LOSS_TYPES:
        raise SystemExit(f"bench_trl --update-only: --loss-type must be one of {LOSS_TYPES}, got {args.loss_type!r}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model_dir = build_model_folder(args.shape, root / "models" / f"{args.shape}-noeos-seed{args.seed}", seed=args.seed)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    batches = list(draw_batches(args.sequences, args.generations, vocab, seed=args.seed,
                                completion_mean=args.completion_mean, completion_cap=args.completion_cap))
    if args.no_control:
        batches = batches[:1]
    cap = max(len(c) for b in batches for c in b.completions)
    torch.manual_seed(args.seed)
    t0 = time.perf_counter()
    sides = {"fastgrpo": FastGRPOSide(model_dir, loss_type=args.loss_type, max_completion_length=cap, lr=1e-6,
                                      device=device, microbatch_tokens=args.microbatch_tokens,
                                      overrides=getattr(args, "fastgrpo_set", [])),
             "trl": TRLSide(model_dir, sequences=args.sequences, generations=args.generations,
                            micro_batch=args.trl_micro_batch, loss_type=args.loss_type, max_completion_length=cap,
                            lr=1e-6, device=device, workdir=root / "trl-out")}
    say(f"both models built in {time.perf_counter() - t0:.1f}s on {device}")
    for side in sides.values():
        side.set_batch(batches[0])
    parity = grad_parity(sides["trl"], sides["fastgrpo"])
    say(f"gradient parity ({parity['parameters']} tensors): max abs diff {parity['max_abs_diff']:.3g}, over the "
        f"largest gradient {parity['max_rel_diff']:.3g}")
    res = measure(sides, batches, pairs=args.repeats, device=device, budget_s=args.budget_s, say=say)
    from fastgrpo.update.step import microbatch_tokens
    report = {"command": argv_text, "date": time.strftime("%Y-%m-%d"), "shape": args.shape,
              "device": torch.cuda.get_device_name() if device.type == "cuda"
              else f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)",
              "dtype": ("bf16 weights, float32 masters" if sides["fastgrpo"].runner.autocast_dtype is None
                        and next(sides["fastgrpo"].model.parameters()).dtype == torch.bfloat16
                        else "bf16 autocast, float32 weights" if device.type == "cuda" else "float32"),
              "fastgrpo_set": list(getattr(args, "fastgrpo_set", [])),
              "sequences": args.sequences, "generations": args.generations, "loss_type": args.loss_type,
              "trl_micro_batch": args.trl_micro_batch, "parity": parity, "versions": _versions(),
              "fastgrpo_microbatch_tokens": (sides["fastgrpo"].grpo.max_tokens_per_microbatch
                                             or sides["fastgrpo"].sized_tokens or microbatch_tokens(None, device)),
              "batches": [{"name": b.name, "real_tokens": b.real_tokens, "padded_slots": b.padded_slots,
                           "padding_frac": b.padding_frac, **res[b.name]} for b in batches]}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=1))
    text = markdown(report)
    out.with_suffix(".md").write_text(f"{report['date']}, {report['versions']}\n\n`{argv_text}`\n\n{text}")
    say(text)
    return report


def _versions() -> dict:
    out = {}
    for mod in ("torch", "transformers", "trl", "accelerate"):
        try:
            out[mod] = __import__(mod).__version__
        except ImportError:
            out[mod] = None
    return out

