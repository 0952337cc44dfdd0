"""Configuration: one keyword-only dataclass per component, composed into :class:`TrainConfig`.

A run is described by a YAML file plus dotted ``key=value`` overrides on the command line::

    python -m fastgrpo.train --config configs/tiny.yaml optim.lr=1e-4 grpo.loss_type=dr_grpo

Every field has a one-line docstring (the string literal under it), which ``--help-config`` prints.
Bad values raise ``ConfigError`` (a ``ValueError``) naming the field, before any model loads; an unknown
key names the closest valid one.

Choice fields have one source each. A closed set is typed ``Literal[...]``. An open set (loss types, rewards,
rollout engines, attention backends, kernel backends, metric sinks) is the registry of the component that
implements it, named in the field's metadata (:func:`registry`): validation, the closest-name hint and
``--help-config`` read that registry, so a name registered by ``register_loss_type`` (etc.) is accepted with no
edit here. The registry's module is imported only when a config is validated or described, so this module
imports no component (components import their config sections).
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import math
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml


class ConfigError(ValueError):
    """A configuration value or key is invalid; the message names the field."""


def _fail(path: str, msg: str) -> None:
    raise ConfigError(f"{path}: {msg}")


def _check(cond: bool, path: str, msg: str) -> None:
    if not cond:
        _fail(path, msg)


def registry(source: str, *, also: tuple[str, ...] = (), plugins: bool = False) -> dict[str, Any]:
    """Field metadata: the field's choices are the keys of the registry ``source`` ('module:NAME'), plus ``also``
    (e.g. 'auto'). ``plugins``: entries that contain ':' are 'path/to/file.py:name' specs, checked when loaded."""
    return {"registry": source, "also": also, "plugins": plugins}


def choices(cls: type, name: str) -> list | None:
    """The accepted values of field ``name`` of config class ``cls`` (list fields: of each entry), or None."""
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    if "registry" in f.metadata:
        module, _, attr = f.metadata["registry"].partition(":")
        return [*f.metadata["also"], *getattr(importlib.import_module(module), attr)]
    tp = _field_types(cls)[name]
    if typing.get_origin(tp) is list:
        tp = typing.get_args(tp)[0]
    return list(typing.get_args(tp)) if typing.get_origin(tp) is Literal else None


def _check_choice_fields(section: Any, prefix: str) -> None:
    """Every Literal or registry field of ``section`` holds one of its choices."""
    for f in dataclasses.fields(section):
        names = choices(type(section), f.name)
        if names is None:
            continue
        value = getattr(section, f.name)
        for v in value if isinstance(value, list) else [value]:
            if f.metadata.get("plugins") and ":" in v:
                continue
            hint = _closest(v, names) if isinstance(v, str) else ""
            _check(v in names, f"{prefix}{f.name}", f"unknown {v!r}; choices: {', '.join(map(str, names))}{hint}")


SEEDS_SYSTEM_PROMPT = (
    "You are a helpful assistant. You first think about the reasoning process in your mind and then "
    "provide the user with the answer."
)


_HEAD_NAMES = frozenset({"lm_head", "embed_tokens", "embed_out", "wte"})  # the head and the embeddings it may tie to


@dataclass(kw_only=True)
class LoraConfig:
    """Low-rank adapters through peft (``pip install fastgrpo[lora]``); rank 0 trains every weight."""

    rank: int = 0
    """Adapter rank r; 0 = off (full fine-tuning)."""
    alpha: float | None = None
    """Scale numerator: adapters are scaled by alpha / rank; None = 2 * rank."""
    dropout: float = 0.0
    """Dropout on the adapters' input during training, in [0, 1)."""
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    """Module names (or name suffixes) that get adapters, or ['all-linear'] (every linear layer but lm_head)."""
    modules_to_save: list[str] = field(default_factory=list)
    """Modules trained in full beside the adapters (peft's modules_to_save, matched as name suffixes), e.g. ['norm']:
    every RMSNorm; not the embeddings or lm_head."""

    def validate(self, p: str) -> None:
        _check(self.rank >= 0, f"{p}.rank", "must be >= 0 (0 = off)")
        _check(self.alpha is None or self.alpha > 0, f"{p}.alpha", "must be > 0 or null")
        _check(0 <= self.dropout < 1, f"{p}.dropout", "must be in [0, 1)")
        _check(bool(self.target_modules) and all(self.target_modules), f"{p}.target_modules",
               "must name at least one module (or be ['all-linear'])")
        _check(all(self.modules_to_save), f"{p}.modules_to_save", "names must be non-empty")
        _check(not self.modules_to_save or self.enabled, f"{p}.modules_to_save", "needs model.lora.rank > 0")
        _check(not any(m.split(".")[-1] in _HEAD_NAMES for m in self.modules_to_save), f"{p}.modules_to_save",
               f"cannot hold {sorted(_HEAD_NAMES)}: the fused head kernels read lm_head.weight, which would bypass "
               "a trained copy")

    @property
    def enabled(self) -> bool:
        return self.rank > 0


