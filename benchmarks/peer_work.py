"""The work both trainers do in benchmarks/bench_trl.py, and the configs that give it to each of them.

No TRL import here (tests check the two configs without TRL installed). One spec (a dict: the Work fields,
paths, device, engine) -> ``fastgrpo_config`` (a fastgrpo.train YAML tree) and ``trl_config`` (GRPOConfig
keyword arguments); ``settings_of_fastgrpo`` / ``settings_of_trl`` read both back under common names, so a
test can assert that they ask for the same GRPO run.

Inputs: ``build_model_folder`` (a no-EOS copy of the tiny model, a random model of a given shape, or a local
folder; see ``suppress_eos``) and ``write_prompts`` (Countdown prompts rendered once, all of one token length).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import yaml

HERE = Path(__file__).resolve()

# Random-weight shapes (nothing downloaded); the tokenizer is the embedded tiny one (byte level), so a model
# with Qwen2.5's vocabulary also samples ids past the tokenizer's: they decode to nothing on both sides.
SHAPES = {
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "108m": dict(hidden_size=512, intermediate_size=2048, num_hidden_layers=8, num_attention_heads=8,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
}
# Qwen2.5-0.5B's widths and vocabulary with fewer layers: the same head and sampler work, a fraction of the trunk's.
SHAPES |= {f"qwen2.5-0.5b-{n}l": {**SHAPES["qwen2.5-0.5b"], "num_hidden_layers": n} for n in (2, 4)}


@dataclass(frozen=True, kw_only=True)
class Work:
    """One side-by-side workload."""

    model: str
    """'tiny' (fastgrpo.models.tiny), a SHAPES key (random weights, built here), a named model source of
    fastgrpo.models.loading (a real pretrained model, e.g. 'smollm2-135m-instruct'), or a local model folder."""
    prompts_per_step: int
    """B: prompts per optimizer step."""
    generations: int = 8
    """G: completions per prompt."""
    max_completion_length: int
    """L: every completion has exactly this many tokens (the model never emits EOS)."""
    warmup: int = 1
    """Steps run first and discarded."""
    steps: int = 2
    """Measured steps per run (median per run)."""
    system_prompt_tokens: int = 0
    """A few-shot system prompt of about this many tokens, the same for every prompt (0: none): the long shared
    prefix of a work where a group's prompt dominates its tokens."""


WORKS = {
    # 2 x 8 sequences of 64 new tokens: three alternated pairs fit a few minutes on a shared 2-core CPU.
    "tiny": Work(model="tiny", prompts_per_step=2, max_completion_length=64),
    "108m-shape": Work(model="108m", prompts_per_step=2, max_completion_length=32),
    # One prompt per step and one measured step: a 0.5B float32 step takes minutes on the 2-core CPU.
    "qwen0.5b-shape": Work(model="qwen2.5-0.5b", prompts_per_step=1, max_completion_length=32, steps=1),
    "qwen0.5b-2l-shape": Work(model="qwen2.5-0.5b-2l", prompts_per_step=1, max_completion_length=32),
    "qwen0.5b-4l-shape": Work(model="qwen2.5-0.5b-4l", prompts_per_step=1, max_completion_length=32),
    # A real pretrained model: SmolLM2-135M-Instruct, full fine-tuning in float32 like the works above;
    # its real tokenizer and chat template render the same Countdown prompts. Two measured steps of 2 x 8 x 32.
    "smollm2": Work(model="smollm2-135m-instruct", prompts_per_step=2, max_completion_length=32),
    # A real Qwen2 model: Qwen2.5-Coder-0.5B-Instruct (the qwen2 extra), its 151,936-token vocabulary where TRL
    # builds [tokens x V] logits; one prompt and one measured step, as the 0.5B shape above.
    "qwen0.5b-real": Work(model="qwen2.5-coder-0.5b-instruct", prompts_per_step=1, max_completion_length=32, steps=1),
    # A long shared prompt: a ~512-token few-shot system prompt before each Countdown question, G 8, 64 new tokens;
    # ~90% of an unshared update's tokens are the prompt's repeats.
    "long-prompt": Work(model="tiny", prompts_per_step=2, max_completion_length=64, system_prompt_tokens=512),
    "smollm2-long-prompt": Work(model="smollm2-135m-instruct", prompts_per_step=2, max_completion_length=64,
                                system_prompt_tokens=512),
    # The same long prompt at Qwen2.5-0.5B's shapes (the 0.5B work's model folder), for a GPU: a trunk of a real
    # model's widths over the prompt's repeats, which is what sharing saves.
    "qwen0.5b-long-prompt": Work(model="qwen2.5-0.5b", prompts_per_step=2, max_completion_length=64,
                                 system_prompt_tokens=512),
}


