"""The sections of a run config: one keyword-only dataclass per component. A section's ``validate(path)`` checks
what it accepts on its own; what a component serves is checked by that component, registered with
:func:`fastgrpo.config.loader.section_check` (the rollout engines: rollout.hf, rollout.vllm; the environments:
rollout.env; the algorithms: ppo and the run's algorithm), and the policy loss's settings by
``fastgrpo.kernels.LossSettings``. Bad values raise ``ConfigError`` naming the dotted field. Every field has a
one-line docstring, which ``--help-config`` prints. Components take their own section, never the whole run config.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Literal

from fastgrpo.config.loader import check, fail, registry

__all__ = ["CheckpointConfig", "DataConfig", "EnvConfig", "EvalConfig", "GRPOConfig", "HFRolloutConfig", "LogConfig",
           "LoraConfig", "ModelConfig", "OptimConfig", "PPOConfig", "ParallelConfig", "RewardConfig", "RolloutConfig",
           "SEEDS_SYSTEM_PROMPT", "VLLMRolloutConfig"]


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
        check(self.rank >= 0, f"{p}.rank", "must be >= 0 (0 = off)")
        check(self.alpha is None or self.alpha > 0, f"{p}.alpha", "must be > 0 or null")
        check(0 <= self.dropout < 1, f"{p}.dropout", "must be in [0, 1)")
        check(bool(self.target_modules) and all(self.target_modules), f"{p}.target_modules",
              "must name at least one module (or be ['all-linear'])")
        check(all(self.modules_to_save), f"{p}.modules_to_save", "names must be non-empty")
        check(not self.modules_to_save or self.enabled, f"{p}.modules_to_save", "needs model.lora.rank > 0")
        # rank 0 trains every weight: other LoRA settings without a rank mean the rank was forgotten (or misspelled)
        unused = [k for k, v, off in (("alpha", self.alpha, None), ("dropout", self.dropout, 0.0),
                                      ("target_modules", self.target_modules, ["all-linear"])) if v != off]
        check(self.enabled or not unused, f"{p}.rank",
              f"is 0 (LoRA off: every weight trains) but {', '.join(f'{p}.{k}' for k in unused)} "
              f"{'is' if len(unused) == 1 else 'are'} set; set "
              f"{p}.rank > 0 to train adapters, or drop the other LoRA settings")
        check(not any(m.split(".")[-1] in _HEAD_NAMES for m in self.modules_to_save), f"{p}.modules_to_save",
              f"cannot hold {sorted(_HEAD_NAMES)}: the fused head kernels read lm_head.weight, which would bypass "
              "a trained copy")

    @property
    def enabled(self) -> bool:
        return self.rank > 0


@dataclass(kw_only=True)
class ModelConfig:
    name_or_path: str = "tiny"
    """'tiny' (the embedded model, built locally), a named source ('smollm2-135m-instruct'), a local folder, a
    .gguf file (dequantized once into a cached float32 folder), or a Hugging Face hub id (needs network)."""
    gguf_file: str | None = None
    """A GGUF file inside the folder or hub repo name_or_path (as transformers' gguf_file=); None: not GGUF."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Weights: 'auto' (CUDA: float32 masters, bfloat16 compute via FSDP2; CPU: float32), 'float32' or 'bfloat16'."""
    attn_implementation: str = field(default="auto",
                                     metadata=registry("fastgrpo.models.attention:ATTN_BACKENDS", also=("auto",)))
    """'auto' picks flash_attention_2 > torch_varlen > sdpa_varlen on CUDA, sdpa_varlen (sdpa per packed sequence)
    elsewhere; or name one (flex_attention compiles per packed length)."""
    trust_remote_code: bool = False
    """Passed to transformers when loading a hub model."""
    revision: str | None = None
    """Hub revision (branch, tag or commit) to load."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """Train low-rank adapters instead of every weight (off by default)."""

    def validate(self, p: str) -> None:
        check(bool(self.name_or_path), f"{p}.name_or_path", "must not be empty")
        check(self.gguf_file is None or (bool(self.gguf_file) and not self.name_or_path.lower().endswith(".gguf")),
              f"{p}.gguf_file", "names a GGUF file inside the folder or hub repo name_or_path: leave it unset when "
              "name_or_path is itself a .gguf file, and not empty")


@dataclass(kw_only=True)
class DataConfig:
    source: str = "countdown"
    """'countdown' or 'arithmetic' (seeded generators), 'toy' (the learning-test task), or a json/jsonl/parquet path
    or hub id."""
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
    digits: list[int] = field(default_factory=lambda: [2, 2])
    """Arithmetic: digits of the first and second operand, each drawn uniformly among such numbers ([2, 1]: 10..99
    and 1..9)."""
    ops: list[str] = field(default_factory=lambda: ["+"], metadata=registry("fastgrpo.data.arithmetic:OPERATORS"))
    """Arithmetic: operators drawn per problem, from '+', '-' (larger operand first) and '*'."""
    split: str = "train"
    """Split to read from a hub/file dataset."""
    eval_split: str | None = None
    """Split used for evaluation; None carves num_eval held-out rows off the training split."""
    skip_invalid_rows: bool = False
    """Skip (and count) rows with a missing or ill-typed field instead of raising."""
    seed: int = 0
    """Seed for generation and for the per-rank prompt order."""

    def validate(self, p: str) -> None:
        check(self.num_train >= 1, f"{p}.num_train", "must be >= 1")
        check(self.num_eval >= 0, f"{p}.num_eval", "must be >= 0")
        check(2 <= self.min_numbers <= self.max_numbers <= 6, f"{p}.min_numbers",
              "need 2 <= min_numbers <= max_numbers <= 6")
        check(self.max_value >= 1, f"{p}.max_value", "must be >= 1")
        check(len(self.digits) == 2 and all(1 <= d <= 9 for d in self.digits), f"{p}.digits",
              f"must be two digit counts in 1..9 (first and second operand), got {self.digits}")
        check(bool(self.ops), f"{p}.ops", "must name at least one operator")
        check(bool(self.prompt_column), f"{p}.prompt_column", "must not be empty")


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
    """Most seconds one sandboxed reward call (a function on a step's completions), or the import of a plugin file,
    may take; then it is killed."""
    on_error: Literal["value", "raise"] = "value"
    """A reward call that raises, times out, or returns a wrong length, a non-number or a non-finite value:
    'value' scores the completions it affects on_error_value (counted in reward/<name>/errors); 'raise' stops."""
    on_error_value: float = 0.0
    """The reward a failed reward call gives each completion it affects (on_error: value)."""
    kwargs: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Parameters per reward function, e.g. {cosine: {max_len: 512}, repetition: {n_grams: 4}} (keyed by name,
    plugin spec or plugin function name); checked against the function's keyword parameters before any model loads."""

    def validate(self, p: str) -> None:
        check(len(self.funcs) >= 1, f"{p}.funcs", "need at least one reward function")
        check(self.num_workers >= 1, f"{p}.num_workers", "must be >= 1")
        check(self.timeout_s > 0, f"{p}.timeout_s", "must be > 0")
        check(isinstance(self.kwargs, dict), f"{p}.kwargs", f"must be a mapping of reward name -> parameters, "
              f"got {self.kwargs!r}")
        for name, params in self.kwargs.items():
            check(isinstance(params, dict), f"{p}.kwargs.{name}", f"must be a mapping of parameters, got {params!r}")
        if self.weights is not None:
            check(len(self.weights) == len(self.funcs), f"{p}.weights",
                  f"has {len(self.weights)} weights for {len(self.funcs)} reward functions {self.funcs}")


@dataclass(kw_only=True)
class HFRolloutConfig:
    """The transformers engine (``rollout.engine=hf``): KV-cached decoding on the live policy (checked by
    fastgrpo.rollout.hf)."""

    batch_size: int = 64
    """Most sequences generated at once."""
    decode: Literal["auto", "lean", "transformers"] = "auto"
    """Decode step: 'lean' (fastgrpo.rollout.lean_decode; Qwen2/Llama, unsharded, no adapters), 'transformers' (the
    model's forward), or 'auto' (lean where the model supports it)."""
    cuda_graph: bool = True
    """CUDA, lean decode step: capture the step once per chunk in a CUDA graph and replay it per token."""


@dataclass(kw_only=True)
class VLLMRolloutConfig:
    """The colocated vLLM engine (``rollout.engine=vllm``): one in-process ``vllm.LLM`` per rank (checked by
    fastgrpo.rollout.vllm)."""

    gpu_memory_utilization: float = 0.3
    """Fraction of GPU memory for the engine (weights + KV cache); it must fit in what is free when it starts."""
    max_model_len: int | None = None
    """Context length; None = a bound on the longest prompt (both splits) + max_completion_length."""
    enforce_eager: bool = False
    """Skip CUDA-graph / compile warm-up (faster start, slower decode; on CPU start-up 15 s -> 2 s)."""
    enable_prefix_caching: bool = True
    """Reuse the prompt's KV cache across its G samples."""
    sleep_level: Literal[0, 1, 2] = 1
    """0 = never sleep, 1 = free the KV cache during the update (weights offloaded), 2 = also drop the weights.
    CUDA only: a no-op on CPU."""
    sync_bucket_mb: int = 512
    """Weight-sync bucket size in MB (full tensors gathered per bucket, never splitting a transformer block)."""
    lora_sync: Literal["merged", "adapter"] = "merged"
    """With model.lora: 'merged' streams W + scale * B @ A per layer (the engine decodes a plain model); 'adapter'
    sends only the adapters to vLLM's LoRA support (less to send, slower decoding; RESULTS.md)."""


@dataclass(kw_only=True)
class EnvConfig:
    """Multi-turn rollouts (``rollout.max_turns`` > 1): the environment each trajectory talks to
    (fastgrpo.environments, which checks this section)."""

    name: str = field(default="none", metadata=registry("fastgrpo.environments:ENVIRONMENTS", also=("none",),
                                                        plugins=True))
    """'none' (single-turn), 'tools' (the model calls rollout.env.tools), a registered environment, or
    'path/to/file.py:ClassName' (your own fastgrpo.environments.Environment)."""
    tools: list[str] = field(default_factory=list, metadata=registry("fastgrpo.environments:TOOLS", plugins=True))
    """Tools of the 'tools' environment: built-in names (fastgrpo.environments.TOOLS) or 'path/to/file.py:function'
    (typed Python functions with docstrings; their schemas go to the chat template's tools=)."""
    tool_call_format: str = field(default="qwen", metadata=registry("fastgrpo.environments:TOOL_CALL_FORMATS"))
    """How tool calls are written in the model's output ('qwen': <tool_call>{"name": ..., "arguments": {...}}
    </tool_call>, Qwen2.5/Qwen3/Hermes)."""
    timeout_s: float = 10.0
    """Most seconds one tool call may take in its worker process; then it is killed and the model is told so."""
    num_workers: int = 2
    """Tool worker processes per rank."""
    max_output_chars: int = 2000
    """A tool's result (return value and printed output) is cut to this many characters in the tool message."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the environment's constructor (a plugin class or a registered environment)."""

    @property
    def enabled(self) -> bool:
        return self.name != "none"


@dataclass(kw_only=True)
class RolloutConfig:
    engine: str = field(default="hf", metadata=registry("fastgrpo.rollout:ENGINES"))
    """Rollout engine (fastgrpo.rollout.ENGINES): 'hf' (KV-cached decode on the live policy) or 'vllm' (colocated);
    each engine is built from its own sub-section below."""
    max_completion_length: int = 256
    """Most new tokens per completion."""
    temperature: float = 1.0
    """Sampling temperature; the loss uses the same temperature for its log-probs."""
    top_p: float = 1.0
    """Nucleus sampling threshold."""
    top_k: int = 0
    """Sample among the top_k most likely tokens only (applied before top_p); 0 = all tokens."""
    importance_sampling_cap: float | None = None
    """Token-level truncated importance-sampling correction of sampler/trainer mismatch, weight capped here (2.0
    is common); None = off. TRL's current default masks whole sequences instead, with cap 3."""
    hf: HFRolloutConfig = field(default_factory=HFRolloutConfig)
    """Options of the 'hf' engine."""
    vllm: VLLMRolloutConfig = field(default_factory=VLLMRolloutConfig)
    """Options of the 'vllm' engine."""
    max_turns: int = 1
    """Model turns per trajectory (multi-turn with rollout.env); a trajectory still calling tools after the last
    one is truncated (finish 'length': grpo.mask_truncated_completions applies). With an environment,
    max_completion_length bounds the whole trajectory after the prompt: model and environment tokens."""
    env: EnvConfig = field(default_factory=EnvConfig)
    """The environment of multi-turn rollouts (fastgrpo.environments)."""
    asynchronous: bool = False
    """Generate the next steps' batches in a worker process while this step trains (docs/ASYNC.md): the batch of
    step k is sampled from the weights of step k - max_staleness (the first ones from the start or resume weights),
    corrected by the truncated importance weights of rollout.importance_sampling_cap (required). 'hf' engine, one
    process, CPU, single-turn GRPO for now. ('async' is a Python keyword, hence the name.)"""
    max_staleness: int = 1
    """rollout.asynchronous: optimizer steps (training steps) a batch's weights may lag the policy it trains; also
    the batches in flight. A batch older than this is refused (an error, never trained on)."""
    async_threads: int | None = None
    """rollout.asynchronous on a CPU: torch threads of the generation worker; the trainer keeps the rest of the
    cores (at least 1). None = half the cores (at least 1)."""
    async_timeout_s: float = 600.0
    """rollout.asynchronous: most seconds the trainer waits for one batch from the worker (its start: at least 300
    s); then the worker is stopped, and the run saves a checkpoint and stops with a one-line error."""

    def validate(self, p: str) -> None:
        check(self.max_staleness >= 1, f"{p}.max_staleness", f"must be >= 1, got {self.max_staleness}")
        check(self.async_threads is None or self.async_threads >= 1, f"{p}.async_threads",
              f"must be >= 1 or null, got {self.async_threads}")
        check(self.async_timeout_s > 0, f"{p}.async_timeout_s", f"must be > 0, got {self.async_timeout_s}")
        check(self.max_turns >= 1, f"{p}.max_turns", f"must be >= 1, got {self.max_turns}")
        check(self.max_turns == 1 or self.env.enabled, f"{p}.max_turns",
              f"more than one turn needs an environment to answer the model: set {p}.env.name")
        check(self.max_completion_length > 0, f"{p}.max_completion_length", "must be > 0")
        check(self.temperature > 0, f"{p}.temperature", "must be > 0")
        check(0 < self.top_p <= 1, f"{p}.top_p", "must be in (0, 1]")
        check(self.top_k >= 0, f"{p}.top_k", f"must be >= 0 (0 = all tokens), got {self.top_k}")
        check(self.importance_sampling_cap is None or self.importance_sampling_cap >= 1,
              f"{p}.importance_sampling_cap", "must be >= 1 or null")


@dataclass(kw_only=True)
class GRPOConfig:
    prompts_per_step: int = 8
    """B: prompts per optimizer step (per rank)."""
    num_generations: int = 8
    """G: completions per prompt."""
    loss_type: str = field(default="dapo", metadata=registry("fastgrpo.kernels.loss_types:LOSS_TYPES"))
    """grpo | dapo (alias bnpo) | dr_grpo | luspo | cispo | sapo (TRL's loss types): how per-token losses are
    normalised over the global batch, and the per-token policy term (clip; cispo and sapo their own)."""
    scale_rewards: Literal["group", "batch", "none"] = "group"
    """Advantage scaling: 'group' (divide by group std), 'batch' (by batch std) or 'none' (Dr. GRPO)."""
    beta: float = 0.0
    """KL weight (k3 estimator) against a frozen reference model; 0 loads no reference model."""
    epsilon_low: float = 0.2
    """Lower clip range: ratio clipped at 1 - epsilon_low."""
    epsilon_high: float = 0.2
    """Upper clip range: ratio clipped at 1 + epsilon_high (DAPO clip-higher: 0.28). loss_type cispo: the bound of its
    truncated importance weight min(r, epsilon_high) itself, at either importance_sampling_level (TRL's eps_max;
    ScaleRL recommends 5.0)."""
    sapo_temperature_pos: float = 1.0
    """loss_type sapo: temperature of the soft gate for tokens with positive advantage (TRL's name and default)."""
    sapo_temperature_neg: float = 1.05
    """loss_type sapo: temperature of the soft gate for tokens with advantage <= 0 (TRL's name and default)."""
    use_bias_correction_kl: bool = True
    """beta > 0: multiply the k3 KL by the (differentiable) importance ratio, the unbiased reverse-KL gradient (TRL's
    use_bias_correction_kl, default True there too); false: plain k3."""
    delta: float | None = None
    """Two-sided clipping: clamp the unclipped ratio at delta (TRL's delta); None = off."""
    num_iterations: int = 1
    """Policy updates per rollout batch (mu); > 1 uses stored old log-probs."""
    max_tokens_per_microbatch: int | None = None
    """Token budget of one packed micro-batch; gradients are accumulated across micro-batches. None: 1024 on a CPU
    (activations set host memory there, and smaller rows cost no speed: benchmarks/RESULTS.md); on CUDA sized at the
    first update from the free GPU memory, 4096 to 32768 tokens (fastgrpo.update.microbatch: each micro-batch costs a
    trunk's worth of dispatched ops, so fewer, larger ones are faster), and printed; a resume sizes it again (the
    sum of the gradients does not depend on it, its rounding does). PPO's update keeps 4096."""
    shared_prefix: Literal["auto", "true", "false"] = "auto"
    """The update and the log-prob passes (GRPO, PPO and its critic) forward each prompt once per packed row for all
    the completions of its group there (fastgrpo.models.packing, "Shared prefixes"; the same log-probs and
    gradients): 'auto' wherever the attention can (sdpa, sdpa_varlen, torch_varlen, varlen_op, flash_attention_2;
    not eager or flex_attention, compiled or CUDA-graphed blocks, sliding-window models), 'true' (an error where it
    cannot), 'false'."""
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

    def loss_settings(self, temperature: float = 1.0):
        """The policy loss's settings, a ``fastgrpo.kernels.LossSettings`` (which checks them), from this section
        and the sampler's ``temperature``: built once per run and passed unchanged to the kernel."""
        from fastgrpo.kernels import LossSettings  # here: kernels import torch (and triton)

        return LossSettings(temperature=temperature, **{f: value for f, (_, value) in self._loss_fields().items()})

    def _loss_fields(self) -> dict[str, tuple[str, Any]]:
        """``LossSettings`` field -> (the key of this section that sets it, its value)."""
        from fastgrpo.kernels import LOSS_TYPES, POLICY_LOSSES

        term = LOSS_TYPES[self.loss_type].term
        level = "sequence_" if self.importance_sampling_level == "sequence" else ""
        # cispo's bound is epsilon_high itself at either level (TRL's one eps_max)
        high = "epsilon_high" if POLICY_LOSSES[term].bound_is_epsilon_high else f"{level}epsilon_high"
        keys = dict(epsilon_low=f"{level}epsilon_low", epsilon_high=high, delta="delta", beta="beta",
                    sapo_temperature_pos="sapo_temperature_pos", sapo_temperature_neg="sapo_temperature_neg",
                    use_bias_correction_kl="use_bias_correction_kl",
                    importance_sampling_level="importance_sampling_level")
        return {"policy_loss": ("loss_type", term), **{f: (key, getattr(self, key)) for f, key in keys.items()}}

    def validate(self, p: str) -> None:
        check(self.prompts_per_step >= 1, f"{p}.prompts_per_step", "must be >= 1")
        check(self.num_generations >= 2, f"{p}.num_generations",
              f"must be >= 2 (group statistics need two samples), got {self.num_generations}")
        check(self.epsilon_low < 1, f"{p}.epsilon_low", "must be in [0, 1)")
        check(self.sequence_epsilon_low < 1, f"{p}.sequence_epsilon_low", "must be in [0, 1)")
        from fastgrpo.kernels import LossSettingError  # here: kernels import torch (and triton)

        for level in ("token", "sequence"):  # both levels' clip ranges, whichever the run uses
            section = dataclasses.replace(self, importance_sampling_level=level)
            try:
                section.loss_settings()
            except LossSettingError as e:  # the setting's own check, reported under this section's key
                fail(f"{p}.{section._loss_fields()[e.field][0]}", e.reason)
        check(self.delta is None or self.delta > 1 + self.epsilon_high, f"{p}.delta",
              "must exceed 1 + epsilon_high")
        check(self.num_iterations >= 1, f"{p}.num_iterations", "must be >= 1")
        check(self.max_tokens_per_microbatch is None or self.max_tokens_per_microbatch >= 1,
              f"{p}.max_tokens_per_microbatch", "must be >= 1 (or null: the device's default)")
        check(0 < self.top_entropy_quantile <= 1, f"{p}.top_entropy_quantile", "must be in (0, 1]")
        check(0 <= self.sil_top_k <= self.num_generations, f"{p}.sil_top_k",
              f"must be in [0, num_generations={self.num_generations}]")
        check(self.sil_coef >= 0, f"{p}.sil_coef", "must be >= 0")
        check(self.dynamic_sampling_max_rounds >= 0, f"{p}.dynamic_sampling_max_rounds", "must be >= 0")


@dataclass(kw_only=True)
class PPOConfig:
    """PPO with a learned critic (``algorithm: ppo``, fastgrpo.algorithms.ppo). The policy loss is grpo.loss_type's (the clipped
    objective for grpo / dapo / dr_grpo: grpo.epsilon_low/high, grpo.beta) with per-token GAE advantages. Checked by
    fastgrpo.algorithms.ppo."""

    gamma: float = 1.0
    """GAE discount per token, in [0, 1] (oat's default 1: the terminal reward reaches every token undiscounted)."""
    lam: float = 1.0
    """GAE lambda, in [0, 1]: 1 = Monte Carlo return minus the value, 0 = one-step TD error."""
    kl_coef: float = 0.0
    """KL penalty in the reward: each token gets -kl_coef * (logp - ref_logp) (oat's kl_penalty_coef); > 0 loads the
    reference model."""
    whiten_advantages: bool = True
    """Whiten the token advantages over the global batch (all ranks): (A - mean) / std."""
    vf_coef: float = 1.0
    """Weight of the value loss 0.5 * max((V - R)^2, (V_clipped - R)^2) (oat's default 1.0)."""
    cliprange_value: float = 0.2
    """Value clipping: V_clipped = V_old + clamp(V - V_old, -c, c)."""
    critic_lr: float = 9e-6
    """Peak learning rate of the critic's AdamW (oat's default 9e-6); its schedule is optim's (warm-up, decay)."""
    num_ppo_epochs: int = 1
    """Passes over each rollout batch."""
    num_mini_batches: int = 1
    """Optimizer updates per epoch: each rank's sequences are shuffled and split into this many mini-batches."""
    critic_init: str | None = None
    """The critic's trunk: a registered name, folder or hub id; None = model.name_or_path (the policy's base)."""
    critic_warmup_steps: int = 0
    """First rollout steps in which only the critic trains (the policy's first update then meets fitted values)."""


MAX_LR = 1.0
"""The largest optim.lr accepted."""


@dataclass(kw_only=True)
class OptimConfig:
    lr: float = 1e-6
    """Peak learning rate of AdamW, in (0, 1]."""
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
    implementation: Literal["auto", "fused", "foreach"] = "auto"
    """How AdamW runs, not what it computes: 'fused' (one kernel pass over all parameters per step; torch's
    ``fused=True``), 'foreach' (multi-tensor ops, a pass per arithmetic op), or 'auto': fused on CUDA, foreach
    elsewhere (on a CPU the fused kernel rounds differently and stopped the LoRA toy task from learning). A resume
    may change it."""

    def validate(self, p: str) -> None:
        # AdamW moves each weight by up to about lr per update whatever the gradient's scale, so a larger lr only
        # writes noise into the weights (lr=1e30 saved 1e30 weights with exit 0; 1e39 overflowed float32).
        check(0 < self.lr <= MAX_LR and math.isfinite(self.lr), f"{p}.lr",
              f"must be in (0, {MAX_LR}] (AdamW moves each weight by up to about lr per update), got {self.lr}")
        check(self.weight_decay >= 0, f"{p}.weight_decay", "must be >= 0")
        check(len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas), f"{p}.betas",
              "must be two numbers in [0, 1)")
        check(self.warmup_steps >= 0, f"{p}.warmup_steps", "must be >= 0")
        check(0 <= self.min_lr_ratio <= 1, f"{p}.min_lr_ratio", "must be in [0, 1]")
        check(self.max_grad_norm >= 0, f"{p}.max_grad_norm", "must be >= 0")
        check(self.max_nonfinite_steps >= 1, f"{p}.max_nonfinite_steps", "must be >= 1")


@dataclass(kw_only=True)
class ParallelConfig:
    fsdp: bool = True
    """FSDP2 (fully_shard per block + root) with world size > 1 (one GPU: see ``one_gpu``)."""
    one_gpu: Literal["plain", "fsdp"] = "plain"
    """One CUDA process: 'plain' keeps a plain module with float32 master weights whose forwards run under autocast
    to ``param_dtype`` (as torch AMP and TRL's bf16 do), and the hf rollout engine decodes with a ``param_dtype``
    copy of the weights, refreshed after every optimizer step; 'fsdp' wraps it in FSDP2 as with several ranks (slower
    on one GPU: its one-rank gathers cost launches, and its DTensors rule out the lean decode step)."""
    param_dtype: Literal["float32", "bfloat16"] = "bfloat16"
    """Compute dtype on CUDA: FSDP2's gathered parameters, or the autocast dtype of one plain GPU (a CPU computes in
    float32 unless ``master_weights``)."""
    reduce_dtype: Literal["float32", "bfloat16"] = "float32"
    """FSDP2 mixed precision: dtype of gradient reductions."""
    cpu_offload: bool = False
    """FSDP2 CPU offload of parameters, gradients and optimizer state."""
    activation_checkpointing: bool = False
    """Recompute each transformer block's activations in the backward pass."""
    lean_activations: bool = True
    """RMSNorms and SwiGLU MLPs keep only their inputs for backward during packed passes and recompute the pointwise
    rest (fastgrpo.models.lean_activations): about a third less activation memory on Llama / Qwen2 blocks, the same
    forward. Only modules whose lean forward reproduces theirs exactly; not with compile (inductor recomputes
    pointwise ops itself), cuda_graphs or activation_checkpointing."""
    compile: bool = False
    """torch.compile each transformer block (fullgraph, static shapes: one graph per token bucket; attention as the
    registered varlen op)."""
    token_buckets: list[int] = field(default_factory=list)
    """Pad each packed micro-batch up to the smallest of these token counts (static shapes, the tail a dummy segment
    that predicts nothing); [] = no padding, or with compile / cuda_graphs the micro-batch budget's 1/4, 1/2 and 1."""
    master_weights: bool = False
    """One plain GPU (or CPU): forward and backward on ``param_dtype`` weights, AdamW on float32 masters of them (no
    autocast); off: float32 weights with autocast on CUDA, float32 on a CPU."""
    cuda_graphs: bool = False
    """One plain GPU: replay the blocks' forward and backward from CUDA graphs captured per token bucket (a row that
    fits no bucket runs eagerly); with compile, inductor's graphs (mode reduce-overhead).
    The parameters' gradients then live in buffers kept between updates (a graph's own gradient buffers must never
    become ``.grad``: fastgrpo.update.cuda_graphs)."""
    cuda_graphs_head: bool = True
    """With cuda_graphs: also replay the policy's (or SFT's) head loss, forward and backward, from CUDA graphs
    captured per padded target-row count (the rows padded with zero-weight rows); false runs the head eagerly."""

    def validate(self, p: str) -> None:
        check(all(isinstance(b, int) and b >= 2 for b in self.token_buckets), f"{p}.token_buckets",
              f"every bucket must be a token count >= 2, got {self.token_buckets}")
        check(not (self.cuda_graphs and self.activation_checkpointing), f"{p}.cuda_graphs",
              "does not combine with parallel.activation_checkpointing (a graph replays the backward it captured)")
        check(not self.master_weights or self.param_dtype != "float32", f"{p}.master_weights",
              "needs parallel.param_dtype bfloat16 (float32 compute weights would be their own masters)")
        check(not (self.master_weights and self.cpu_offload), f"{p}.master_weights",
              "keeps the masters in the optimizer; it does not combine with parallel.cpu_offload")


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
    allow_config_change: bool = False
    """Resume even though a setting that defines the run (data, model, G, loss, lr...; all but those in
    fastgrpo.config.runs.RESUMABLE_KEYS) differs from the run's config.json; the old one is kept as
    config.until_step_<N>.json."""

    def validate(self, p: str) -> None:
        check(self.every >= 0, f"{p}.every", "must be >= 0")
        check(self.keep_last >= 1, f"{p}.keep_last", "must be >= 1")


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
        check(self.every >= -1, f"{p}.every", "must be >= -1")
        check(self.num_prompts >= 1, f"{p}.num_prompts", "must be >= 1")
        check(self.best_of_n >= 1, f"{p}.best_of_n", "must be >= 1")
        check(self.temperature > 0, f"{p}.temperature", "must be > 0")


@dataclass(kw_only=True)
class LogConfig:
    report_to: list[str] = field(default_factory=lambda: ["jsonl"], metadata=registry("fastgrpo.runtime.sinks:SINKS"))
    """Metric sinks besides the progress bar: 'jsonl', 'wandb'."""
    wandb_project: str = "fastgrpo"
    """wandb project name."""
    completions_per_step: int = 4
    """Completions sampled into completions.jsonl each step."""
    progress: bool = True
    """Show a progress bar (rank 0 only)."""

    def validate(self, p: str) -> None:
        check(self.completions_per_step >= 0, f"{p}.completions_per_step", "must be >= 0")