@dataclass(kw_only=True)
class ModelConfig:
    name_or_path: str = "tiny"
    """'tiny' (the embedded model, built locally), a local folder, or a Hugging Face hub id (needs network)."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Weights: 'auto' (CUDA: float32 masters, bfloat16 compute via FSDP2; CPU: float32), 'float32' or 'bfloat16'."""
    attn_implementation: str = field(default="auto",
                                     metadata=registry("fastgrpo.model:ATTN_BACKENDS", also=("auto",)))
    """'auto' picks flash_attention_2 > flex_attention (CUDA), else sdpa_varlen (sdpa per packed sequence); or name one."""
    trust_remote_code: bool = False
    """Passed to transformers when loading a hub model."""
    revision: str | None = None
    """Hub revision (branch, tag or commit) to load."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """Train low-rank adapters instead of every weight (off by default)."""

    def validate(self, p: str) -> None:
        _check(bool(self.name_or_path), f"{p}.name_or_path", "must not be empty")
        self.lora.validate(f"{p}.lora")


@dataclass(kw_only=True)
class DataConfig:
    source: str = "countdown"
    """'countdown' (seeded generator), 'toy' (the learning-test task), or a json/jsonl/parquet path or hub id."""
    prompt_column: str = "prompt"
    """File/hub data: the prompt column (a string, or a list of chat messages); every other column reaches the
    reward functions as a keyword argument. Data without it is read by a preset: countdown {nums, target}, gsm8k
    {question, answer}, math {problem, solution}."""
    template: str = field(default="chat", metadata=registry("fastgrpo.data.templates:TEMPLATES"))
    """Prompt template: 'chat' (the seeds' chat prompt), 'base' (plain text ending in '<think>') or 'compact' (the
    bare problem, e.g. '3 5 4 -> 32': for the byte-level tiny models)."""
    system_prompt: str = SEEDS_SYSTEM_PROMPT
    """System message for the chat template."""
    num_train: int = 10000
    """Number of generated training problems (generator sources only)."""
    num_eval: int = 64
    """Number of held-out problems; never overlaps the training split."""
    min_numbers: int = 3
    """Countdown: fewest numbers in a problem."""
    max_numbers: int = 4
    """Countdown: most numbers in a problem."""
    max_value: int = 99
    """Countdown: largest number drawn (numbers are drawn from 1..max_value)."""
    split: str = "train"
    """Split to read from a hub/file dataset."""
    eval_split: str | None = None
    """Split used for evaluation; None carves num_eval held-out rows off the training split."""
    skip_invalid_rows: bool = False
    """Skip (and count) rows with a missing or ill-typed field instead of raising."""
    seed: int = 0
    """Seed for generation and for the per-rank prompt order."""

    def validate(self, p: str) -> None:
        _check(self.num_train >= 1, f"{p}.num_train", "must be >= 1")
        _check(self.num_eval >= 0, f"{p}.num_eval", "must be >= 0")
        _check(2 <= self.min_numbers <= self.max_numbers <= 6, f"{p}.min_numbers",
               "need 2 <= min_numbers <= max_numbers <= 6")
        _check(self.max_value >= 1, f"{p}.max_value", "must be >= 1")
        _check(bool(self.prompt_column), f"{p}.prompt_column", "must not be empty")


@dataclass(kw_only=True)
class RewardConfig:
    funcs: list[str] = field(default_factory=lambda: ["format", "countdown"],
                             metadata=registry("fastgrpo.rewards:REWARDS", plugins=True))
    """Reward names from fastgrpo.rewards.REWARDS, or 'path/to/file.py:function' for your own."""
    weights: list[float] | None = None
    """One weight per reward function; None weighs each 1.0."""
    sandbox: bool = True
    """Run plugin files and 'math' in worker processes with a time bound; false runs all in the trainer (debugging)."""
    num_workers: int = 2
    """Reward worker processes per rank (at most one per sandboxed function is started)."""
    timeout_s: float = 60.0
    """Most seconds one sandboxed reward call (a function on a step's completions) may take; then it is killed."""
    on_error: Literal["value", "raise"] = "value"
    """A reward call that raises, times out, or returns a wrong length, a non-number or a non-finite value:
    'value' scores the completions it affects on_error_value (counted in reward/<name>/errors); 'raise' stops."""
    on_error_value: float = 0.0
    """The reward a failed reward call gives each completion it affects (on_error: value)."""
    kwargs: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Parameters per reward function, e.g. {cosine: {max_len: 512}, repetition: {n_grams: 4}} (keyed by name,
    plugin spec or plugin function name); checked against the function's keyword parameters before any model loads."""

    def validate(self, p: str) -> None:
        _check(len(self.funcs) >= 1, f"{p}.funcs", "need at least one reward function")
        _check(self.num_workers >= 1, f"{p}.num_workers", "must be >= 1")
        _check(self.timeout_s > 0, f"{p}.timeout_s", "must be > 0")
        _check(isinstance(self.kwargs, dict), f"{p}.kwargs", f"must be a mapping of reward name -> parameters, "
               f"got {self.kwargs!r}")
        for name, params in self.kwargs.items():
            _check(isinstance(params, dict), f"{p}.kwargs.{name}", f"must be a mapping of parameters, got {params!r}")
        if self.weights is not None:
            _check(len(self.weights) == len(self.funcs), f"{p}.weights",
                   f"has {len(self.weights)} weights for {len(self.funcs)} reward functions {self.funcs}")


@dataclass(kw_only=True)
class RolloutConfig:
    engine: str = field(default="hf", metadata=registry("fastgrpo.rollout:ENGINES"))
    """Rollout engine (fastgrpo.rollout.ENGINES): 'hf' (KV-cached decode on the live policy) or 'vllm' (colocated)."""
    max_completion_length: int = 256
    """Most new tokens per completion."""
    temperature: float = 1.0
    """Sampling temperature; the loss uses the same temperature for its log-probs."""
    top_p: float = 1.0
    """Nucleus sampling threshold."""
    batch_size: int = 64
    """hf engine: most sequences generated at once."""
    hf_decode: Literal["auto", "lean", "transformers"] = "auto"
    """hf engine decode step: 'lean' (fastgrpo.rollout.lean_decode; Qwen2/Llama, unsharded, no adapters),
    'transformers' (the model's forward), or 'auto' (lean where the model supports it)."""
    gpu_memory_utilization: float = 0.3
    """vllm: fraction of GPU memory for the engine (weights + KV cache)."""
    max_model_len: int | None = None
    """vllm: context length; None = longest prompt (both splits) + max_completion_length."""
    enforce_eager: bool = False
    """vllm: skip CUDA-graph / compile warm-up (faster start, slower decode; on CPU start-up 15 s -> 2 s)."""
    enable_prefix_caching: bool = True
    """vllm: reuse KV cache across the G samples of a prompt."""
    sleep_level: Literal[0, 1, 2] = 1
    """vllm: 0 = never sleep, 1 = free KV cache during the update, 2 = also free the weights."""
    sync_bucket_mb: int = 512
    """vllm: weight-sync bucket size in MB (full tensors gathered per bucket)."""
    lora_sync: Literal["merged", "adapter"] = "merged"
    """vllm with model.lora: 'merged' streams W + scale * B @ A per layer (the engine decodes a plain model);
    'adapter' sends only the adapters to vLLM's LoRA support (less to send, slower decoding; RESULTS.md)."""
    importance_sampling_cap: float | None = None
    """Token-level truncated importance-sampling correction of sampler/trainer mismatch, weight capped here (2.0
    is common); None = off. TRL's current default masks whole sequences instead, with cap 3."""

    def validate(self, p: str) -> None:
        _check(self.max_completion_length > 0, f"{p}.max_completion_length", "must be > 0")
        _check(self.temperature > 0, f"{p}.temperature", "must be > 0")
        _check(0 < self.top_p <= 1, f"{p}.top_p", "must be in (0, 1]")
        _check(self.batch_size >= 1, f"{p}.batch_size", "must be >= 1")
        _check(0 < self.gpu_memory_utilization < 1, f"{p}.gpu_memory_utilization", "must be in (0, 1)")
        _check(self.sync_bucket_mb >= 1, f"{p}.sync_bucket_mb", "must be >= 1")
        _check(self.importance_sampling_cap is None or self.importance_sampling_cap >= 1,
               f"{p}.importance_sampling_cap", "must be >= 1 or null")


@dataclass(kw_only=True)
class GRPOConfig:
    prompts_per_step: int = 8
    """B: prompts per optimizer step (per rank)."""
    num_generations: int = 8
    """G: completions per prompt."""
    loss_type: str = field(default="dapo", metadata=registry("fastgrpo.losses:LOSS_TYPES"))
    """grpo | dapo (alias bnpo) | dr_grpo: how per-token losses are normalised over the global batch."""
    scale_rewards: Literal["group", "batch", "none"] = "group"
    """Advantage scaling: 'group' (divide by group std), 'batch' (by batch std) or 'none' (Dr. GRPO)."""
    beta: float = 0.0
    """KL weight (k3 estimator) against a frozen reference model; 0 loads no reference model."""
    epsilon_low: float = 0.2
    """Lower clip range: ratio clipped at 1 - epsilon_low."""
    epsilon_high: float = 0.2
    """Upper clip range: ratio clipped at 1 + epsilon_high (DAPO clip-higher: 0.28)."""
    delta: float | None = None
    """Two-sided clipping: clamp the unclipped ratio at delta (TRL's delta); None = off."""
    num_iterations: int = 1
    """Policy updates per rollout batch (mu); > 1 uses stored old log-probs."""
    max_tokens_per_microbatch: int | None = None
    """Token budget of one packed micro-batch; gradients are accumulated across micro-batches. None: 1024 on a CPU
    (activations set host memory there, and smaller rows cost no speed: benchmarks/RESULTS.md), 4096 on CUDA."""
    importance_sampling_level: Literal["token", "sequence"] = "token"
    """'token' (GRPO: one ratio per token) or 'sequence' (GSPO: exp(mean over the sequence of logp - old), shared by
    its tokens, clipped at sequence_epsilon_low / sequence_epsilon_high)."""
    sequence_epsilon_low: float = 3e-4
    """Sequence level (GSPO): lower clip range of the sequence ratio (GSPO's paper: 3e-4)."""
    sequence_epsilon_high: float = 4e-4
    """Sequence level (GSPO): upper clip range of the sequence ratio (GSPO's paper: 4e-4)."""
    mask_truncated_completions: bool = False
    """DAPO's overlong filtering: completions cut at max_completion_length get no loss (and, for dapo, do not count
    in the token normaliser); their rewards still shape the group's advantages."""
    top_entropy_quantile: float = 1.0
    """TRL's entropy mask: only tokens whose policy entropy is in the top fraction q of this rank's batch get loss
    (0.2 = the 20% most uncertain tokens); 1.0 = all tokens. Costs one no-grad forward pass when < 1."""
    sil_top_k: int = 0
    """Self-imitation (easy-GRPO's 'sil'): the k best completions of each group (above the group mean, or at least
    sil_min_reward) get an extra supervised term sil_coef * w * -logp; 0 = off."""
    sil_coef: float = 0.1
    """Weight of the self-imitation term (added to those completions' advantages: exact at num_iterations 1)."""
    sil_min_reward: float | None = None
    """Self-imitation: reward a completion needs to be imitated; None = strictly above its group's mean."""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling: drop groups whose rewards are all equal and sample more prompts until the batch has
    prompts_per_step groups (at most dynamic_sampling_max_rounds extra rounds; then train on what was kept)."""
    dynamic_sampling_max_rounds: int = 4
    """Most extra rollout rounds per step for dynamic sampling."""
    head_backend: str = field(default="auto", metadata=registry("fastgrpo.kernels:BACKENDS"))
    """lm_head + loss kernel path (fastgrpo.kernels): 'auto' (cublas on CUDA, torch on CPU); 'cublas' (gradient
    formed in forward, three products, bf16 logits as in TRL); 'triton' (float32 logits recomputed in backward:
    more precise, one product more); 'torch' (chunked, any device)."""

    def validate(self, p: str) -> None:
        _check(self.prompts_per_step >= 1, f"{p}.prompts_per_step", "must be >= 1")
        _check(self.num_generations >= 2, f"{p}.num_generations",
               f"must be >= 2 (group statistics need two samples), got {self.num_generations}")
        _check(self.beta >= 0, f"{p}.beta", "must be >= 0")
        _check(0 <= self.epsilon_low < 1, f"{p}.epsilon_low", "must be in [0, 1)")
        _check(self.epsilon_high >= 0, f"{p}.epsilon_high", "must be >= 0")
        _check(self.delta is None or self.delta > 1 + self.epsilon_high, f"{p}.delta",
               "must exceed 1 + epsilon_high")
        _check(self.num_iterations >= 1, f"{p}.num_iterations", "must be >= 1")
        _check(self.max_tokens_per_microbatch is None or self.max_tokens_per_microbatch >= 1,
               f"{p}.max_tokens_per_microbatch", "must be >= 1 (or null: the device's default)")
        _check(0 <= self.sequence_epsilon_low < 1, f"{p}.sequence_epsilon_low", "must be in [0, 1)")
        _check(self.sequence_epsilon_high >= 0, f"{p}.sequence_epsilon_high", "must be >= 0")
        _check(0 < self.top_entropy_quantile <= 1, f"{p}.top_entropy_quantile", "must be in (0, 1]")
        _check(0 <= self.sil_top_k <= self.num_generations, f"{p}.sil_top_k",
               f"must be in [0, num_generations={self.num_generations}]")
        _check(self.sil_coef >= 0, f"{p}.sil_coef", "must be >= 0")
        _check(self.dynamic_sampling_max_rounds >= 0, f"{p}.dynamic_sampling_max_rounds", "must be >= 0")


@dataclass(kw_only=True)
class OptimConfig:
    lr: float = 1e-6
    """Peak learning rate of AdamW."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.99])
    """AdamW betas."""
    warmup_steps: int = 0
    """Linear warm-up, in optimizer updates (max_steps * grpo.num_iterations in all), up to lr."""
    schedule: Literal["constant", "cosine"] = "constant"
    """After warm-up: 'constant' or 'cosine' (down to min_lr_ratio * lr at the last optimizer update)."""
    min_lr_ratio: float = 0.0
    """Cosine floor as a fraction of lr."""
    max_grad_norm: float = 1.0
    """Gradient clipping by global norm; 0 disables."""
    max_nonfinite_steps: int = 3
    """An update with a NaN/inf loss or gradient is skipped (counted in policy/skipped_updates); this many in a row
    stop the run with an error."""

    def validate(self, p: str) -> None:
        _check(self.lr > 0 and math.isfinite(self.lr), f"{p}.lr", f"must be > 0, got {self.lr}")
        _check(self.weight_decay >= 0, f"{p}.weight_decay", "must be >= 0")
        _check(len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas), f"{p}.betas",
               "must be two numbers in [0, 1)")
        _check(self.warmup_steps >= 0, f"{p}.warmup_steps", "must be >= 0")
        _check(0 <= self.min_lr_ratio <= 1, f"{p}.min_lr_ratio", "must be in [0, 1]")
        _check(self.max_grad_norm >= 0, f"{p}.max_grad_norm", "must be >= 0")
        _check(self.max_nonfinite_steps >= 1, f"{p}.max_nonfinite_steps", "must be >= 1")


