"""The embedded default model: a tiny randomly initialised model and tokenizer, built locally (no hub).

``build_tiny()`` writes an ordinary Hugging Face model folder (config.json, model.safetensors,
generation_config.json, tokenizer.json, tokenizer_config.json) that ``AutoModelForCausalLM``,
``AutoTokenizer`` and vLLM load like any downloaded checkpoint, so every code path of the trainer (and both
rollout engines) runs on a laptop CPU in seconds.

Tokenizer: byte level without merges, i.e. Qwen2's tokenizer pipeline with a vocabulary of the 256 bytes
(token id == byte value): every string round-trips exactly, spaces and non-ASCII included.
Added tokens: ``<|endoftext|>`` (pad), ``<|im_start|>``, ``<|im_end|>`` (EOS of a chat turn) are special
(dropped by ``skip_special_tokens``); ``<think>``, ``</think>``, ``<answer>``, ``</answer>`` are single
*non-special* tokens, so the reward functions still see them in decoded text while the model emits each in
one step (a random model learns the answer format much faster that way). ``len(tokenizer) == vocab_size``
exactly (vLLM checks this).

Weights: drawn from a private ``torch.Generator`` seeded by ``seed``, tensor by tensor in sorted name order,
and written straight to safetensors (config.json by hand): no transformers import, so a build takes well
under a second, the same seed gives bit-identical files on every transformers version, and the trainer's
global RNG stream is left untouched.

Presets (registry ``PRESETS``):
- ``default``: Qwen2 (``Qwen2ForCausalLM``), tied embeddings like Qwen2.5-0.5B..3B, q/k/v biases, GQA.
- ``llama``: Llama (``LlamaForCausalLM``), untied lm_head, no biases: a second architecture for tests that
  must not depend on Qwen2 specifics (packing, trunk/head split with a separate head).
- ``small``: the Qwen2 layout, wider and deeper (hidden 128, 4 layers, ~1M parameters).
- ``medium``: wider again (hidden 256, 8 query and 2 KV heads, 4 layers, ~3.9M parameters): the random base of the
  warm-started Countdown model (``tiny:countdown``, :mod:`fastgrpo.trainers.warm`), still trained in about a minute and a
  half on two CPU cores.

head_dim is 32 in every preset: vLLM's CPU attention backend rejects head sizes below 32.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

from fastgrpo.runtime.files import folder_problem, publish_folder, write_atomic

__all__ = [
    "CHAT_TEMPLATE",
    "EOS_TOKEN",
    "IM_START",
    "PAD_TOKEN",
    "PRESETS",
    "REASONING_TOKENS",
    "SPECIAL_TOKENS",
    "build_tiny",
    "tiny_cache_root",
]

# Bump when the recipe changes (tokenizer, shapes, init): cached folders of an older recipe are then ignored.
_RECIPE_VERSION = "v1"

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
EOS_TOKEN = "<|im_end|>"
SPECIAL_TOKENS = (PAD_TOKEN, IM_START, EOS_TOKEN)
REASONING_TOKENS = ("<think>", "</think>", "<answer>", "</answer>")

# Qwen-style chat template without Qwen's default system message (a random model has no identity to state).
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_MAX_POSITIONS = 2048

# Qwen2's pre-tokenisation regex (public in every Qwen2 tokenizer.json). Without merges it changes no token,
# but it must match for the file to equal what Qwen2Tokenizer rebuilds.
_QWEN2_SPLIT_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# Shape of both presets: hidden 64 = 2 heads x head_dim 32; one KV head (GQA, as in Qwen2.5).
_SHAPE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=32,
    max_position_embeddings=_MAX_POSITIONS,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    initializer_range=0.02,
    hidden_act="silu",
)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (what ``pre_tokenizers.ByteLevel`` uses)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    out, extra = {}, 0
    for b in range(256):
        if b in printable:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return out


def _build_tokenizer():
    """A ``tokenizers.Tokenizer``: Qwen2's byte-level BPE pipeline with no merges (= one token per byte).

    Token id == byte value for ids 0..255, then the added tokens. The pipeline (NFC, Qwen2's split regex,
    ByteLevel) is exactly what transformers' ``Qwen2Tokenizer`` rebuilds from vocab + merges (transformers 5
    forces that class for ``model_type == "qwen2"``), so every loader sees the same tokenizer.
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import BPE

    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    tok = Tokenizer(BPE(vocab=vocab, merges=[], dropout=None, unk_token=None, continuing_subword_prefix="",
                        end_of_word_suffix="", fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_QWEN2_SPLIT_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in REASONING_TOKENS])
    return tok