def few_shot_system_prompt(tok, tokens: int, *, seed: int = 0) -> str:
    """An instruction and solved Countdown examples, as many as keep the rendered text at or under ``tokens``
    tokens of ``tok`` (deterministic in ``seed``); '' for 0."""
    if tokens <= 0:
        return ""
    from fastgrpo.data import countdown_splits
    from fastgrpo.data.countdown import solve

    text = ("You solve Countdown puzzles: combine the given numbers with +, -, * and / (each number once) to reach "
            "the target. Think briefly, then give the expression in <answer></answer>. Solved examples:")
    rows, _ = countdown_splits(num_train=256, num_eval=0, seed=seed + 1, min_numbers=3, max_numbers=4, max_value=99)
    for row in rows:
        expr = solve(row["nums"], row["target"])
        if expr is None:
            continue
        longer = f"{text}\nNumbers {row['nums']}, target {row['target']}: <answer>{expr}</answer>"
        if len(tok(longer, add_special_tokens=False)["input_ids"]) > tokens:
            break
        text = longer
    return text


SHARED = dict(temperature=1.0, top_p=1.0, beta=0.0, loss_type="dr_grpo", scale_rewards="group", epsilon=0.2,
              lr=1e-6, adam_betas=(0.9, 0.99), weight_decay=0.0, max_grad_norm=1.0, attn="sdpa",
              num_iterations=1, rewards=("format", "countdown"), system_prompt="", template="chat")
"""GRPO settings both sides get (the one source: both config builders read it)."""

FASTGRPO_ATTN = {"sdpa": "auto"}
"""fastgrpo's name for TRL's attention choice: each side's own way of running it, what its users get by default.
TRL runs torch's sdpa on padded rows. fastgrpo packs its micro-batches, and its ``"sdpa"`` would give sdpa one dense
``[T, T]`` block-causal mask per packed row (T = every token of the micro-batch, 5,376 on the tiny work), which
sdpa's CPU kernel computes in full. Its ``"auto"`` resolves, on CPU, to ``"sdpa_varlen"`` (the same sdpa with
``is_causal``, once per sequence) and, on CUDA without flash-attn, to ``"torch_varlen"`` (torch's FlashAttention
varlen kernel over the packed row; ``fastgrpo.models.attention.choose_attn_implementation``). bench_trl records the name it
resolved to per run, and ``--fastgrpo-attn`` (spec key ``fastgrpo_attn``) names another."""


def spread_reward(completions, completion_ids, **_):
    """(sum of the completion's token ids mod 101) / 100: deterministic, and it differs between the samples of
    a group (a random model scores 0 on Countdown, and a zero advantage lets a trainer skip work)."""
    return [(sum(ids) % 101) / 100.0 for ids in completion_ids]


# -- the two configs, from one spec ----------------------------------------------------------------------------


