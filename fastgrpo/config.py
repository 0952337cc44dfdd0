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

    def validate(self, p: str) -> None:
        _check(bool(self.name_or_path), f"{p}.name_or_path", "must not be empty")


@dataclass(kw_only=True)
class DataConfig:
    source: str = "countdown"
    """'countdown' (seeded generator), 'toy' (the learning-test task), or a json/jsonl/parquet path or hub id."""
    template: str = field(default="chat", metadata=registry("fastgrpo.data.templates:TEMPLATES"))
    """Prompt template: 'chat' (the seeds' chat prompt) or 'base' (plain text ending in '<think>')."""
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


@dataclass(kw_only=True)
class RewardConfig:
    funcs: list[str] = field(default_factory=lambda: ["format", "countdown"],
                             metadata=registry("fastgrpo.rewards:REWARDS", plugins=True))
    """Reward names from fastgrpo.rewards.REWARDS, or 'path/to/file.py:function' for your own."""
    weights: list[float] | None = None
    """One weight per reward function; None weighs each 1.0."""

    def validate(self, p: str) -> None:
        _check(len(self.funcs) >= 1, f"{p}.funcs", "need at least one reward function")
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
    max_tokens_per_microbatch: int = 4096
    """Token budget of one packed micro-batch; gradients are accumulated across micro-batches."""
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
        _check(self.max_tokens_per_microbatch >= 1, f"{p}.max_tokens_per_microbatch", "must be >= 1")


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

    def validate(self, p: str) -> None:
        _check(self.lr > 0 and math.isfinite(self.lr), f"{p}.lr", f"must be > 0, got {self.lr}")
        _check(self.weight_decay >= 0, f"{p}.weight_decay", "must be >= 0")
        _check(len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas), f"{p}.betas",
               "must be two numbers in [0, 1)")
        _check(self.warmup_steps >= 0, f"{p}.warmup_steps", "must be >= 0")
        _check(0 <= self.min_lr_ratio <= 1, f"{p}.min_lr_ratio", "must be in [0, 1]")
        _check(self.max_grad_norm >= 0, f"{p}.max_grad_norm", "must be >= 0")


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
    """Write a Hugging Face folder (safetensors, config, tokenizer) at the end."""

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
class TrainConfig:
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
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rewards: RewardConfig = field(default_factory=RewardConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    log: LogConfig = field(default_factory=LogConfig)

    @property
    def run_dir(self) -> Path:
        return Path(self.output_dir) / self.name

    def validate(self) -> "TrainConfig":
        _check(bool(self.name) and "/" not in self.name, "name", "must be a non-empty folder name")
        _check(self.max_steps >= 1, "max_steps", "must be >= 1")
        for f in dataclasses.fields(self):
            sub = getattr(self, f.name)
            if dataclasses.is_dataclass(sub):
                _check_choice_fields(sub, f"{f.name}.")
                sub.validate(f.name)
        _check_choice_fields(self, "")
        self._check_head_backend()
        return self

    def _check_head_backend(self) -> None:
        """The kernel path must run on the run's device (Triton paths need CUDA or the interpreter)."""
        import torch  # deferred: the config module loads without torch

        from fastgrpo.kernels import resolve_backend

        device = self.device if self.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
        try:
            resolve_backend(self.grpo.head_backend, device, needs_grad=True)
        except ValueError as e:
            _fail("grpo.head_backend", f"{e}; use auto or torch on CPU")


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


def _build(cls: type, data: dict, path: str) -> Any:
    if not isinstance(data, dict):
        _fail(path or "config", f"expected a mapping, got {data!r}")
    types = _field_types(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        full = f"{path}.{key}" if path else str(key)
        if key not in names:
            candidates = [f"{path}.{n}" if path else n for n in names] + _all_keys(TrainConfig)
            raise ConfigError(f"unknown config key {full!r}{_closest(full, candidates)}")
        tp = types[key]
        if dataclasses.is_dataclass(tp):
            kwargs[key] = _build(tp, value or {}, full)
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


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> TrainConfig:
    """Read a YAML file (optional), apply ``key=value`` overrides, build and validate a TrainConfig."""
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
    return _build(TrainConfig, tree, "").validate()


def to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)


def describe() -> str:
    """Every key with its default and docstring (for --help-config)."""
    import ast
    import inspect

    lines = []

    def walk(cls: type, prefix: str) -> None:
        src = inspect.getsource(cls)
        docs: dict[str, str] = {}
        body = ast.parse(src).body[0].body
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

    walk(TrainConfig, "")
    return "\n".join(lines)