def _tokenizer_config(tok) -> dict[str, Any]:
    """tokenizer_config.json written by hand (not save_pretrained) so the file is identical across versions."""
    added = {}
    for t in SPECIAL_TOKENS + REASONING_TOKENS:
        added[str(tok.token_to_id(t))] = {
            "content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
            "special": t in SPECIAL_TOKENS,
        }
    return {
        # Qwen2Tokenizer for both presets: transformers 5 picks it for qwen2 regardless, and naming it for
        # llama too means one tokenizer class (and behaviour) everywhere; transformers 4 maps it to the fast
        # class that reads tokenizer.json as is.
        "tokenizer_class": "Qwen2Tokenizer",
        "added_tokens_decoder": added,
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "additional_special_tokens": [IM_START],
        "chat_template": CHAT_TEMPLATE,
        # Cleaning would turn "a ." into "a." and break the exact round-trip the rewards rely on.
        "clean_up_tokenization_spaces": False,
        "model_max_length": _MAX_POSITIONS,
        "add_prefix_space": False,
        "errors": "replace",
    }


# hidden 128 = 4 heads x head_dim 32; MLP 4x.
_SMALL_SHAPE = {**_SHAPE, "hidden_size": 128, "intermediate_size": 512, "num_hidden_layers": 4,
                "num_attention_heads": 4}
_MEDIUM_SHAPE = {**_SHAPE, "hidden_size": 256, "intermediate_size": 1024, "num_hidden_layers": 4,
                 "num_attention_heads": 8, "num_key_value_heads": 2}


def _qwen2_config(vocab_size: int, shape: dict[str, Any] = _SHAPE) -> dict[str, Any]:
    return {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "tie_word_embeddings": True,
            "use_sliding_window": False, "sliding_window": None, "max_window_layers": shape["num_hidden_layers"],
            "attention_dropout": 0.0, "vocab_size": vocab_size, **shape}


def _llama_config(vocab_size: int) -> dict[str, Any]:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "tie_word_embeddings": False,
            "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0, "pretraining_tp": 1,
            "vocab_size": vocab_size, **_SHAPE}


PRESETS: dict[str, Callable[[int], dict[str, Any]]] = {
    "default": _qwen2_config,
    "llama": _llama_config,
    "small": lambda vocab_size: _qwen2_config(vocab_size, _SMALL_SHAPE),
    "medium": lambda vocab_size: _qwen2_config(vocab_size, _MEDIUM_SHAPE),
}
"""preset name -> fn(vocab_size) -> config.json fields of the architecture (special token ids added later)."""


def _param_shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Hugging Face parameter names and shapes of a Qwen2/Llama decoder (the two share the layout).

    Qwen2 differs only by q/k/v biases; a tied lm_head is not stored (transformers ties it on load).
    """
    V, H, I = cfg["vocab_size"], cfg["hidden_size"], cfg["intermediate_size"]
    q_dim = cfg["num_attention_heads"] * cfg["head_dim"]
    kv_dim = cfg["num_key_value_heads"] * cfg["head_dim"]
    qkv_bias = cfg["model_type"] == "qwen2" or cfg.get("attention_bias", False)
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (H,),
            p + "post_attention_layernorm.weight": (H,),
            p + "self_attn.q_proj.weight": (q_dim, H),
            p + "self_attn.k_proj.weight": (kv_dim, H),
            p + "self_attn.v_proj.weight": (kv_dim, H),
            p + "self_attn.o_proj.weight": (H, q_dim),
            p + "mlp.gate_proj.weight": (I, H),
            p + "mlp.up_proj.weight": (I, H),
            p + "mlp.down_proj.weight": (H, I),
        }
        if qkv_bias:
            shapes |= {p + "self_attn.q_proj.bias": (q_dim,), p + "self_attn.k_proj.bias": (kv_dim,),
                       p + "self_attn.v_proj.bias": (kv_dim,)}
    if not cfg["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (V, H)
    return shapes


def _init_weights(shapes: dict[str, tuple[int, ...]], seed: int, std: float) -> dict[str, Any]:
    """Deterministic init from a private generator: N(0, std) for matrices, ones for norms, zeros for biases."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name in sorted(shapes):
        shape = shapes[name]
        if name.endswith("norm.weight"):
            out[name] = torch.ones(shape)
        elif name.endswith(".bias"):
            out[name] = torch.zeros(shape)
        else:
            out[name] = torch.randn(shape, generator=gen) * std
    return out


