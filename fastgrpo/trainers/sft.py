"""Supervised fine-tuning on prompt/completion pairs, on the GRPO trainer's machinery (entry point:
``python -m fastgrpo.sft``, see :mod:`fastgrpo.sft`).

What it shares with GRPO: the config system (YAML + dotted overrides, closest-key errors), packed micro-batches
with no padding and the one optimizer update (:func:`fastgrpo.update.step.optimizer_update`), the lm_head through
``fastgrpo.kernels`` (the token loss is ``-linear_logprobs``: no ``[tokens x vocab]`` tensor), FSDP2, atomic
checkpoints with ``resume: auto``, metrics.jsonl and the progress bar (:class:`fastgrpo.trainers.loop.TrainingLoop`), and
a Hugging Face export in ``<run>/final`` that ``fastgrpo.train`` starts from (``model.name_or_path=<run>/final``).

The loss is on completion tokens only: ``sum_t w_t * -log p(y_t)``, with per-token weights ``w`` fixed once per
step over the global batch by ``sft.normalization`` (registry ``SFT_NORMALIZATIONS``), exactly as GRPO's loss
types are, so the gradient does not depend on the micro-batch budget or the number of ranks.

Legend: S sequences on this rank, N completion tokens on this rank (flat layout), n of one micro-batch, H hidden
size, V vocabulary size.
"""

from __future__ import annotations

from typing import Any

import torch

from fastgrpo.config import SFTConfig, SFTOptions  # noqa: F401  (SFTOptions: re-exported, the SFT API)
from fastgrpo.distributed import groups as fdist
from fastgrpo.trainers import preflight
from fastgrpo.data.sampler import PromptSampler
from fastgrpo.data.sft import build_sft_datasets
from fastgrpo.trainers.evaluate import evaluate
from fastgrpo.kernels import resolve_backend
from fastgrpo.trainers.loop import TrainingLoop, closes_on_error
from fastgrpo.runtime.metrics import StepMetrics, Timer
from fastgrpo.models.loading import load_tokenizer
from fastgrpo.rewards import REWARDS
from fastgrpo.rollout.hf import HFEngine
from fastgrpo.algorithms.sft import sft_update, sft_weights
from fastgrpo.update.step import packed_logprobs, plan_packed
from fastgrpo.trainers.warm import build_warm  # noqa: F401  (importing it registers the warm models, e.g. tiny:countdown)

__all__ = ["SFTConfig", "SFTOptions", "SFTTrainer"]


# ---------------------------------------------------------------------------------------------------------------


def check_nonempty(split: str, ids: list[tuple[list[int], list[int]]], source: str) -> None:
    """ValueError naming the first pair of ``split`` whose prompt or completion has no token: the first completion
    token is predicted from the prompt's last one, and a completion of none has nothing to learn."""
    for i, (prompt, completion) in enumerate(ids):
        for part, tokens in (("prompt", prompt), ("completion", completion)):
            if not tokens:
                raise ValueError(f"data.source {source!r}: {split} row {i} has an empty {part} (0 tokens once "
                                 f"rendered); every pair needs at least one {part} token: fix or drop that row")