@dataclass(kw_only=True)
class ParallelConfig:
    fsdp: bool = True
    """FSDP2 (fully_shard per block + root) with world size > 1, and on CUDA with one GPU too (mixed precision)."""
    param_dtype: Literal["float32", "bfloat16"] = "bfloat16"
    """FSDP2 mixed precision: dtype of gathered parameters on CUDA (CPU always computes in float32)."""
    reduce_dtype: Literal["float32", "bfloat16"] = "float32"
    """FSDP2 mixed precision: dtype of gradient reductions."""
    cpu_offload: bool = False
    """FSDP2 CPU offload of parameters, gradients and optimizer state."""
    activation_checkpointing: bool = False
    """Recompute each transformer block's activations in the backward pass."""
    compile: bool = False
    """torch.compile each transformer block."""

    def validate(self, p: str) -> None:
        pass  # its choices are Literal fields, checked with every section's


@dataclass(kw_only=True)
class CheckpointConfig:
    every: int = 0
    """Save every N steps (0 = only at the end)."""
    keep_last: int = 2
    """Keep the last K checkpoints."""
    resume: str = "auto"
    """'auto' resumes from the newest checkpoint in the run folder, 'never', or a checkpoint path."""
    export_hf: bool = True
    """Write a Hugging Face folder (safetensors, config, tokenizer) at the end; with LoRA, a peft adapter folder."""
    overwrite: bool = False
    """With resume: never, allow starting over in a run folder that holds a run (its checkpoints and logs go)."""
    export_merged: bool = False
    """With LoRA: also write <run>/final_merged, the base model with the adapters merged in (Hugging Face folder)."""

    def validate(self, p: str) -> None:
        _check(self.every >= 0, f"{p}.every", "must be >= 0")
        _check(self.keep_last >= 1, f"{p}.keep_last", "must be >= 1")


