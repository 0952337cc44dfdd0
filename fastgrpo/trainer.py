"""The GRPO loop: rollout -> rewards -> advantages -> packed policy update -> weight sync -> logs/eval/checkpoint.

Legend: S sequences on this rank, N completion tokens on this rank (flat layout), H hidden size, V vocab.

A "step" is one rollout batch. With ``grpo.num_iterations = mu > 1`` the batch is reused for mu optimizer updates
(the PPO-style inner loop of GRPO); the old log-probs are then computed once, before the first update.
"""

from __future__ import annotations

import json
import math
import os
import signal
import threading

import torch

from fastgrpo import checkpoint as ckpt
from fastgrpo import distributed as fdist
from fastgrpo.config import TrainConfig, to_dict
from fastgrpo.data import build_datasets, render_prompt
from fastgrpo.data.sampler import PromptSampler
from fastgrpo.episodes import Episodes, collect_episodes, record_metrics
from fastgrpo.evaluate import evaluate
from fastgrpo.kernels import linear_grpo_loss, linear_logprobs, resolve_backend
from fastgrpo.losses import GlobalCounts, token_weights, truncated_importance_weights
from fastgrpo.metrics import JsonlSink, drop_records_after, ProgressBar, StepMetrics, Timer, WandbSink, device_peak_flops, update_flops
from fastgrpo.model import load_model, load_tokenizer, resolve_model_path
from fastgrpo.packing import MicroBatch, pack, plan_microbatches, split_to_count
from fastgrpo.parallelize import parallelize_model, uses_fsdp
from fastgrpo.rewards import load_reward_funcs
from fastgrpo.rollout import SamplingParams, build_engine

# Test hook: SIGKILL this process in the middle of the given step (after its rollout, before its update), so the
# kill-and-resume test is deterministic.
_FAULT_ENV = "FASTGRPO_FAULT_KILL_AT_STEP"


def build_scheduler(optimizer: torch.optim.Optimizer, *, warmup_steps: int, total_steps: int, schedule: str,
                    min_lr_ratio: float) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up, then constant or cosine decay to min_lr_ratio * lr at total_steps."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / (warmup_steps + 1)
        if schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def resolve_head_backend(name: str, device: torch.device) -> str:
    """The kernel path of the policy loss *and* of the old / reference log-probs: one numerics for both, so that
    ``exp(logp - old)`` is exactly 1 while the policy has not moved. ``auto``: cublas on CUDA, torch elsewhere."""
    return resolve_backend(name, device, needs_grad=True)


