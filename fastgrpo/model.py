"""Load a causal LM and its tokenizer; the attention-backend table; the packed forward. No parallelism here
(see parallelize.py).

``ModelConfig.name_or_path`` is one of:
- ``"tiny"`` / ``"tiny:<preset>"`` (e.g. ``"tiny:llama"``): the embedded model, built locally by
  :func:`fastgrpo.tiny.build_tiny` (no hub, no network);
- a local folder in Hugging Face layout (config.json, safetensors, tokenizer files);
- a Hugging Face hub id (``"Qwen/Qwen2.5-0.5B-Instruct"``), downloaded by transformers: needs network, or a
  warm ``HF_HOME`` cache.

Log-probs and losses are computed as ``head_fn(trunk(x)[completion positions], lm_head.weight)`` on one packed
row (:func:`packed_head_forward`), so the lm_head runs on completion tokens only and the fused kernel never
builds ``[tokens x vocab]`` logits. Each attention backend (``ATTN_BACKENDS``) says how it can run, how a packed
row's sequence boundaries reach it, and what the HF rollout engine decodes with.

Legend: N tokens, H hidden size, V vocabulary size.
"""

from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from fastgrpo.config import ModelConfig
from fastgrpo.packing import MicroBatch

__all__ = [
    "ATTN_BACKENDS",
    "AttnBackend",
    "check_plain_head",
    "choose_attn_implementation",
    "count_params",
    "decoding_attn_implementation",
    "get_trunk_and_head",
    "load_model",
    "load_tokenizer",
    "packed_head_forward",
    "packed_hidden_states",
    "preallocated_kv_cache",
    "register_attn_backend",
    "register_with_transformers",
    "resolve_dtype",
    "resolve_model_path",
]

TINY_PREFIX = "tiny"


def _flash_attn_installed() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def _needs_flash_attn(device: torch.device) -> None:
    if not _flash_attn_installed():
        raise ImportError(
            "model.attn_implementation=flash_attention_2 needs the flash-attn package: "
            "pip install fastgrpo[flash-attn]  (or choose 'auto', 'flex_attention' or 'sdpa')")
    if device.type != "cuda":
        raise ValueError(f"model.attn_implementation: flash_attention_2 runs on CUDA only, not on {device.type}")


def _runs_anywhere(device: torch.device) -> None:
    pass


# How a packed row's sequence boundaries reach each backend. transformers (read in 5.19's masking_utils; present
# since 4.53) detects packing from position_ids when attention_mask is None and no KV cache is passed
# (find_packed_sequence_indices), and then builds a block-diagonal causal mask for sdpa/eager/flex. We still pass
# the boundaries explicitly where we can:
# - flash_attention_2: cu_seqlens + max_seqlen go straight to flash_attn_varlen_func; otherwise transformers
#   re-derives them from position_ids in every layer with a device->host sync.
# - sdpa: an explicit [1, 1, T, T] boolean block-causal mask (True = attend). Same mask transformers would
#   build, without the host sync in its packing check and without relying on that check across versions.
# - eager and flex_attention: position_ids only; transformers builds the additive mask / the BlockMask.
# Models with sliding-window layers also use position_ids only: one explicit mask would ignore the window.


def block_causal_mask(mb: MicroBatch) -> torch.Tensor:
    """[1, 1, T, T] bool: token q may attend to token k iff same sequence and k <= q."""
    seg = mb.segment_ids  # [T], already on the device: no host->device copy inside the micro-batch loop
    same = seg[:, None] == seg[None, :]  # [T, T]
    causal = torch.ones(mb.num_tokens, mb.num_tokens, dtype=torch.bool, device=seg.device).tril_()
    return (same & causal)[None, None]


def _sdpa_inputs(mb: MicroBatch) -> dict[str, Any]:
    return {"attention_mask": block_causal_mask(mb)}


def _varlen_inputs(mb: MicroBatch) -> dict[str, Any]:
    return {"cu_seq_lens_q": mb.cu_seqlens, "cu_seq_lens_k": mb.cu_seqlens,
            "max_length_q": mb.max_seqlen, "max_length_k": mb.max_seqlen}


def _position_ids_only(mb: MicroBatch) -> dict[str, Any]:
    return {}


