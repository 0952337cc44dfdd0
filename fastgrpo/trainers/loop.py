"""What the training loops share (GRPO's :class:`~fastgrpo.trainers.grpo.Trainer`, SFT's
:class:`~fastgrpo.sft.SFTTrainer`): the policy model and its optimizer, resume and atomic checkpoints, and the step
loop with its logs, evaluations, preemption handling and Hugging Face export.

A subclass's ``__init__`` (decorated with :func:`closes_on_error`) calls :meth:`TrainingLoop._init_run`, builds
its data (``self.sampler``, a PromptSampler) and tokenizer, calls :meth:`TrainingLoop._init_model`, and implements
``train_step() -> (record, extra)``, ``evaluate() -> dict``, ``check_context(limit)`` (every sequence fits the
model's positions) and optionally ``log_rows(extra) -> list[dict]`` (rows for completions.jsonl).

The run config (TrainConfig, SFTConfig) has ``name``, ``max_steps``, ``seed``, ``device`` and the sections
``model``, ``optim``, ``parallel``, ``checkpoint``, ``eval`` and ``log``.
"""

from __future__ import annotations

import functools
import os
import signal
import threading
from typing import Any, Callable

import torch

from fastgrpo.distributed import checkpoint as ckpt
from fastgrpo.distributed import groups as fdist
from fastgrpo.trainers import preflight
from fastgrpo.config import to_dict
from fastgrpo.runtime.errors import Preempted
from fastgrpo.runtime.run_log import RunLog
from fastgrpo.runtime.sinks import drop_records_after
from fastgrpo.models.lora import apply_lora, check_peft_available
from fastgrpo.runtime.memory import set_malloc_mmap_threshold
from fastgrpo.models.loading import check_plain_head, load_model, resolve_model_path
from fastgrpo.update.bundle import build_trained
from fastgrpo.update.optim import build_scheduler  # noqa: F401 (public here too)
from fastgrpo.distributed.parallelize import autocast_dtype, uses_fsdp

# Test hook: SIGKILL this process in the middle of the given step (GRPO: after its rollout, before its update; SFT:
# before its update), so the kill-and-resume tests are deterministic.
FAULT_ENV = "FASTGRPO_FAULT_KILL_AT_STEP"


HYPERPARAMETERS = ("initial_lr", "weight_decay", "betas", "eps")
"""An optimizer param group's settings that come from the config (the learning rate follows from ``initial_lr``
and the schedule). Restoring an optimizer's state restores them too, from the checkpoint."""


def configured_hyperparameters(optimizer: torch.optim.Optimizer, scheduler: Any) -> tuple[list[dict], list[float]]:
    """The settings a freshly built optimizer and scheduler have from the config: per param group, and the
    scheduler's base learning rates."""
    groups = [{k: g[k] for k in HYPERPARAMETERS if k in g} for g in optimizer.param_groups]
    return groups, list(scheduler.base_lrs)