def fastgrpo_config(spec: dict) -> dict:
    """The config tree for ``python -m fastgrpo.train --config`` (YAML), with the spec's ``fastgrpo_set`` overrides
    (dotted ``KEY=VALUE``, values read as YAML) applied."""
    tree = _fastgrpo_tree(spec)
    for item in spec.get("fastgrpo_set", []):
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--fastgrpo-set: {item!r} is not KEY=VALUE")
        *path, last = key.split(".")
        node = tree
        for part in path:
            node = node.setdefault(part, {})
        node[last] = yaml.safe_load(value)
    return tree


def _fastgrpo_tree(spec: dict) -> dict:
    s, cuda = spec["shared"], spec["device"] == "cuda"
    S = spec["prompts_per_step"] * spec["generations"]
    rollout = {"engine": spec["engine"], "max_completion_length": spec["max_completion_length"],
               "temperature": s["temperature"], "top_p": s["top_p"],
               "hf": {"batch_size": S}}  # one generate call, as TRL
    if spec["engine"] == "vllm":
        rollout["vllm"] = {"enforce_eager": not cuda, "sleep_level": 1 if cuda else 0, "gpu_memory_utilization": 0.3}
    model = {"name_or_path": spec["model_dir"], "dtype": "auto" if cuda else "float32",
             "attn_implementation": spec.get("fastgrpo_attn") or FASTGRPO_ATTN.get(s["attn"], s["attn"])}
    if spec.get("lora_rank"):
        model["lora"] = {"rank": spec["lora_rank"], "alpha": float(2 * spec["lora_rank"])}
    return {
        "name": "fastgrpo", "output_dir": spec["run_dir"], "max_steps": spec["warmup"] + spec["steps"],
        "seed": spec["seed"], "device": spec["device"],
        "model": model,
        "data": {"source": spec["prompts_file"], "template": s["template"], "system_prompt": s["system_prompt"],
                 "num_eval": 1},
        "rewards": {"funcs": [*s["rewards"], f"{HERE}:spread_reward"], **_in_process_rewards()},
        "rollout": rollout,
        "grpo": {"prompts_per_step": spec["prompts_per_step"], "num_generations": spec["generations"],
                 "loss_type": s["loss_type"], "scale_rewards": s["scale_rewards"], "beta": s["beta"],
                 "epsilon_low": s["epsilon"], "epsilon_high": s["epsilon"], "num_iterations": s["num_iterations"]},
        "optim": {"lr": s["lr"], "weight_decay": s["weight_decay"], "betas": list(s["adam_betas"]),
                  "warmup_steps": 0, "schedule": "constant", "max_grad_norm": s["max_grad_norm"]},
        "checkpoint": {"export_hf": False, "resume": "never"},
        "eval": {"every": -1},
        "log": {"report_to": ["jsonl"], "progress": False, "completions_per_step": 0},
    }


def _in_process_rewards() -> dict:
    """TRL calls reward functions in its own process; fastgrpo versions with a reward sandbox run plugin files in
    worker processes unless ``rewards.sandbox`` is false. Same work: in process on both sides."""
    import dataclasses

    from fastgrpo.config import RewardConfig

    return {"sandbox": False} if "sandbox" in {f.name for f in dataclasses.fields(RewardConfig)} else {}


