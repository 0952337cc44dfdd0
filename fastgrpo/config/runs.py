"""Run configs: what every run has (:class:`RunConfig`), a GRPO run (:class:`TrainConfig`) and an SFT run
(:class:`SFTConfig`), and the run-level checks they share (:func:`check_run_config`)."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

from fastgrpo.config.loader import (ConfigError, check, check_finite, check_section, component_checks, fail,
                                    load_choice_tables, registry)
from fastgrpo.config.sections import (CheckpointConfig, DataConfig, EvalConfig, GRPOConfig, LogConfig, ModelConfig,
                                      OptimConfig, ParallelConfig, PPOConfig, RewardConfig, RolloutConfig)

__all__ = ["RESUMABLE_KEYS", "RunConfig", "SFTConfig", "SFTOptions", "TrainConfig", "check_run_config", "run_kind_of",
           "run_defining_changes"]

RESUMABLE_KEYS = (
    "name", "output_dir", "max_steps", "device", "malloc_mmap_threshold", "checkpoint.", "eval.", "log.",
    "parallel.fsdp", "parallel.one_gpu", "parallel.cpu_offload", "parallel.activation_checkpointing",
    "parallel.compile", "parallel.token_buckets", "parallel.cuda_graphs", "parallel.cuda_graphs_head",
    "model.attn_implementation", "optim.max_nonfinite_steps", "optim.implementation", "rewards.sandbox",
    "rewards.num_workers", "rewards.timeout_s", "rollout.env.num_workers", "rollout.env.timeout_s", "rollout.engine", "rollout.hf.",
    "rollout.async_threads", "rollout.async_timeout_s",
    "rollout.vllm.", "grpo.max_tokens_per_microbatch", "grpo.shared_prefix",
    "grpo.head_backend", "sft.max_tokens_per_microbatch", "sft.head_backend",
)
"""Config keys (dotted; one ending in '.' covers its section) that a resume may change: how long to train, where
to write, what to log and evaluate, and how a step is computed (engine, kernels, micro-batches, sharding, reward
workers) without changing what it computes. Every other key (data, model, rewards, G, loss, optimizer, seeds...)
defines the run: changing it on resume is an error unless checkpoint.allow_config_change is set. A key added to the
config later defines the run until listed here."""


def _resumable(key: str) -> bool:
    return any(key == r or (r.endswith(".") and key.startswith(r)) for r in RESUMABLE_KEYS)


def _leaves(node: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    for f in dataclasses.fields(node):
        value = getattr(node, f.name)
        if dataclasses.is_dataclass(value):
            yield from _leaves(value, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", value


def run_kind_of(saved: dict) -> str:
    """The run kind a config.json records ('grpo', 'sft'); for one written before the kind was recorded, the kind
    whose own section it has ('' if neither)."""
    if isinstance(saved.get("run_kind"), str):
        return saved["run_kind"]
    return "sft" if "sft" in saved else "grpo" if "grpo" in saved else ""


def run_defining_changes(saved: dict, cfg: Any) -> list[tuple[str, Any, Any]]:
    """``(key, saved value, value in cfg)`` for each key of the run config ``cfg`` that defines the run (is not in
    :data:`RESUMABLE_KEYS`) and differs from ``saved`` (a config.json). A key the saved config lacks (written by an
    older version) is not compared."""
    missing = object()
    changes = []
    for key, value in _leaves(cfg):
        old: Any = saved
        for part in key.split("."):
            old = old.get(part, missing) if isinstance(old, dict) else missing
        value = json.loads(json.dumps(value))  # as config.json holds it (tuples are lists)
        if old is not missing and old != value and not _resumable(key):
            changes.append((key, old, value))
    return changes


@dataclass(kw_only=True)
class RunConfig:
    """What every run (GRPO, SFT) has: its folder, length, seed and device, and the shared sections."""

    name: str = "run"
    """Run name: outputs go to <output_dir>/<name>/."""
    output_dir: str = "runs"
    """Parent folder of run folders."""
    max_steps: int = 100
    """Optimizer steps."""
    seed: int = 0
    """Global seed (model init of the tiny model, sampling, data order)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """'auto' (cuda if available), 'cpu' or 'cuda'."""
    malloc_mmap_threshold: int = 1 << 20
    """Linux/glibc: host allocations of at least this many bytes get their own mapping, returned to the system when
    freed, instead of staying resident in malloc's heaps (fastgrpo.runtime.memory; 0 leaves malloc as it is; a
    MALLOC_MMAP_THRESHOLD_ environment variable wins). At most 32 MiB."""
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    log: LogConfig = field(default_factory=LogConfig)

    KEY_ALIASES: ClassVar[dict[str, str]] = {
        "learning_rate": "lr", "lr_scheduler_type": "schedule", "r": "rank", "lora_r": "rank", "lora_rank": "rank",
        "lora_alpha": "alpha", "lora_dropout": "dropout", "model_name_or_path": "name_or_path",
        "gradient_checkpointing": "activation_checkpointing", "reward_funcs": "funcs", "reward_weights": "weights",
        "async": "asynchronous",
    }
    """Other trainers' names (TRL, peft) -> the last part of ours: an unknown key that ends with one is pointed
    to the key that ends with the other (a hint only; the config itself accepts one spelling)."""

    run_kind: ClassVar[str] = ""
    """What trains: 'grpo' (fastgrpo.train) or 'sft' (fastgrpo.sft). Recorded in the run's config.json: a run folder
    holds one kind of run, so one never resumes the other's checkpoint."""

    @property
    def run_dir(self) -> Path:
        return Path(self.output_dir).expanduser() / self.name