def _sdpa_per_sequence(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                       sliding_window: int | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers attention function of ``"sdpa_varlen"``: causal sdpa on each sequence of a packed row.

    query ``[1, Hq, T, d]``, key / value ``[1, Hkv, T, d]`` -> ``[1, T, Hq, d]``. The boundaries come from
    ``cu_seq_lens_q`` (the packed forward passes them, as for flash-attn varlen). One dense ``[T, T]``
    block-causal mask (what ``"sdpa"`` gets for a packed row) costs ``T^2`` per head and layer, where the
    sequences need ``sum L_i^2``; and sdpa's CPU kernel skips the blocks above the diagonal only with
    ``is_causal``, never for a mask. Without ``cu_seq_lens_q`` (a plain forward) the sequences start where
    ``position_ids`` restart unless a KV cache is in use, as transformers' own packed-sequence detection has it.
    """
    cu = kwargs.get("cu_seq_lens_q")
    if cu is not None:
        bounds = cu.tolist()  # K + 1 host ints: a copy from the device once per layer (free on CPU)
    elif attention_mask is not None or query.shape[2] != key.shape[2]:
        raise ValueError("model.attn_implementation=sdpa_varlen runs packed rows and unpadded sequences only, "
                         "without a KV cache (the rollout engine decodes with sdpa)")
    elif kwargs.get("use_cache"):  # a KV cache: transformers reads no packing from position_ids either
        bounds = [0, query.shape[2]]
    else:
        bounds = _sequence_starts(kwargs.get("position_ids"), query.shape[2])
    gqa = query.shape[1] != key.shape[1]

    def band(n: int) -> torch.Tensor | None:  # sliding-window layers: causal and at most `window` back, [n, n]
        if sliding_window is None or sliding_window >= n:
            return None
        i = torch.arange(n, device=query.device)
        return (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < sliding_window)

    def attend(a: int, b: int) -> torch.Tensor:  # [1, Hq, L_i, d]
        mask = band(b - a)
        return torch.nn.functional.scaled_dot_product_attention(
            query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], attn_mask=mask, dropout_p=dropout,
            is_causal=mask is None, scale=scaling, enable_gqa=gqa)

    outs = [attend(a, b) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)  # [1, Hq, T, d]
    return out.transpose(1, 2).contiguous(), None


def _sequence_starts(position_ids: torch.Tensor | None, length: int) -> list[int]:
    """``[0, starts..., length]``: where ``position_ids [B, T]`` restart (the same in every row)."""
    if position_ids is None or length < 2:
        return [0, length]
    restart = position_ids.diff(dim=-1) != 1  # [B, T - 1]
    if restart.shape[0] > 1 and not bool((restart == restart[:1]).all()):
        raise ValueError("model.attn_implementation=sdpa_varlen: rows of a batch pack sequences at different "
                         "positions; use sdpa")
    return [0, *(restart[0].nonzero().squeeze(1) + 1).tolist(), length]


def _sdpa_varlen_mask(*, q_length: int, kv_length: int, attention_mask: torch.Tensor | None = None, **_) -> None:
    """transformers mask function of ``"sdpa_varlen"``: builds nothing (the attention needs only the boundaries),
    but refuses what per-sequence causal attention would get wrong: padding, and a KV cache (decoding)."""
    if attention_mask is not None and not bool(attention_mask.all()):
        raise ValueError("model.attn_implementation=sdpa_varlen runs packed rows and unpadded sequences only, "
                         "without padding (the rollout engine decodes with sdpa)")
    if q_length != kv_length:
        raise ValueError("model.attn_implementation=sdpa_varlen runs packed rows and unpadded sequences only, "
                         "without a KV cache (the rollout engine decodes with sdpa)")
    return None


def register_with_transformers() -> None:
    """Make fastgrpo's own attention implementations (``"sdpa_varlen"``) known to transformers; idempotent.
    ``load_model`` calls it; call it before building a model from a config with one of them."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register("sdpa_varlen", _sdpa_per_sequence)
    AttentionMaskInterface.register("sdpa_varlen", _sdpa_varlen_mask)


@dataclass(frozen=True, kw_only=True)
class AttnBackend:
    """What fastgrpo needs to know about one transformers attention implementation."""

    check: Callable[[torch.device], None] = _runs_anywhere
    """Raises (ImportError saying what to install, or ValueError) if it cannot run on a device."""
    packed_inputs: Callable[[MicroBatch], dict[str, Any]] = _position_ids_only
    """Extra trunk kwargs that mark the sequence boundaries of a packed row."""
    decode_with: str | None = None
    """Implementation the HF rollout engine decodes with; None = this one."""


ATTN_BACKENDS: dict[str, AttnBackend] = {}
"""Backend name (transformers' attn_implementation, the choices of model.attn_implementation) -> AttnBackend."""


def register_attn_backend(name: str, backend: AttnBackend) -> None:
    """Make ``name`` a valid ``model.attn_implementation`` with the given checks and packed inputs."""
    ATTN_BACKENDS[name] = backend


register_attn_backend("flash_attention_2", AttnBackend(check=_needs_flash_attn, packed_inputs=_varlen_inputs))
# flex's compiled kernels are specialised to shapes and a KV cache changes shape every token: decode with sdpa.
register_attn_backend("flex_attention", AttnBackend(decode_with="sdpa"))
register_attn_backend("sdpa", AttnBackend(packed_inputs=_sdpa_inputs))
# sdpa per sequence of a packed row (see _sdpa_per_sequence): the CPU default; decoding needs sdpa's masks.
register_attn_backend("sdpa_varlen", AttnBackend(packed_inputs=_varlen_inputs, decode_with="sdpa"))
register_attn_backend("eager", AttnBackend())


def choose_attn_implementation(requested: str, device: torch.device | str) -> str:
    """Resolve ``model.attn_implementation`` to a transformers backend name for ``device``.

    'auto' -> flash_attention_2 when flash-attn is installed and the device is CUDA, else flex_attention on
    CUDA, else sdpa_varlen (sdpa per sequence of a packed row: no [T, T] mask). An explicit name is checked (flash_attention_2 without flash-attn raises ImportError
    saying how to install it) and returned unchanged.
    """
    device = torch.device(device)
    if requested == "auto":
        if device.type == "cuda":
            return "flash_attention_2" if _flash_attn_installed() else "flex_attention"
        return "sdpa_varlen"
    if requested not in ATTN_BACKENDS:
        raise ValueError(f"model.attn_implementation: unknown backend {requested!r} "
                         f"(auto, {', '.join(ATTN_BACKENDS)})")
    ATTN_BACKENDS[requested].check(device)
    return requested


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


def resolve_model_path(cfg: ModelConfig, *, seed: int = 0) -> str:
    """'tiny[:preset]' -> the locally built folder (built on first use, ``seed`` picks its weights); 'tiny:<warm>'
    (e.g. 'tiny:countdown') -> the warm-started model of that SFT recipe (:mod:`fastgrpo.warm`: built on first use,
    independent of ``seed``); a path (leading /, ./, ../, ~ or more than one '/') must be an existing folder;
    anything else is a hub id."""
    name = cfg.name_or_path
    if name == TINY_PREFIX or name.startswith(TINY_PREFIX + ":"):
        from fastgrpo.tiny import build_tiny
        from fastgrpo.warm import WARM_RECIPES, build_warm

        preset = name.partition(":")[2] or "default"
        if preset in WARM_RECIPES:
            return str(build_warm(preset))
        return str(build_tiny(seed=seed, preset=preset))
    if _looks_like_local_path(name):
        path = Path(name).expanduser()
        if not path.is_dir():
            raise FileNotFoundError(f"model.name_or_path: local folder {name!r} does not exist")
        return str(path)
    return name


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
    model.eval()  # dropout would make the two forwards differ
    try:
        logits = model(input_ids=ids, use_cache=False).logits.float()  # [1, T, V]
        plain = head(trunk(input_ids=ids, use_cache=False).last_hidden_state).float()
    finally:
        model.train(was_training)
    gap = (logits - plain).abs().max().item()
    if gap > 1e-3 * max(1.0, plain.abs().max().item()):
        raise NotImplementedError(
            f"model.name_or_path: {type(model).__name__}'s logits are not lm_head(decoder(ids)) (they differ by up to "
            f"{gap:.3g}): it post-processes them, and the fused lm_head kernels would train on different log-probs")


def count_params(model: nn.Module, *, trainable_only: bool = False) -> int:
    """Number of parameters, each shared (tied) tensor counted once."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)


def decoding_attn_implementation(impl: str | None) -> str | None:
    """The implementation to decode with (KV cache, one token per step) for a model that trains with ``impl``."""
    backend = ATTN_BACKENDS.get(impl) if impl is not None else None
    if backend is None or backend.decode_with is None:
        return impl
    return backend.decode_with


@functools.lru_cache(maxsize=None)
def _preallocated_layer_class():
    from transformers.cache_utils import DynamicLayer

    class PreallocatedLayer(DynamicLayer):
        """A DynamicLayer whose keys / values live in buffers sized for the whole generation: ``update`` writes the
        new tokens in place and exposes the filled prefix as a view, where DynamicLayer concatenates (a copy of
        the whole cache per layer and token)."""

        def __init__(self, max_length: int):
            super().__init__()
            self.max_length = max_length

        def lazy_initialization(self, key_states, value_states):  # [B, Hkv, T, d] each
            self.dtype, self.device = key_states.dtype, key_states.device
            b, h = key_states.shape[:2]
            self._k = key_states.new_empty(b, h, self.max_length, key_states.shape[-1])
            self._v = value_states.new_empty(b, h, self.max_length, value_states.shape[-1])
            self.keys, self.values = self._k[:, :, :0], self._v[:, :, :0]
            self.is_initialized = True

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            start, end = self.keys.shape[-2], self.keys.shape[-2] + key_states.shape[-2]
            if end > self.max_length:
                raise ValueError(f"preallocated KV cache: {end} tokens do not fit in {self.max_length}")
            self._k[:, :, start:end].copy_(key_states)
            self._v[:, :, start:end].copy_(value_states)
            self.keys, self.values = self._k[:, :, :end], self._v[:, :, :end]
            return self.keys, self.values

    return PreallocatedLayer


def preallocated_kv_cache(model: nn.Module, max_length: int):
    """A transformers KV cache for decoding at most ``max_length`` tokens per row (prompt included), each layer's
    buffers allocated once on first use; attention reads the filled prefix, so a step costs what DynamicCache's
    does minus its concatenation. None (transformers' default cache) for models with sliding-window layers."""
    from transformers.cache_utils import Cache

    cfg = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    layer_types = getattr(cfg, "layer_types", None) or ["full_attention"] * cfg.num_hidden_layers
    if any(t != "full_attention" for t in layer_types):
        return None
    layer = _preallocated_layer_class()
    return Cache(layers=[layer(max_length) for _ in layer_types])


# ----------------------------------------------------------------------------------------------------------------
# The packed forward


def _attention_inputs(config: Any, mb: MicroBatch) -> dict[str, Any]:
    impl = getattr(config, "_attn_implementation", None) or "sdpa"
    layer_types = getattr(config, "layer_types", None) or []
    if any(t != "full_attention" for t in layer_types):
        return {}
    backend = ATTN_BACKENDS.get(impl)
    return backend.packed_inputs(mb) if backend is not None else {}


def packed_hidden_states(trunk: torch.nn.Module, mb: MicroBatch) -> torch.Tensor:
    """Run the decoder trunk on one packed row and return hidden states at completion positions: [N, H].

    trunk is ``model.get_decoder()`` (``model.model`` for Qwen2/Llama). ``use_cache=False`` matters: with a
    cache transformers treats the row as one sequence (its packing detection needs no cache).
    """
    out = trunk(
        input_ids=mb.input_ids,  # [1, T]
        position_ids=mb.position_ids,  # [1, T]
        use_cache=False,
        **{"attention_mask": None, **_attention_inputs(trunk.config, mb)},
    )
    hidden = out.last_hidden_state[0]  # [T, H]
    return hidden.index_select(0, mb.hidden_index)  # [N, H]


def packed_head_forward(model: torch.nn.Module, mb: MicroBatch,
                        head: Callable[[torch.Tensor, torch.Tensor], Any]) -> Any:
    """``head(hidden [N, H], lm_head_weight [V, H])`` on one micro-batch of a causal LM; returns what head returns.

    The loss (e.g. ``fastgrpo.kernels.linear_grpo_loss``) runs inside this call so that, under FSDP2, the
    lm_head weight is the gathered full tensor while it is used: ``parallelize_model`` registers this function
    as an FSDP forward method (``model.packed_forward``). Call ``model.packed_forward(mb, head)`` on a
    parallelized model and this function directly on a plain one.
    """
    trunk, lm_head = get_trunk_and_head(model)  # rejects models whose logits are not hidden @ weight.T
    hidden = packed_hidden_states(trunk, mb)  # [N, H]
    return head(hidden, lm_head.weight)  # weight: [V, H]