def apply_hyperparameters(optimizer: torch.optim.Optimizer, scheduler: Any,
                          values: tuple[list[dict], list[float]]) -> None:
    """After a resume with ``checkpoint.allow_config_change``: put the config's settings (``values``, from
    :func:`configured_hyperparameters` before the restore) back over the checkpoint's, and set each group's
    learning rate as the schedule gives it at the restored step, so the run trains with what config.json says."""
    groups, base_lrs = values
    for group, fresh in zip(optimizer.param_groups, groups):
        group.update(fresh)
    scheduler.base_lrs = list(base_lrs)
    for group, base, factor in zip(optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
        group["lr"] = base * factor(scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]


def closes_on_error(init: Callable) -> Callable:
    """For a subclass's ``__init__``: if it fails, ``close()`` what it had started (the run folder's lock, reward
    workers) before the error goes on, as the caller has no object to close."""

    @functools.wraps(init)
    def wrapper(self: "TrainingLoop", *args: Any, **kwargs: Any) -> None:
        try:
            init(self, *args, **kwargs)
        except BaseException:
            self.close()
            raise

    return wrapper


class TrainingLoop:
    """Set-up, checkpoints and the step loop of a run; see the module docstring for what a subclass provides."""

    progress_name = "train"
    """The progress bar's label."""

    def _init_run(self, cfg: Any) -> None:
        self.cfg = cfg
        self.device = fdist.init_distributed(cfg.device).device  # idempotent; the entry points initialise it first
        self.rank, self.world_size = fdist.get_rank(), fdist.get_world_size()
        self.run_dir = cfg.run_dir
        self.is_main = self.rank == 0
        torch.manual_seed(cfg.seed)
        set_malloc_mmap_threshold(cfg.malloc_mmap_threshold)  # before the model and its gradients are allocated
        # Cheap checks first: the launch and the run folder fail before any data or model loads.
        preflight.check_launch(cfg, self.world_size, self.device)
        preflight.check_run_dir(cfg)
        preflight.check_run_folder_kind(cfg)  # an SFT run's folder is no GRPO run's, and the reverse
        preflight.check_inputs(cfg)
        self._lock_run_dir()
        self._config_changes = preflight.config_changes(cfg)

    def _lock_run_dir(self) -> None:
        """Rank 0 locks the run folder (:class:`fastgrpo.trainers.preflight.RunLock`); every rank fails if it cannot."""
        self._lock, error = None, ""
        if self.is_main:
            try:
                self._lock = preflight.RunLock(self.run_dir)
            except ValueError as e:
                error = str(e)
        if fdist.all_reduce_int(int(bool(error)), "max", device=self.device):
            raise ValueError(error or preflight.lock_holder_message(self.run_dir))

    def _release_run_dir(self) -> None:
        lock = getattr(self, "_lock", None)
        if lock is not None:
            lock.release()

    def close(self) -> None:
        """Release the run folder (subclasses also stop their workers)."""
        self._release_run_dir()

    def check_context(self, limit: int) -> None:
        """ValueError naming the first row whose sequence does not fit the model's ``limit`` positions."""
        raise NotImplementedError

    def master_dtype(self) -> torch.dtype | None:
        """The dtype the trained models load in: None (model.dtype's) or float32 masters."""
        cfg = self.cfg
        # On CUDA, 'auto' loads float32 master weights, and FSDP2 (several ranks) or autocast (one plain GPU)
        # computes in parallel.param_dtype: AdamW updates of lr ~ 1e-6 vanish in bfloat16 weights (8 bits of
        # mantissa). A LoRA base is frozen: it needs no masters and loads in bfloat16 on one plain GPU.
        if cfg.model.dtype == "auto" and self.device.type == "cuda":
            if uses_fsdp(cfg.parallel, self.device, self.world_size):
                return torch.float32
            if not cfg.model.lora.enabled and autocast_dtype(cfg.parallel, self.device, self.world_size):
                return torch.float32
        return None

    def _init_model(self, total_updates: int) -> None:
        """The policy (loaded, parallelized), AdamW, the LR schedule over ``total_updates``; then resume."""
        cfg = self.cfg
        master_dtype = self.master_dtype()
        if cfg.model.lora.enabled:
            check_peft_available()  # before the model loads
        # Sequences longer than the model's positions train on untrained embeddings (transformers only warns), or
        # fail minutes in: checked before the model loads when its config.json is local, else right after.
        model_path = resolve_model_path(cfg.model, seed=cfg.seed)
        preflight.check_model_files(model_path)
        limit = preflight.context_length(model_path)
        if limit:
            self.check_context(limit)
        model = load_model(cfg.model, device=self.device, dtype=master_dtype, seed=cfg.seed)
        if limit is None and getattr(model.config.get_text_config(), "max_position_embeddings", None):
            self.check_context(model.config.get_text_config().max_position_embeddings)
        check_plain_head(model)  # logits must be hidden @ lm_head.weight.T, checked before any step
        if cfg.model.lora.enabled:  # adapters on the frozen base; only they train and reach the optimizer
            model = apply_lora(model, cfg.model.lora)
        # parallelized, with AdamW, the LR schedule over total_updates and the non-finite guard (the optimizer steps
        # on finite gradients only): the same bundle as any other trained model (PPO's critic)
        policy = build_trained(model, parallel=cfg.parallel, optim=cfg.optim, device=self.device,
                               world_size=self.world_size, total_steps=total_updates)
        self.runner = policy.runner  # what runs the policy's packed passes; self.model is its plain module
        self.model, self.optimizer, self.scheduler, self.guard = (policy.model, policy.optimizer, policy.scheduler,
                                                                  policy.guard)
        self.total_updates = total_updates
        self.step = 0
        self._resume()

    # ------------------------------------------------------------------------------------------------ checkpoints

    def _resume(self) -> None:
        path = ckpt.resolve_resume(self.cfg.checkpoint.resume, self.run_dir / "checkpoints")
        if path is None:
            return
        pairs = [(self.optimizer, self.scheduler), *((o, s) for _, o, s in self.checkpoint_extras().values())]
        configured = [configured_hyperparameters(o, s) for o, s in pairs]
        state = ckpt.load_checkpoint(path, model=self.model, optimizer=self.optimizer,
                                     extras=self.checkpoint_extras())
        self.scheduler.load_state_dict(state["scheduler"])
        if self._config_changes:  # checkpoint.allow_config_change: the new optim values, not the saved ones
            for (o, s), values in zip(pairs, configured):
                apply_hyperparameters(o, s, values)
        sampler_state = dict(state["sampler"])
        if sampler_state["world_size"] != self.world_size:
            # Resharded resume: keep the epoch and the share of it already consumed (prompts seen globally), so
            # the data position is kept up to the rounding of one step.
            seen = sampler_state["offset"] * sampler_state["world_size"]
            sampler_state.update(world_size=self.world_size, rank=self.rank,
                                 offset=min(seen // self.world_size, self.sampler.per_rank))
        self.sampler.load_state_dict(sampler_state)
        self.step = int(state["step"])
        self.load_extra_state(state)
        if self.is_main:
            print(f"[fastgrpo] resumed from {path} at step {self.step}", flush=True)

    def _save(self, *, after_failure: bool = False) -> None:
        """A checkpoint of this step (``after_failure``: a resumable error stopped the run; work in flight that
        did not come back is saved as lost)."""
        state = {"step": self.step, "scheduler": self.scheduler.state_dict(), "sampler": self.sampler.state_dict(),
                 **self.extra_state(after_failure=after_failure)}
        ckpt.save_checkpoint(self.run_dir / "checkpoints", self.step, model=self.model, optimizer=self.optimizer,
                             trainer_state=state, keep_last=self.cfg.checkpoint.keep_last,
                             extras=self.checkpoint_extras())

    def extra_state(self, *, after_failure: bool) -> dict[str, Any]:
        """More of the trainer's state for the checkpoint (GRPO with rollout.asynchronous: the batches in flight)."""
        return {}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        """On resume, before the step loop: what :meth:`extra_state` saved (absent keys: an older checkpoint)."""

    resumable_errors: tuple[type[BaseException], ...] = ()
    """Errors of a step that stop the run with a checkpoint of the last finished step, resumable by the same
    command (GRPO with rollout.asynchronous: the generation worker died or hung)."""

    def checkpoint_extras(self) -> dict[str, ckpt.Extra]:
        """Models checkpointed and resumed beside the policy, name -> (model, optimizer, scheduler): PPO's critic.
        They must exist before :meth:`_init_model` resumes."""
        return {}

    def _fault_point(self) -> None:
        """The kill-and-resume tests' hook: SIGKILL in the middle of step ``$FASTGRPO_FAULT_KILL_AT_STEP``."""
        if self.step + 1 == int(os.environ.get(FAULT_ENV, "-1")):
            os.kill(os.getpid(), signal.SIGKILL)

    # ------------------------------------------------------------------------------------------------ loop

    def train_step(self) -> tuple[dict[str, float], Any]:
        raise NotImplementedError

    def evaluate(self) -> dict[str, float]:
        raise NotImplementedError

    def log_rows(self, extra: Any) -> list[dict]:
        """Rows for completions.jsonl from what ``train_step`` returned besides its record (rank 0 only)."""
        return []

    def run(self) -> dict[str, float]:
        """Steps up to ``max_steps`` (from a resumed step), then a final checkpoint and export; the last record.
        SIGTERM saves a checkpoint and raises :class:`~fastgrpo.runtime.errors.Preempted` (a run that stopped early is not
        a finished one). ``train_step`` returns a record of None when SIGTERM cut the step short (it was dropped,
        and the data position is back where it was before it). The run folder is unlocked when it returns."""
        try:
            return self._run()
        finally:
            self._release_run_dir()

    def _run(self) -> dict[str, float]:
        cfg = self.cfg
        if self.step >= cfg.max_steps:
            if cfg.checkpoint.export_hf and not (self.run_dir / "final").is_dir():
                # killed after its last checkpoint, before (or while) writing the export: write it now
                if self.is_main:
                    print(f"[fastgrpo] {self.run_dir} is at step {self.step} but has no final/ export: writing it",
                          flush=True)
                ckpt.export_hf(self.run_dir / "final", model=self.model, tokenizer=self.tokenizer)
            elif self.is_main:
                print(f"[fastgrpo] {self.run_dir} is already at step {self.step} >= max_steps={cfg.max_steps}; "
                      "nothing to do (raise max_steps to train further)", flush=True)
            return {}
        if self.is_main and cfg.checkpoint.resume == "never" and cfg.checkpoint.overwrite and \
                preflight.holds_run(self.run_dir):
            preflight.clear_run(self.run_dir)
        eval_at_start = self.step == 0 and cfg.eval.at_start and cfg.eval.every >= 0 and self.has_eval_data()
        if eval_at_start and self.is_main:  # a fresh start: a step-0 record of an earlier attempt goes
            drop_records_after(self.run_dir / "metrics.jsonl", -1)
        if self.is_main and self._config_changes:  # checkpoint.allow_config_change: the old config is kept
            preflight.keep_config(self.run_dir, self.step)
        log = RunLog(self.run_dir, report_to=cfg.log.report_to, name=cfg.name, project=cfg.log.wandb_project,
                     config={"run_kind": type(cfg).run_kind, **to_dict(cfg)}, step=self.step,
                     max_steps=cfg.max_steps, enabled=self.is_main,
                     progress=cfg.log.progress, desc=self.progress_name)
        record: dict[str, float] = {}
        self._sigterm = False
        previous = None
        if threading.current_thread() is threading.main_thread():
            # Preemption (SIGTERM from a scheduler, or torchrun relaying one): finish the step, save, stop.
            previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        try:
            if eval_at_start:
                log.write({"step": 0, **self.evaluate()}, [], advance=False)
            while self.step < cfg.max_steps:
                try:
                    step_record, extra = self.train_step()
                except self.resumable_errors as e:
                    self._save(after_failure=True)
                    raise type(e)(f"{e}; saved step {self.step} to {self.run_dir / 'checkpoints'}: run the same "
                                  "command again to resume") from e
                if step_record is None:  # SIGTERM cut the step short on some rank: it was dropped
                    self._save()
                    raise Preempted(f"SIGTERM during step {self.step + 1}: dropped that step and saved step "
                                    f"{self.step} to {self.run_dir / 'checkpoints'}; run the same command again to "
                                    "resume")
                record = step_record
                stop = self._stop_requested()
                if not stop and self._due(cfg.eval.every):  # preempted: save first
                    record.update(self.evaluate())
                log.write(record, self.log_rows(extra) if self.is_main else [])
                if stop:
                    self._save()
                    raise Preempted(f"SIGTERM after step {self.step}: saved it to {self.run_dir / 'checkpoints'}; "
                                    "run the same command again to resume")
                if cfg.checkpoint.every and self.step % cfg.checkpoint.every == 0 and self.step < cfg.max_steps:
                    self._save()
            self._save()
            if cfg.checkpoint.export_hf:
                ckpt.export_hf(self.run_dir / "final", model=self.model, tokenizer=self.tokenizer)
            if cfg.checkpoint.export_merged:
                ckpt.export_merged(self.run_dir / "final_merged", model=self.model, tokenizer=self.tokenizer)
        finally:
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
            log.close()
        return record

    def _on_sigterm(self, *_) -> None:
        """Preemption: stop after this step (subclasses also abandon work in flight)."""
        self._sigterm = True

    def _stop_requested(self) -> bool:
        """Whether any rank got SIGTERM (all ranks must agree, or the others would wait in a collective)."""
        return fdist.all_reduce_int(int(self._sigterm), "max", device=self.device) > 0

    def _due(self, every: int) -> bool:
        if every < 0 or not self.has_eval_data():
            return False
        return self.step == self.cfg.max_steps or (every > 0 and self.step % every == 0)

    def has_eval_data(self) -> bool:
        return True