@dataclass(kw_only=True)
class EvalConfig:
    every: int = 0
    """Evaluate every N steps on held-out prompts (0 = only at the end; -1 = never)."""
    num_prompts: int = 32
    """Held-out prompts per evaluation."""
    best_of_n: int = 4
    """Samples per prompt for best-of-n accuracy (1 = greedy only)."""
    temperature: float = 1.0
    """Sampling temperature for best-of-n."""
    at_start: bool = False
    """Also evaluate before the first step (logged as step 0), so that a run shows where it started."""

    def validate(self, p: str) -> None:
        _check(self.every >= -1, f"{p}.every", "must be >= -1")
        _check(self.num_prompts >= 1, f"{p}.num_prompts", "must be >= 1")
        _check(self.best_of_n >= 1, f"{p}.best_of_n", "must be >= 1")
        _check(self.temperature > 0, f"{p}.temperature", "must be > 0")


@dataclass(kw_only=True)
class LogConfig:
    report_to: list[str] = field(default_factory=lambda: ["jsonl"], metadata=registry("fastgrpo.metrics:SINKS"))
    """Metric sinks besides the progress bar: 'jsonl', 'wandb'."""
    wandb_project: str = "fastgrpo"
    """wandb project name."""
    completions_per_step: int = 4
    """Completions sampled into completions.jsonl each step."""
    progress: bool = True
    """Show a progress bar (rank 0 only)."""

    def validate(self, p: str) -> None:
        _check(self.completions_per_step >= 0, f"{p}.completions_per_step", "must be >= 0")


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
    freed, instead of staying resident in malloc's heaps (fastgrpo.memory; 0 leaves malloc as it is; a
    MALLOC_MMAP_THRESHOLD_ environment variable wins). At most 32 MiB."""
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    log: LogConfig = field(default_factory=LogConfig)

    @property
    def run_dir(self) -> Path:
        return Path(self.output_dir) / self.name


@dataclass(kw_only=True)
class TrainConfig(RunConfig):
    """A GRPO run: the shared sections plus rewards, rollout and the GRPO objective."""

    rewards: RewardConfig = field(default_factory=RewardConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)

    def validate(self) -> "TrainConfig":
        check_run_config(self, head_backend_field="grpo.head_backend")
        _check(not (self.grpo.head_backend == "cublas" and self.grpo.importance_sampling_level == "sequence"),
               "grpo.head_backend", "'cublas' forms each token's gradient before its sequence is complete, so it "
               "has no sequence-level importance sampling; use auto (triton on CUDA) or triton")
        _check(not self.checkpoint.export_merged or self.model.lora.enabled, "checkpoint.export_merged",
               "merges LoRA adapters: set model.lora.rank > 0 (a full fine-tune's export_hf folder is already merged)")
        _check(not (self.model.lora.modules_to_save and self.rollout.engine == "vllm"
                    and self.rollout.lora_sync == "adapter"), "rollout.lora_sync",
               "'adapter' sends the LoRA matrices only, not model.lora.modules_to_save: use 'merged'")
        return self


def check_run_config(cfg: Any, *, head_backend_field: str) -> Any:
    """Validate a run config (TrainConfig, SFTConfig): its own fields, then every section's choices and checks,
    then that the kernel path ``head_backend_field`` runs on the run's device. Returns ``cfg``."""
    import torch  # deferred: the config module loads without torch for --help-config

    _check_finite(cfg, "")
    # The run folder is output_dir/name and nothing else: a name with a separator or '..' would write (and
    # delete old checkpoints) outside output_dir.
    _check(bool(cfg.name) and cfg.name not in (".", "..") and not any(c in cfg.name for c in "/\\\0"),
           "name", f"must be a plain folder name (no '/', '\\', '..'), got {cfg.name!r}")
    _check(cfg.max_steps >= 1, "max_steps", "must be >= 1")
    _check(0 <= cfg.malloc_mmap_threshold <= 32 << 20, "malloc_mmap_threshold",
           f"must be in [0, {32 << 20}] bytes (glibc's limit), got {cfg.malloc_mmap_threshold}")
    if cfg.device == "cuda":
        _check(torch.cuda.is_available(), "device",
               "is 'cuda' but no CUDA device is available (torch.cuda.is_available() is False); use auto or cpu")
    for f in dataclasses.fields(cfg):
        sub = getattr(cfg, f.name)
        if dataclasses.is_dataclass(sub):
            _check_choice_fields(sub, f"{f.name}.")
            sub.validate(f.name)
    _check_choice_fields(cfg, "")
    from fastgrpo.kernels import resolve_backend

    section, _, name = head_backend_field.partition(".")
    device = cfg.device if cfg.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    try:  # Triton paths need CUDA or the interpreter
        resolve_backend(getattr(getattr(cfg, section), name), device, needs_grad=True)
    except ValueError as e:
        _fail(head_backend_field, f"{e}; use auto or torch on CPU")
    return cfg