def trl_config(spec: dict) -> dict:
    """Keyword arguments of ``trl.GRPOConfig``: one optimizer step per rollout batch of S completions, in
    micro-batches of ``trl_micro_batch`` sequences (TRL's default 8)."""
    s, cuda = spec["shared"], spec["device"] == "cuda"
    S, mb = spec["prompts_per_step"] * spec["generations"], spec["trl_micro_batch"]
    if S % mb:
        raise ValueError(f"--trl-micro-batch: {mb} must divide B*G = {S}")
    kwargs = dict(
        output_dir=spec["run_dir"], max_steps=spec["warmup"] + spec["steps"], seed=spec["seed"],
        per_device_train_batch_size=mb, gradient_accumulation_steps=S // mb, num_generations=spec["generations"],
        max_completion_length=spec["max_completion_length"], temperature=s["temperature"], top_p=s["top_p"],
        top_k=0, learning_rate=s["lr"], lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=s["weight_decay"], adam_beta1=s["adam_betas"][0], adam_beta2=s["adam_betas"][1],
        max_grad_norm=s["max_grad_norm"], beta=s["beta"], loss_type=s["loss_type"],
        scale_rewards=s["scale_rewards"], epsilon=s["epsilon"], num_iterations=s["num_iterations"],
        # TRL defaults differ from fastgrpo's: gradient checkpointing on (recomputes the trunk) and bf16 on.
        gradient_checkpointing=False, bf16=cuda, use_cpu=not cuda,
        model_init_kwargs={"dtype": "float32", "attn_implementation": s["attn"]},
        report_to="none", logging_steps=1, save_strategy="no", disable_tqdm=True, log_completions=False,
        dataloader_num_workers=0,
    )
    if spec["engine"] == "vllm":
        kwargs |= dict(use_vllm=True, vllm_mode="colocate", vllm_enable_sleep_mode=False,
                       vllm_gpu_memory_utilization=0.3)
    return kwargs