def tiny_cache_root(cache_dir: str | Path | None = None) -> Path:
    """Where tiny folders live: ``cache_dir``, else ``$FASTGRPO_CACHE``, else ``~/.cache/fastgrpo``."""
    if cache_dir is not None:
        return Path(cache_dir)
    env = os.environ.get("FASTGRPO_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "fastgrpo"


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    write_atomic(path, json.dumps(obj, indent=2) + "\n")


FOLDER_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
"""The files a tiny (or warm) model folder cannot do without: a folder lacking one (or with a truncated
model.safetensors) is rebuilt, never loaded (without tokenizer.json transformers would build a 7-token
tokenizer from the special tokens alone and train on empty prompts)."""


def _write_folder(out: Path, *, seed: int, preset: str) -> None:
    from safetensors.torch import save_file

    tok = _build_tokenizer()
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS + REASONING_TOKENS}
    cfg = PRESETS[preset](tok.get_vocab_size(with_added_tokens=True))
    # Qwen2.5-Instruct's convention: bos = <|endoftext|> (never prepended), eos = <|im_end|>.
    cfg |= {"bos_token_id": ids[PAD_TOKEN], "eos_token_id": ids[EOS_TOKEN], "pad_token_id": ids[PAD_TOKEN],
            "torch_dtype": "float32", "dtype": "float32", "use_cache": True}
    _write_json(out / "config.json", cfg)
    _write_json(out / "generation_config.json", {
        "bos_token_id": ids[PAD_TOKEN], "eos_token_id": [ids[EOS_TOKEN], ids[PAD_TOKEN]],
        "pad_token_id": ids[PAD_TOKEN]})
    save_file(_init_weights(_param_shapes(cfg), seed, cfg["initializer_range"]), str(out / "model.safetensors"),
              metadata={"format": "pt"})
    tok.save(str(out / "tokenizer.json"))
    _write_json(out / "tokenizer_config.json", _tokenizer_config(tok))
    _write_json(out / "special_tokens_map.json",
                {"eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN, "additional_special_tokens": [IM_START]})


def build_tiny(*, seed: int = 0, cache_dir: str | Path | None = None, preset: str = "default") -> Path:
    """Build (once; later calls return the cached folder) the tiny model folder for ``preset`` and ``seed``.

    The folder is ``<root>/tiny-<preset>-seed<seed>-v1`` with root from :func:`tiny_cache_root`. It is built
    in a temporary sibling folder and renamed into place, so concurrent builders (pytest-xdist workers,
    torchrun ranks) never see a half-written folder: the first rename wins and the others discard theirs.
    """
    if preset not in PRESETS:
        raise ValueError(f"preset: unknown tiny preset {preset!r} (known: {', '.join(sorted(PRESETS))})")
    root = tiny_cache_root(cache_dir)
    final = root / f"tiny-{preset}-seed{seed}-{_RECIPE_VERSION}"
    problem = folder_problem(final, FOLDER_FILES)
    if problem is None:
        return final
    if final.exists():
        print(f"[fastgrpo] rebuilding the tiny model: {problem}", file=sys.stderr, flush=True)
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=root))
    try:
        _write_folder(tmp, seed=seed, preset=preset)
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache may be shared
        publish_folder(tmp, final, FOLDER_FILES)  # a concurrent builder that renamed first wins
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final