def _check_finite(node: Any, path: str) -> None:
    """Every float in the config (nested sections and lists too) is finite: one NaN or inf in a weight, a rate or
    a clip range would turn every parameter into NaN a few steps later."""
    if dataclasses.is_dataclass(node):
        for f in dataclasses.fields(node):
            _check_finite(getattr(node, f.name), f"{path}.{f.name}" if path else f.name)
    elif isinstance(node, (list, tuple)):
        for i, v in enumerate(node):
            _check_finite(v, f"{path}[{i}]")
    elif isinstance(node, float):
        _check(math.isfinite(node), path, f"must be a finite number, got {node}")


# ----------------------------------------------------------------------------------------------------------------
# Loading: YAML + dotted overrides, strict keys, type coercion


def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _coerce(value: Any, tp: Any, path: str) -> Any:
    """Coerce a YAML/CLI value to the annotated type, or raise naming the field."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is Literal:  # the value's type here; membership in validate(), with registry fields
        return _coerce(value, type(args[0]), path)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        if value is None and type(None) in args:
            return None
        if isinstance(value, str) and value.lower() in ("none", "null") and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(value, inner[0], path)
    if origin is list:
        if isinstance(value, str):
            value = yaml.safe_load(value) if value.strip().startswith("[") else [v for v in value.split(",") if v]
        if not isinstance(value, (list, tuple)):
            _fail(path, f"expected a list, got {value!r}")
        return [_coerce(v, args[0], f"{path}[{i}]") for i, v in enumerate(value)]
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        _fail(path, f"expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, bool):
            _fail(path, f"expected an integer, got {value!r}")
        try:
            f = float(value)
        except (TypeError, ValueError):
            _fail(path, f"expected an integer, got {value!r}")
        if not f.is_integer():
            _fail(path, f"expected an integer, got {value!r}")
        return int(f)
    if tp is float:
        if isinstance(value, bool):
            _fail(path, f"expected a number, got {value!r}")
        try:
            return float(value)
        except (TypeError, ValueError):
            _fail(path, f"expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, (dict, list)):
            _fail(path, f"expected a string, got {value!r}")
        return str(value)
    return value


def _closest(key: str, options: list[str]) -> str:
    match = difflib.get_close_matches(key, options, n=1, cutoff=0.0)
    return f"; did you mean {match[0]!r}?" if match else ""


def _all_keys(cls: type, prefix: str = "") -> list[str]:
    keys = []
    for f in dataclasses.fields(cls):
        tp = _field_types(cls)[f.name]
        if dataclasses.is_dataclass(tp):
            keys += _all_keys(tp, f"{prefix}{f.name}.")
        else:
            keys.append(f"{prefix}{f.name}")
    return keys


def _build(cls: type, data: dict, path: str, root: type) -> Any:
    if not isinstance(data, dict):
        _fail(path or "config", f"expected a mapping, got {data!r}")
    types = _field_types(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        full = f"{path}.{key}" if path else str(key)
        if key not in names:
            candidates = [f"{path}.{n}" if path else n for n in names] + _all_keys(root)
            raise ConfigError(f"unknown config key {full!r}{_closest(full, candidates)}")
        tp = types[key]
        if dataclasses.is_dataclass(tp):
            kwargs[key] = _build(tp, value or {}, full, root)
        else:
            kwargs[key] = _coerce(value, tp, full)
    return cls(**kwargs)


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{dotted}: {part!r} is not a section")
    node[parts[-1]] = value


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = (), *,
                cls: type = TrainConfig) -> Any:
    """Read a YAML file (optional), apply ``key=value`` overrides, build and validate a ``cls`` (TrainConfig;
    ``fastgrpo.sft.SFTConfig`` for SFT)."""
    tree: dict = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} does not exist")
        try:
            tree = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{p}: not valid YAML: {e}") from None
        if not isinstance(tree, dict):
            raise ConfigError(f"{p}: top level must be a mapping")
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key=value")
        key, raw = item.split("=", 1)
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError:
            raise ConfigError(f"override {item!r}: the value is not valid YAML") from None
        _set_dotted(tree, key.strip(), value)
    return _build(cls, tree, "", cls).validate()


def to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)


def describe(cls: type = TrainConfig) -> str:
    """Every key of the run config ``cls`` with its default and docstring (for --help-config)."""
    import ast
    import inspect

    lines = []

    def walk(cls: type, prefix: str) -> None:
        docs: dict[str, str] = {}
        for klass in reversed([k for k in cls.__mro__ if dataclasses.is_dataclass(k)]):  # a subclass's docs win
            body = ast.parse(inspect.getsource(klass)).body[0].body
            for a, b in zip(body, body[1:]):
                if isinstance(a, ast.AnnAssign) and isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant):
                    docs[a.target.id] = str(b.value.value)
        for f in dataclasses.fields(cls):
            tp = _field_types(cls)[f.name]
            if dataclasses.is_dataclass(tp):
                walk(tp, f"{prefix}{f.name}.")
            else:
                default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
                line = f"{prefix}{f.name} = {default!r}\n    {docs.get(f.name, '')}"
                names = choices(cls, f.name)
                if names is not None:
                    line += f"\n    choices: {', '.join(map(str, names))}"
                lines.append(line)

    walk(cls, "")
    return "\n".join(lines)