class SFTTrainer(TrainingLoop):
    """Composes the components from an SFTConfig and runs the loop (:class:`fastgrpo.trainers.loop.TrainingLoop`)."""

    progress_name = "sft"

    @closes_on_error
    def __init__(self, cfg: SFTConfig) -> None:
        self._init_run(cfg)
        self.tokenizer = load_tokenizer(cfg.model, seed=cfg.seed)
        # Cheap checks first: bad rows fail before the model loads.
        with preflight.nested_data(cfg.data.source):
            train, held_out, self.data_info = build_sft_datasets(
                cfg.data, trace=cfg.sft.trace, tokenizer=self.tokenizer, near_miss=cfg.sft.near_miss,
                solution=cfg.sft.solution)
        self.train_ids = [self._encode(p) for p in train]  # [(prompt ids, completion ids)]
        self.eval_pairs = held_out[:cfg.eval.num_prompts]
        check_nonempty("training", self.train_ids, cfg.data.source)
        check_nonempty("held-out", [self._encode(p) for p in self.eval_pairs], cfg.data.source)
        self.sampler = PromptSampler(len(self.train_ids), seed=cfg.data.seed, rank=self.rank,
                                     world_size=self.world_size)
        if self.is_main:
            preflight.warn_batch_above_data("sft.batch_size", cfg.sft.batch_size, self.world_size,
                                            len(self.train_ids))
        self._init_model(total_updates=cfg.max_steps)
        self.reward_fn = None
        if cfg.sft.eval_reward is not None:
            self.reward_fn = REWARDS[cfg.sft.eval_reward]

    def _encode(self, pair: dict[str, Any]) -> tuple[list[int], list[int]]:
        # Prompt and completion are tokenized apart, as the rollout sees them (prompt ids, then sampled ids).
        # verbose=False: check_context reports a pair too long for the model (transformers would only warn).
        enc = lambda text: self.tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]  # noqa: E731
        return enc(pair["prompt"]), enc(pair["completion"])

    def check_context(self, limit: int) -> None:
        """Every pair (prompt and completion) of both splits fits the model's ``limit`` positions."""
        for split, ids in (("training", self.train_ids), ("held-out", [self._encode(p) for p in self.eval_pairs])):
            for i, (prompt, completion) in enumerate(ids):
                if len(prompt) + len(completion) > limit:
                    preflight.check_fits(split, i, self.tokenizer.decode(prompt[:50]), len(prompt), len(completion),
                                         "completion tokens", limit)

    def train_step(self) -> tuple[dict[str, float], None]:
        """One optimizer update on ``sft.batch_size`` pairs per rank (:func:`fastgrpo.algorithms.sft.sft_update`)."""
        metrics = StepMetrics()
        batch = [self.train_ids[i] for i in self.sampler.next_batch(self.cfg.sft.batch_size)]
        self._fault_point()
        s = self.cfg.sft
        with Timer() as t:
            sft_update(self.runner, [p for p, _ in batch], [c for _, c in batch], normalization=s.normalization,
                       max_tokens_per_microbatch=s.max_tokens_per_microbatch, head_backend=s.head_backend,
                       optimizer=self.optimizer, scheduler=self.scheduler, max_grad_norm=self.cfg.optim.max_grad_norm,
                       metrics=metrics, device=self.device, pad_token_id=self.tokenizer.pad_token_id or 0,
                       guard=self.guard)
        self.step += 1
        record = {"step": self.step, **metrics.reduce()}
        record["time/update_s"] = t.seconds
        record["perf/tokens_per_s"] = record["perf/update_tokens"] / max(t.seconds, 1e-9)
        return record, None

    def has_eval_data(self) -> bool:
        return bool(self.eval_pairs)

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Held-out loss per completion token (``eval/nll``); with ``sft.eval_reward``, also greedy accuracy and
        best-of-n of the model's own completions (``eval/greedy_acc``, ...), as the GRPO trainer reports them.
        Each rank takes its slice of the held-out pairs; the results are averaged over ranks."""
        # Every rank takes the same number of pairs: under FSDP a rank with fewer would leave the others waiting.
        n = max(1, len(self.eval_pairs) // self.world_size)
        pairs = [self.eval_pairs[(self.rank + k * self.world_size) % len(self.eval_pairs)] for k in range(n)]
        ids = [self._encode(p) for p in pairs]
        weights = sft_weights([c for _, c in ids], "token", device=self.device)  # sum(w * nll): a per-token mean
        mbs = plan_packed([p for p, _ in ids], [c for _, c in ids], self.cfg.sft.max_tokens_per_microbatch,
                          device=self.device, pad_token_id=self.tokenizer.pad_token_id or 0)
        self.model.eval()
        lp = packed_logprobs(self.runner, mbs, int(weights.numel()), temperature=1.0,
                             backend=resolve_backend(self.cfg.sft.head_backend, self.device, needs_grad=False))
        out = {"nll": float(-(lp * weights).sum()) * self.world_size}  # the "avg" reduction below divides again
        if self.reward_fn is not None:
            engine = HFEngine(self.model, self.tokenizer, autocast_dtype=self.runner.autocast_dtype)
            e = self.cfg.eval
            max_tokens = max(len(c) for _, c in ids) + 16
            if engine.max_positions:  # the pairs fit (check_context); the 16 tokens of slack must too
                max_tokens = min(max_tokens, engine.max_positions - max(len(p) for p, _ in ids))
            out |= evaluate(engine, pairs, [p["prompt"] for p in pairs], [p for p, _ in ids],
                            reward_fn=self.reward_fn, best_of_n=e.best_of_n, temperature=e.temperature,
                            max_tokens=max_tokens, seed=self.cfg.seed + self.step)
        names = sorted(out)
        vals = fdist.all_reduce_(torch.tensor([out[k] for k in names], device=self.device), "avg")
        return {f"eval/{k}": float(v) for k, v in zip(names, vals.tolist())}