def trl_lora_config(spec: dict) -> dict | None:
    """Keyword arguments of ``peft.LoraConfig`` for TRL's ``peft_config`` when the spec asks for LoRA
    (``lora_rank``), else None: fastgrpo's ``model.lora`` defaults (alpha 2r, no dropout, every linear layer but
    lm_head)."""
    rank = spec.get("lora_rank") or 0
    if not rank:
        return None
    return dict(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")


def settings_of_fastgrpo(tree: dict) -> dict:
    """The GRPO settings a fastgrpo config tree encodes, under common names (for the equality test)."""
    g, r, o = tree["grpo"], tree["rollout"], tree["optim"]
    lora = tree["model"].get("lora") or {}
    return dict(lora=(lora.get("rank", 0), lora.get("alpha") or 2 * lora.get("rank", 0), lora.get("dropout", 0.0),
                      "all-linear" if lora.get("target_modules", ["all-linear"]) == ["all-linear"]
                      else tuple(lora["target_modules"])) if lora.get("rank") else None,
                generations=g["num_generations"], sequences_per_step=g["prompts_per_step"] * g["num_generations"],
                max_completion_length=r["max_completion_length"], temperature=r["temperature"], top_p=r["top_p"],
                beta=g["beta"], loss_type=g["loss_type"], scale_rewards=g["scale_rewards"],
                epsilon=(g["epsilon_low"], g["epsilon_high"]), num_iterations=g["num_iterations"], lr=o["lr"],
                betas=tuple(o["betas"]), weight_decay=o["weight_decay"], max_grad_norm=o["max_grad_norm"],
                schedule=o["schedule"], warmup=o["warmup_steps"],
                attn={v: k for k, v in FASTGRPO_ATTN.items()}.get(tree["model"]["attn_implementation"],
                                                                   tree["model"]["attn_implementation"]),
                steps=tree["max_steps"], vllm=r["engine"] == "vllm")


def settings_of_trl(kw: dict, peft: dict | None = None) -> dict:
    """The same settings from GRPOConfig keyword arguments (or a GRPOConfig's attributes) and the ``peft_config``
    keyword arguments (``trl_lora_config``; None: full fine-tuning)."""
    eps_high = kw.get("epsilon_high") if kw.get("epsilon_high") is not None else kw["epsilon"]
    return dict(lora=(peft["r"], peft["lora_alpha"], peft["lora_dropout"], peft["target_modules"]) if peft else None,
                generations=kw["num_generations"],
                sequences_per_step=kw["per_device_train_batch_size"] * kw["gradient_accumulation_steps"],
                max_completion_length=kw["max_completion_length"], temperature=kw["temperature"],
                top_p=kw["top_p"], beta=kw["beta"], loss_type=kw["loss_type"], scale_rewards=kw["scale_rewards"],
                epsilon=(kw["epsilon"], eps_high), num_iterations=kw["num_iterations"], lr=kw["learning_rate"],
                betas=(kw["adam_beta1"], kw["adam_beta2"]), weight_decay=kw["weight_decay"],
                max_grad_norm=kw["max_grad_norm"], schedule=str(kw["lr_scheduler_type"]).split(".")[-1].lower(),
                warmup=kw["warmup_steps"], attn=kw["model_init_kwargs"]["attn_implementation"],
                steps=kw["max_steps"], vllm=bool(kw.get("use_vllm", False)))


# -- inputs: model folder and prompt file ----------------------------------------------------------------------


def suppress_eos(model, eos_ids: list[int], *, dim: int = 0, margin: float = 10.0,
                 final_norm_gain: float | None = None) -> None:
    """Edit a decoder so that no EOS id can be sampled, at unchanged cost: residual channel ``dim`` becomes a
    constant (1 in every embedding row, -margin in the EOS rows; no layer writes to it), so after the final norm
    it is a large positive feature and each EOS logit sits about (1 + margin) * that feature below the others.

    The final norm divides the channel by the residual stream's RMS: about 1 in a random model, but about 25 in
    SmolLM2-135M-Instruct, where the feature came out at 0.07 and EOS kept a probability of 0.9. ``final_norm_gain``
    sets the final norm's weight on ``dim`` (pretrained models: 100). It shifts every other logit by the same amount,
    which softmax ignores."""
    import torch

    with torch.no_grad():
        if final_norm_gain is not None:
            model.model.norm.weight[dim] = final_norm_gain
        for table in {id(t): t for t in (model.get_input_embeddings().weight,
                                         model.get_output_embeddings().weight)}.values():
            table[:, dim] = 1.0
            table[eos_ids, dim] = -margin
        for layer in model.model.layers:
            for proj in (layer.self_attn.o_proj, layer.mlp.down_proj):  # the two writers of the residual stream
                proj.weight[dim, :] = 0.0
                if proj.bias is not None:
                    proj.bias[dim] = 0.0


def eos_ids_of(folder: Path) -> list[int]:
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    ids = set()
    sources = [AutoConfig.from_pretrained(folder).eos_token_id, AutoTokenizer.from_pretrained(folder).eos_token_id]
    try:
        sources.append(GenerationConfig.from_pretrained(folder).eos_token_id)
    except OSError:
        pass
    for src in sources:
        if src is not None:
            ids.update([src] if isinstance(src, int) else src)
    return sorted(ids)


PRETRAINED_NORM_GAIN = 100.0
"""suppress_eos's final_norm_gain for a pretrained model (SmolLM2-135M: residual RMS ~25, so the EOS logits sit ~44
below the others)."""


MAX_EOS_PROBABILITY = 1e-6
"""The most probability a built model may give an EOS id at a prompt position: a work's completions must all run
their full length, B * G * L draws per step without one EOS."""

CHECK_PROMPTS = 4
"""The work's prompts (the first of :func:`write_prompts`' rows) that a build's check forwards."""

_CHECKED = "peer_work_checked.json"
"""Written into a model folder once its build passed :func:`check_built_model`; a folder without it is rebuilt."""


def build_model_folder(model: str, dest: Path, *, seed: int) -> Path:
    """A no-EOS copy of ``model`` in ``dest``, built once and reused while present; put in place only after
    :func:`check_built_model` passed (ValueError otherwise, and nothing is cached)."""
    if (dest / _CHECKED).is_file():
        return dest
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from fastgrpo.models.tiny import build_tiny

    tiny = build_tiny(seed=seed)
    src = tiny if model in ("tiny", *SHAPES) else model_source(model)
    # a folder of this build's own: two processes building the same model (bench_trl and count_ops on one cache)
    # must not write into each other's files
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{dest.name}.", suffix=".tmp", dir=dest.parent))
    shutil.copytree(src, tmp, dirs_exist_ok=True, ignore=shutil.ignore_patterns("*.safetensors", "*.bin", "*.index.json", "config.json"))
    if model in SHAPES:
        base = json.loads((tiny / "config.json").read_text())
        ids = {k: base[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
        torch.manual_seed(seed)
        net = AutoModelForCausalLM.from_config(Qwen2Config(max_position_embeddings=4096, **SHAPES[model], **ids),
                                               dtype=torch.float32)
    else:
        net = AutoModelForCausalLM.from_pretrained(src, dtype="auto")
    suppress_eos(net, eos_ids_of(src), final_norm_gain=None if model in ("tiny", *SHAPES) else PRETRAINED_NORM_GAIN)
    net.save_pretrained(tmp)
    try:
        report = check_built_model(tmp, seed=seed)
    except ValueError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ValueError(f"{model} (seed {seed}): {e}; nothing was cached at {dest}") from None
    (tmp / _CHECKED).write_text(json.dumps(report) + "\n")
    if (dest / _CHECKED).is_file():  # another process finished the same build first: keep its folder
        shutil.rmtree(tmp, ignore_errors=True)
        return dest
    shutil.rmtree(dest, ignore_errors=True)  # an unchecked folder of an earlier build
    try:
        tmp.rename(dest)
    except OSError:  # another build renamed its folder in between
        shutil.rmtree(tmp, ignore_errors=True)
        if not (dest / _CHECKED).is_file():
            raise
    return dest


def check_built_model(folder: Path, *, seed: int) -> dict:
    """The checks a no-EOS build passes before it is cached: every weight finite, and a float32 forward over the
    work's first :data:`CHECK_PROMPTS` prompts (``write_prompts``' rows for ``seed``) with finite logits at every
    position and no EOS id above :data:`MAX_EOS_PROBABILITY`. Returns what was checked; ValueError (one line)
    naming the first failure."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    net = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    for name, tensor in net.state_dict().items():
        if not torch.isfinite(tensor).all():
            raise ValueError(f"the weight {name} holds {int((~torch.isfinite(tensor)).sum())} non-finite values")
    tok = AutoTokenizer.from_pretrained(folder)
    rows, _ = _work_prompts(tok, count=CHECK_PROMPTS, seed=seed)
    worst = max(_eos_probability(net, tok, row["prompt"], eos_ids_of(folder), prompt=i) for i, row in enumerate(rows))
    if worst > MAX_EOS_PROBABILITY:
        raise ValueError(f"an EOS id keeps probability {worst:.3g} at a prompt position (the work needs at most "
                         f"{MAX_EOS_PROBABILITY:g}: its completions never end)")
    return {"seed": seed, "prompts": len(rows), "max_eos_probability": worst}


def _eos_probability(net, tok, conversation: list[dict], eos: list[int], *, prompt: int = 0) -> float:
    """The largest probability ``net`` gives an EOS id at the positions of one rendered prompt whose input is not
    itself an EOS id (after an EOS input the edited channel is negative, but generation never feeds one);
    ValueError when a logit there is not finite."""
    import torch

    ids = torch.tensor([tok(render_conversation(tok, conversation))["input_ids"]])  # [1, P]
    with torch.no_grad():
        logits = net(input_ids=ids).logits.float()[0]  # [P, V]
    if not torch.isfinite(logits.sum(-1)).all():  # one pass over [P, V]; the element pass only on failure
        bad = (~torch.isfinite(logits)).nonzero()
        where = (f"token {int(bad[0, 1])} at position {int(bad[0, 0])} of {ids.shape[1]}: "
                 f"{logits[bad[0, 0], bad[0, 1]].item()}" if len(bad) else "finite, but their sum overflows float32")
        raise ValueError(f"the logits of prompt {prompt} are not finite ({where})")
    eos_logp = logits[:, eos] - logits.logsumexp(-1, keepdim=True)  # [P, E], without a [P, V] softmax
    return eos_logp[~torch.isin(ids[0], torch.tensor(eos))].max().exp().item()


def model_source(model: str) -> Path:
    """The local folder of a model that is neither tiny nor a SHAPES key, resolved as the trainer resolves
    model.name_or_path: a named source or a .gguf file (converted on first use, cached), or a folder as given."""
    from fastgrpo.config import ModelConfig
    from fastgrpo.models.loading import resolve_model_path

    return Path(resolve_model_path(ModelConfig(name_or_path=model)))


def _conversation(row: dict, system_prompt: str = "") -> list[dict]:
    """The chat messages of a Countdown row: fastgrpo's user message (and system prompt, when set)."""
    from fastgrpo.data.templates import countdown_user_message

    system_prompt = system_prompt or SHARED["system_prompt"]
    system = [{"role": "system", "content": system_prompt}] if system_prompt else []
    return system + [{"role": "user", "content": countdown_user_message(row)}]


def write_prompts(model_dir: Path, path: Path, *, count: int, seed: int, system_prompt: str = "") -> int:
    """Countdown rows whose rendered prompt (the chat template, assistant turn opened) has the most common token
    length; writes jsonl rows {prompt, nums, target} and returns that length P.

    ``prompt`` is the conversation: TRL renders it with the tokenizer's chat template, and fastgrpo either does
    the same with a conversation column or (versions that read only ``nums``/``target``) renders the same
    messages from the row, so both sides see identical token ids (checked per step by the bench)."""
    from transformers import AutoTokenizer

    keep, P = _work_prompts(AutoTokenizer.from_pretrained(model_dir), count=count, seed=seed,
                            system_prompt=system_prompt)
    path.write_text("".join(json.dumps(row) + "\n" for row in keep))
    return P


def _work_prompts(tok, *, count: int, seed: int, system_prompt: str = "") -> tuple[list[dict], int]:
    """:func:`write_prompts`' rows and their token length P; the first ``count`` do not depend on ``count``."""
    from collections import Counter

    from fastgrpo.data import countdown_splits

    rows, _ = countdown_splits(num_train=max(count, _PROMPT_POOL) * 8, num_eval=0, seed=seed, min_numbers=3,
                               max_numbers=4, max_value=99)
    convs = [_conversation(r, system_prompt) for r in rows]
    lengths = [len(tok(render_conversation(tok, c))["input_ids"]) for c in convs]
    P = Counter(lengths).most_common(1)[0][0]
    keep = [{"prompt": c, "nums": r["nums"], "target": r["target"]} for c, r, n in zip(convs, rows, lengths) if n == P]
    return keep[:count], P


_PROMPT_POOL = 64
"""Prompts drawn at least, so that the common length P, and the rows kept, are the same for every ``count`` up to it
(the benchmarks write 64)."""


def render_conversation(tok, conversation: list[dict]) -> str:
    return tok.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)


def check_no_eos(model_dir: Path, prompts_file: Path) -> float:
    """Largest probability any EOS id gets at the positions of the file's first prompt (must be ~0; see
    :func:`_eos_probability`)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    net = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    conversation = json.loads(prompts_file.read_text().splitlines()[0])["prompt"]
    return _eos_probability(net, tok, conversation, eos_ids_of(model_dir))


def make_spec(work: Work, *, model_dir, prompts_file, prompt_len: int, device: str = "cpu", engine: str = "hf",
              seed: int = 0, trl_micro_batch: int = 8, steps: int | None = None, warmup: int | None = None,
              run_dir: str = "RUN_DIR") -> dict:
    """The spec both children read (JSON-able)."""
    return {**asdict(work), "steps": steps or work.steps, "warmup": work.warmup if warmup is None else warmup,
            "model_dir": str(model_dir), "prompts_file": str(prompts_file), "prompt_len": prompt_len,
            "sequences": work.prompts_per_step * work.generations, "device": device, "engine": engine,
            "seed": seed, "trl_micro_batch": trl_micro_batch, "shared": SHARED, "run_dir": str(run_dir)}