class Trainer:
    """Composes the components from a TrainConfig and runs the loop. ``run()`` returns the last metrics."""

    def __init__(self, cfg: TrainConfig) -> None:
        self.cfg = cfg
        self.device = fdist.init_distributed(cfg.device).device  # idempotent; train.py initialises it first
        self.rank, self.world_size = fdist.get_rank(), fdist.get_world_size()
        self.run_dir = cfg.run_dir
        self.is_main = self.rank == 0
        torch.manual_seed(cfg.seed)
        self.head_backend = resolve_head_backend(cfg.grpo.head_backend, self.device)

        # Cheap checks first: data and rewards fail before any model loads.
        self.reward_funcs = load_reward_funcs(cfg.rewards.funcs)
        self.train_rows, self.eval_rows, self.data_info = build_datasets(cfg.data)
        self.sampler = PromptSampler(len(self.train_rows), seed=cfg.data.seed, rank=self.rank,
                                     world_size=self.world_size)

        self.tokenizer = load_tokenizer(cfg.model, seed=cfg.seed)
        # Under FSDP on CUDA, 'auto' loads float32 master weights and FSDP computes in parallel.param_dtype: AdamW
        # updates of lr ~ 1e-6 vanish in bfloat16 weights (8 bits of mantissa).
        master_dtype = None
        if cfg.model.dtype == "auto" and self.device.type == "cuda" and \
                uses_fsdp(cfg.parallel, self.device, self.world_size):
            master_dtype = torch.float32
        model = load_model(cfg.model, device=self.device, dtype=master_dtype, seed=cfg.seed)
        self.model = parallelize_model(model, cfg.parallel, device=self.device, world_size=self.world_size)
        self.ref_model = None
        if cfg.grpo.beta > 0:  # the frozen reference, sharded the same way, forward only
            ref = load_model(cfg.model, device=self.device, seed=cfg.seed).eval().requires_grad_(False)
            self.ref_model = parallelize_model(ref, cfg.parallel, device=self.device, world_size=self.world_size)

        o = cfg.optim
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=o.lr, betas=tuple(o.betas),
                                           weight_decay=o.weight_decay)
        self.total_updates = cfg.max_steps * cfg.grpo.num_iterations
        self.scheduler = build_scheduler(self.optimizer, warmup_steps=o.warmup_steps, total_steps=self.total_updates,
                                         schedule=o.schedule, min_lr_ratio=o.min_lr_ratio)
        self.step = 0
        self.peak_flops = device_peak_flops(self.device)
        self._resume()

        self.prompt_cache: dict[int, tuple[str, list[int]]] = {}
        self.engine = self._build_engine()

    # ------------------------------------------------------------------------------------------------ setup

    def _build_engine(self):
        r = self.cfg.rollout
        if r.engine == "hf":
            return build_engine("hf", model=self.model, tokenizer=self.tokenizer, batch_size=r.batch_size)
        # The context must hold the longest prompt of either split plus a full completion: checked (or derived)
        # here, before the engine allocates anything.
        longest = max(len(ids) for ids in self.prompts(range(len(self.train_rows)), self.train_rows)[1]
                      + self.prompts(range(len(self.eval_rows)), self.eval_rows)[1])
        needed = longest + r.max_completion_length
        if r.max_model_len is not None and r.max_model_len < needed:
            raise ValueError(f"rollout.max_model_len={r.max_model_len} is shorter than the longest prompt "
                             f"({longest} tokens) + rollout.max_completion_length ({r.max_completion_length})")
        engine = build_engine(
            "vllm", model_path=str(resolve_model_path(self.cfg.model, seed=self.cfg.seed)), tokenizer=self.tokenizer,
            seed=self.cfg.seed + self.rank, gpu_memory_utilization=r.gpu_memory_utilization,
            max_model_len=r.max_model_len or needed, enable_prefix_caching=r.enable_prefix_caching,
            sleep_level=r.sleep_level, sync_bucket_mb=r.sync_bucket_mb, rank=self.rank,
            world_size=self.world_size, enforce_eager=r.enforce_eager)
        engine.update_weights(self._full_weights())  # the policy may differ from the files (resume)
        return engine

    def _full_weights(self):
        from fastgrpo.rollout.weight_sync import iter_full_tensors

        return iter_full_tensors(self.model)

    def _resume(self) -> None:
        path = ckpt.resolve_resume(self.cfg.checkpoint.resume, self.run_dir / "checkpoints")
        if path is None:
            return
        state = ckpt.load_checkpoint(path, model=self.model, optimizer=self.optimizer)
        self.scheduler.load_state_dict(state["scheduler"])
        sampler_state = dict(state["sampler"])
        if sampler_state["world_size"] != self.world_size:
            # Resharded resume: keep the epoch and the share of it already consumed (prompts seen globally), so
            # the data position is kept up to the rounding of one step.
            seen = sampler_state["offset"] * sampler_state["world_size"]
            sampler_state.update(world_size=self.world_size, rank=self.rank,
                                 offset=min(seen // self.world_size, self.sampler.per_rank))
        self.sampler.load_state_dict(sampler_state)
        self.step = int(state["step"])
        if self.is_main:
            print(f"[fastgrpo] resumed from {path} at step {self.step}", flush=True)

    def _save(self) -> None:
        state = {"step": self.step, "scheduler": self.scheduler.state_dict(), "sampler": self.sampler.state_dict()}
        ckpt.save_checkpoint(self.run_dir / "checkpoints", self.step, model=self.model, optimizer=self.optimizer,
                             trainer_state=state, keep_last=self.cfg.checkpoint.keep_last)

    # ------------------------------------------------------------------------------------------------ phases

    def prompts(self, indices: list[int], rows: list[dict]) -> tuple[list[str], list[list[int]]]:
        """Render and tokenize prompts of ``rows`` (the train or the eval split), cached per row."""
        texts, ids = [], []
        for i in indices:
            key = i if rows is self.train_rows else -1 - i
            if key not in self.prompt_cache:
                text = render_prompt(rows[i], template=self.cfg.data.template,
                                     system_prompt=self.cfg.data.system_prompt, tokenizer=self.tokenizer,
                                     task=rows[i].get("task", "countdown"))
                self.prompt_cache[key] = (text, self.tokenizer(text, add_special_tokens=False)["input_ids"])
            texts.append(self.prompt_cache[key][0])
            ids.append(self.prompt_cache[key][1])
        return texts, ids

    def rollout(self) -> Episodes:
        g, r = self.cfg.grpo, self.cfg.rollout
        idx = self.sampler.next_batch(g.prompts_per_step)
        rows = [self.train_rows[i] for i in idx]
        texts, ids = self.prompts(idx, self.train_rows)
        seed = (self.cfg.seed * 1_000_003 + self.step * 7919 + self.rank) % (2**31)
        sampling = SamplingParams(max_tokens=r.max_completion_length, temperature=r.temperature, top_p=r.top_p,
                                  seed=seed, logprobs=r.importance_sampling_cap is not None)
        self.engine.wake()
        try:
            return collect_episodes(self.engine, rows, texts, ids, group_size=g.num_generations, sampling=sampling,
                                    reward_funcs=self.reward_funcs, reward_weights=self.cfg.rewards.weights,
                                    scale_rewards=g.scale_rewards, all_reduce=self._sum_over_ranks)
        finally:
            self.engine.sleep()

    def _sum_over_ranks(self, t: torch.Tensor) -> torch.Tensor:
        """Sum a (CPU) tensor over ranks, on this rank's device (NCCL reduces CUDA tensors only)."""
        return fdist.all_reduce_(t.to(self.device), "sum").to(t.device)

    def _microbatches(self, ep: Episodes) -> list[MicroBatch]:
        seq_lens = [len(p) + len(c) for p, c in zip(ep.prompt_ids, ep.completion_ids)]
        bins = plan_microbatches(seq_lens, self.cfg.grpo.max_tokens_per_microbatch)
        # FSDP: every rank must run the same number of forward/backward calls (collectives per block)
        bins = split_to_count(bins, seq_lens, fdist.all_reduce_int(len(bins), "max", device=self.device))
        return pack(ep.prompt_ids, ep.completion_ids, bins, device=self.device,
                    pad_token_id=self.tokenizer.pad_token_id or 0)

    @torch.no_grad()
    def logprobs(self, model: torch.nn.Module, mbs: list[MicroBatch], num_tokens: int) -> torch.Tensor:
        """Per-token log-probs [N] of the completion tokens under ``model`` (no [N, V] tensor)."""
        out = torch.zeros(num_tokens, dtype=torch.float32, device=self.device)
        temperature = self.cfg.rollout.temperature
        for mb in mbs:
            # packed_forward runs trunk -> hidden [n, H] of completion positions -> fn(hidden, lm_head.weight)
            # inside FSDP's hooks, so sharded (and tied) weights are gathered for the head too.
            lp = model.packed_forward(mb, lambda h, w: linear_logprobs(h, w, mb.targets, temperature=temperature,
                                                                       backend=self.head_backend))
            out[mb.flat_index] = lp
        return out

    def policy_update(self, ep: Episodes, metrics: StepMetrics) -> None:
        g = self.cfg.grpo
        lengths = ep.lengths  # [S]
        n_tok = int(lengths.sum())  # N on this rank
        counts = GlobalCounts(num_sequences=fdist.all_reduce_int(ep.num_sequences, "sum", device=self.device),
                              num_tokens=fdist.all_reduce_int(n_tok, "sum", device=self.device),
                              max_completion_length=self.cfg.rollout.max_completion_length)
        weights = token_weights(g.loss_type, lengths, counts).to(self.device)  # [N]
        adv = torch.repeat_interleave(ep.adv.advantages, lengths).to(self.device)  # [N]
        mbs = self._microbatches(ep)

        self.model.train()
        ref_lp = self.logprobs(self.ref_model, mbs, n_tok) if self.ref_model is not None else None
        old_lp = None
        if g.num_iterations > 1 or ep.sampler_logprobs is not None:
            old_lp = self.logprobs(self.model, mbs, n_tok)
        if ep.sampler_logprobs is not None:  # truncated importance sampling: sampler != trainer numerics
            is_w = truncated_importance_weights(old_lp, ep.sampler_logprobs.to(self.device),
                                                self.cfg.rollout.importance_sampling_cap)
            metrics.add("is/weight_mean", is_w.mean())
            weights = weights * is_w
            if g.num_iterations == 1:
                old_lp = None  # mu = 1: old = logp.detach(), exactly as without the correction

        for _ in range(g.num_iterations):
            self.optimizer.zero_grad(set_to_none=True)
            for mb in mbs:
                i = mb.flat_index

                def head_loss(hidden, weight, mb=mb, i=i):  # hidden [n, H], weight [V, H]
                    return linear_grpo_loss(
                        hidden, weight, mb.targets, adv[i], weights[i],
                        old_logprobs=None if old_lp is None else old_lp[i],
                        ref_logprobs=None if ref_lp is None else ref_lp[i],
                        epsilon_low=g.epsilon_low, epsilon_high=g.epsilon_high, delta=g.delta, beta=g.beta,
                        temperature=self.cfg.rollout.temperature, backend=self.head_backend)

                loss, stats = self.model.packed_forward(mb, head_loss)
                loss.backward()
                n = float(mb.targets.numel())
                metrics.total("loss", loss / g.num_iterations)  # each is a share of the global-batch loss
                for key in ("clip_low_frac", "clip_high_frac", "kl_mean"):
                    if key in stats:
                        metrics.add(f"policy/{key}", stats[key], n)
            max_norm = self.cfg.optim.max_grad_norm
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm if max_norm > 0 else 1e30)
            if hasattr(grad_norm, "full_tensor"):  # FSDP2: a DTensor
                grad_norm = grad_norm.full_tensor()
            metrics.set("policy/grad_norm", grad_norm)
            metrics.host("lr", self.scheduler.get_last_lr()[0])
            self.optimizer.step()
            self.scheduler.step()
        metrics.total("perf/update_tokens", torch.tensor(float(sum(mb.num_tokens for mb in mbs))))

    def sync_weights(self, metrics: StepMetrics) -> None:
        """Push new policy weights into a separate inference engine (the hf engine shares the model: no-op)."""
        if self.cfg.rollout.engine == "hf":
            return
        with Timer() as t:
            self.engine.update_weights(self._full_weights())
        metrics.host("time/sync_s", t.seconds)

    # ------------------------------------------------------------------------------------------------ loop

    def run(self) -> dict[str, float]:
        cfg = self.cfg
        if self.step >= cfg.max_steps:
            if self.is_main:
                print(f"[fastgrpo] {self.run_dir} is already at step {self.step} >= max_steps={cfg.max_steps}; "
                      "nothing to do (raise max_steps to train further)", flush=True)
            return {}
        sinks = []
        if self.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            for log in ("metrics.jsonl", "completions.jsonl"):  # a resumed run redoes the steps after its checkpoint
                drop_records_after(self.run_dir / log, self.step)
            (self.run_dir / "config.json").write_text(json.dumps(to_dict(cfg), indent=2))
            if "jsonl" in cfg.log.report_to:
                sinks.append(JsonlSink(self.run_dir / "metrics.jsonl"))
            if "wandb" in cfg.log.report_to:
                sinks.append(WandbSink(cfg.log.wandb_project, cfg.name, to_dict(cfg), self.run_dir))
        completions_sink = JsonlSink(self.run_dir / "completions.jsonl") if self.is_main else None
        bar = ProgressBar(cfg.max_steps, self.step, enabled=self.is_main and cfg.log.progress)
        record: dict[str, float] = {}
        kill_at = int(os.environ.get(_FAULT_ENV, "-1"))
        self._sigterm = False
        previous = None
        if threading.current_thread() is threading.main_thread():
            # Preemption (SIGTERM from a scheduler, or torchrun relaying one): finish the step, save, exit 0.
            previous = signal.signal(signal.SIGTERM, lambda *_: setattr(self, "_sigterm", True))
        try:
            while self.step < cfg.max_steps:
                metrics = StepMetrics()
                with Timer() as t_roll:
                    ep = self.rollout()
                if self.step + 1 == kill_at:
                    os.kill(os.getpid(), signal.SIGKILL)
                with Timer() as t_upd:
                    self.policy_update(ep, metrics)
                self.sync_weights(metrics)
                self.step += 1
                record_metrics(ep, metrics)
                metrics.total("perf/rollout_tokens", ep.lengths.sum().float())
                metrics.host("time/rollout_s", t_roll.seconds)
                metrics.host("time/update_s", t_upd.seconds)
                if self.peak_flops:  # CUDA only: model FLOPs utilisation of the policy update on this rank
                    flops = self.cfg.grpo.num_iterations * update_flops(
                        self.model, [len(p) for p in ep.prompt_ids], ep.lengths.tolist())
                    metrics.set("perf/mfu", torch.tensor(flops / max(t_upd.seconds, 1e-9) / self.peak_flops,
                                                         device=self.device))
                record = {"step": self.step, **metrics.reduce()}
                # token counts are totals over ranks; ranks run in lockstep, so rank 0's seconds are the step's
                record["perf/rollout_tokens_per_s"] = record["perf/rollout_tokens"] / max(t_roll.seconds, 1e-9)
                record["perf/update_tokens_per_s"] = (record["perf/update_tokens"] * self.cfg.grpo.num_iterations
                                                      / max(t_upd.seconds, 1e-9))
                record["perf/tokens_per_s"] = ((record["perf/rollout_tokens"] + record["perf/update_tokens"])
                                               / max(t_roll.seconds + t_upd.seconds, 1e-9))
                record["data/skipped_rows"] = float(self.data_info.get("skipped_invalid_rows", 0))
                if self._due(cfg.eval.every):
                    record.update(self.evaluate())
                for s in sinks:
                    s.write(record)
                if completions_sink is not None:
                    self._log_completions(completions_sink, ep)
                bar.update(record)
                if self._stop_requested():
                    self._save()
                    if self.is_main:
                        bar.write(f"[fastgrpo] SIGTERM: saved step {self.step} to {self.run_dir / 'checkpoints'}; "
                                  "run the same command again to resume")
                    return record
                if cfg.checkpoint.every and self.step % cfg.checkpoint.every == 0 and self.step < cfg.max_steps:
                    self._save()
            self._save()
            if cfg.checkpoint.export_hf:
                ckpt.export_hf(self.run_dir / "final", model=self.model, tokenizer=self.tokenizer)
        finally:
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
            bar.close()
            for s in sinks:
                s.close()
            if completions_sink is not None:
                completions_sink.close()
        return record

    def _stop_requested(self) -> bool:
        """Whether any rank got SIGTERM (all ranks must agree, or the others would wait in a collective)."""
        return fdist.all_reduce_int(int(self._sigterm), "max", device=self.device) > 0

    def close(self) -> None:
        """Release the rollout engine. vLLM's teardown also ends torch.distributed's group: call this last."""
        close = getattr(self.engine, "close", None)
        if close is not None:
            close()

    def _due(self, every: int) -> bool:
        if every < 0 or not self.eval_rows:
            return False
        return self.step == self.cfg.max_steps or (every > 0 and self.step % every == 0)

    def evaluate(self) -> dict[str, float]:
        e = self.cfg.eval
        # Each rank evaluates its own slice and results are averaged over ranks. Every rank takes the same number of
        # prompts: under FSDP a rank that generated fewer sequences would leave the others waiting in a collective.
        ws, n_rows = self.world_size, len(self.eval_rows)
        n = max(ws, min(e.num_prompts, n_rows) // ws * ws)
        idx = [i % n_rows for i in range(self.rank, n, ws)]
        texts, ids = self.prompts(idx, self.eval_rows)
        fn = self.reward_funcs[-1][1]  # by position: a plugin's registered name is not its spec string
        # Evaluation runs between a weight sync and the next rollout, so the engine stays awake for that rollout
        # (sleeping here would, at sleep_level 2, discard the weights just synced).
        self.engine.wake()
        res = evaluate(self.engine, [self.eval_rows[i] for i in idx], texts, ids, reward_fn=fn,
                       best_of_n=e.best_of_n, temperature=e.temperature,
                       max_tokens=self.cfg.rollout.max_completion_length, seed=self.cfg.seed + self.step)
        names = sorted(res)
        vals = fdist.all_reduce_(torch.tensor([res[k] for k in names], device=self.device), "avg")
        return {f"eval/{k}": float(v) for k, v in zip(names, vals.tolist())}

    def _log_completions(self, sink: JsonlSink, ep: Episodes) -> None:
        k = min(self.cfg.log.completions_per_step, ep.num_sequences)
        if k == 0:
            return
        stride = max(1, ep.num_sequences // k)
        for s in range(0, stride * k, stride):
            sink.write({
                "step": self.step, "prompt": ep.prompt_texts[s], "completion": ep.completion_texts[s],
                "rewards": {n: float(ep.rewards_per_func[s, j]) for j, n in enumerate(ep.reward_names)},
                "reward": float(ep.rewards[s]), "advantage": float(ep.adv.advantages[s]),
                "finish_reason": ep.finish_reasons[s],
            })