@dataclass(kw_only=True)
class TrainConfig(RunConfig):
    """A GRPO run: the shared sections plus rewards, rollout and the GRPO objective."""

    run_kind: ClassVar[str] = "grpo"

    rewards: RewardConfig = field(default_factory=RewardConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    algorithm: str = field(default="grpo", metadata=registry("fastgrpo.algorithms.registry:ALGORITHMS"))
    """'grpo' (group-relative advantages) or 'ppo' (a learned critic, GAE token advantages: the ppo section; the
    clipped objective, batch shape and kernels stay grpo's); a name of fastgrpo.algorithms.registry.ALGORITHMS."""
    ppo: PPOConfig = field(default_factory=PPOConfig)
    """PPO's critic, GAE and epochs (algorithm: ppo)."""

    def validate(self) -> "TrainConfig":
        check_run_config(self, head_backend_field="grpo.head_backend",
                         sequence_level=self.grpo.importance_sampling_level == "sequence")
        check(not self.checkpoint.export_merged or self.model.lora.enabled, "checkpoint.export_merged",
              "merges LoRA adapters: set model.lora.rank > 0 (a full fine-tune's export_hf folder is already merged)")
        # what the chosen engine and algorithm serve: their own checks (fastgrpo.rollout.vllm,
        # fastgrpo.algorithms.registry), registered with section_check
        component_checks(self, "")
        return self


def check_run_config(cfg: Any, *, head_backend_field: str, sequence_level: bool = False) -> Any:
    """Validate a run config (TrainConfig, SFTConfig): its own fields, then every section's choices and checks,
    then that the kernel path ``head_backend_field`` runs on the run's device (and serves a sequence-level ratio
    when ``sequence_level``). Returns ``cfg``."""
    import torch  # deferred: the config modules load without torch for --help-config

    check_finite(cfg, "")
    cfg.output_dir = os.path.expanduser(cfg.output_dir)  # '~/runs' is the home folder's, as in a shell
    # The run folder is output_dir/name and nothing else: a name with a separator or '..' would write (and
    # delete old checkpoints) outside output_dir.
    check(bool(cfg.name) and cfg.name not in (".", "..") and not any(c in cfg.name for c in "/\\\0"),
          "name", f"must be a plain folder name (no '/', '\\', '..'), got {cfg.name!r}")
    check(cfg.max_steps >= 1, "max_steps", "must be >= 1")
    check(0 <= cfg.malloc_mmap_threshold <= 32 << 20, "malloc_mmap_threshold",
          f"must be in [0, {32 << 20}] bytes (glibc's limit), got {cfg.malloc_mmap_threshold}")
    if cfg.device == "cuda":
        check(torch.cuda.is_available(), "device",
              "is 'cuda' but no CUDA device is available (torch.cuda.is_available() is False); use auto or cpu")
    load_choice_tables(type(cfg))  # the components its choices name register their checks when imported
    check_section(cfg, "")
    from fastgrpo.kernels import check_backend, resolve_backend  # here: kernels import torch (and triton)

    section, _, name = head_backend_field.partition(".")
    backend = getattr(getattr(cfg, section), name)
    try:  # the kernels own the rule of what each backend serves
        check_backend(backend, sequence_level=sequence_level)
    except ValueError as e:
        fail(head_backend_field, str(e))
    device = cfg.device if cfg.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    try:  # Triton paths need CUDA or the interpreter
        resolve_backend(backend, device, needs_grad=True)
    except ValueError as e:
        fail(head_backend_field, f"{e}; use auto or torch on CPU")
    return cfg


@dataclass(kw_only=True)
class SFTOptions:
    batch_size: int = 32
    """Sequences per optimizer step on each rank."""
    normalization: str = field(default="token", metadata=registry("fastgrpo.algorithms.losses:SFT_NORMALIZATIONS"))
    """Loss average over the global batch: 'token' (every completion token weighs the same) or 'sequence' (the
    token mean of each sequence, then the mean over sequences)."""
    max_tokens_per_microbatch: int = 1024
    """Token budget of one packed micro-batch (prompt + completion tokens); gradients accumulate across them."""
    trace: str = field(default="steps", metadata=registry("fastgrpo.data.sft:TRACES"))
    """data.source=countdown: how a solver's solution is written ('answer': equation only; 'steps': the
    intermediate results, then the equation)."""
    solution: str = field(default="first", metadata=registry("fastgrpo.data.sft:SOLUTIONS"))
    """data.source=countdown: which solution a trace shows: 'first' (the solver's first) or 'random' (one drawn from
    all of the problem's solutions)."""
    near_miss: float = 0.0
    """data.source=countdown: share of training traces that show an honest attempt missing the target by as little
    as any, instead of a solution (held-out traces are solutions)."""
    head_backend: str = field(default="auto", metadata=registry("fastgrpo.kernels:BACKENDS"))
    """lm_head + loss kernel path, as grpo.head_backend."""
    eval_reward: str | None = field(default=None, metadata=registry("fastgrpo.rewards:REWARDS", also=(None,)))
    """A reward (fastgrpo.rewards.REWARDS name, e.g. 'countdown') that scores greedy completions of held-out
    prompts at each evaluation, besides their loss; None = loss only."""

    def validate(self, p: str) -> None:
        check(self.batch_size >= 1, f"{p}.batch_size", "must be >= 1")
        check(self.max_tokens_per_microbatch >= 1, f"{p}.max_tokens_per_microbatch", "must be >= 1")
        check(0.0 <= self.near_miss <= 1.0, f"{p}.near_miss", f"must be in [0, 1], got {self.near_miss}")
        check(self.head_backend != "cublas", f"{p}.head_backend",
              "cublas forms the GRPO loss's gradient in forward and has no backward for SFT's log-probs; "
              "use auto, triton or torch")


@dataclass(kw_only=True)
class SFTConfig(RunConfig):
    """An SFT run: the shared run sections plus the SFT options."""

    run_kind: ClassVar[str] = "sft"

    name: str = "sft"
    """Run name: outputs go to <output_dir>/<name>/."""
    max_steps: int = 200
    """Optimizer steps."""
    sft: SFTOptions = field(default_factory=SFTOptions)

    def validate(self) -> "SFTConfig":
        return check_run_config(self, head_backend_field="sft.head_backend")
