"""Attention backends: which transformers attention implementation runs a packed row, how the row's sequence
boundaries reach it, and what the hf rollout engine decodes with (registry ``ATTN_BACKENDS``, the choices of
``model.attn_implementation``); and fastgrpo's own ``"sdpa_varlen"`` (sdpa per sequence of a packed row).

The model loader (:mod:`fastgrpo.models.loading`) asks :func:`choose_attn_implementation` which backend to load a model
with; the packed forward asks :func:`packed_attention_inputs` for the extra trunk arguments of a micro-batch.
"""

from __future__ import annotations

import importlib.util
import inspect
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from fastgrpo.models.packing import MicroBatch
from fastgrpo.models.varlen_op import varlen_attn

__all__ = ["ATTN_BACKENDS", "AttnBackend", "block_causal_mask", "choose_attn_implementation",
           "decoding_attn_implementation", "packed_attention_inputs", "register_attn_backend",
           "register_with_transformers"]


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
# - torch_varlen and sdpa_varlen (fastgrpo's own): cu_seqlens + max_seqlen, as for flash-attn.
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


def _no_padding(mb: MicroBatch) -> torch.Tensor:
    """[1, T] bool, every token real: a stride-0 view of one True. Passing it (instead of no mask) keeps
    transformers from reading the row's packing out of position_ids, a host sync per forward; fastgrpo's own mask
    function (:func:`_sdpa_varlen_mask`) knows the marker and builds nothing."""
    return torch.ones((), dtype=torch.bool, device=mb.input_ids.device).expand(1, mb.num_tokens)


def _own_varlen_inputs(mb: MicroBatch) -> dict[str, Any]:
    # fastgrpo's varlen backends: the boundaries also as host ints, from the packing plan (no device-to-host copy
    # per layer in sdpa_varlen), and the no-padding marker
    bounds = [0]
    for length in mb.segment_lengths:  # the sequences, then a padded row's dummy segments
        bounds.append(bounds[-1] + length)
    return {**_varlen_inputs(mb), "sequence_bounds": bounds, "attention_mask": _no_padding(mb)}


def _op_varlen_inputs(mb: MicroBatch) -> dict[str, Any]:
    # "varlen_op": the boundaries as a device tensor only (host ints would be guarded values in a compiled block)
    return {**_varlen_inputs(mb), "attention_mask": _no_padding(mb)}


def _position_ids_only(mb: MicroBatch) -> dict[str, Any]:
    return {}


def _sdpa_per_sequence(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                       sliding_window: int | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers attention function of ``"sdpa_varlen"``: causal sdpa on each sequence of a packed row.

    query ``[1, Hq, T, d]``, key / value ``[1, Hkv, T, d]`` -> ``[1, T, Hq, d]``. The boundaries come from
    ``sequence_bounds`` (host ints the packed forward passes beside ``cu_seq_lens_q``), else from ``cu_seq_lens_q``. One dense ``[T, T]``
    block-causal mask (what ``"sdpa"`` gets for a packed row) costs ``T^2`` per head and layer, where the
    sequences need ``sum L_i^2``; and sdpa's CPU kernel skips the blocks above the diagonal only with
    ``is_causal``, never for a mask. Without ``cu_seq_lens_q`` (a plain forward) the sequences start where
    ``position_ids`` restart unless a KV cache is in use, as transformers' own packed-sequence detection has it.
    """
    cu = kwargs.get("cu_seq_lens_q")
    if kwargs.get("sequence_bounds") is not None:  # the packed forward's host copy of cu_seq_lens_q
        bounds = kwargs["sequence_bounds"]
    elif cu is not None:
        bounds = cu.tolist()  # K + 1 host ints: a copy from the device (a host sync on an accelerator)
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

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:  # [1, Hq, L_i, d]
        mask = band(q.shape[2])
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=mask is None, scale=scaling, enable_gqa=gqa)

    # One split per tensor, not a slice per sequence: a split's backward is one concatenation, where each slice's
    # backward writes its gradient into a fresh zero tensor of the whole row (3 K zero-fills and adds per layer).
    lengths = [b - a for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
    parts = zip(*(t.split(lengths, dim=2) for t in (query, key, value)))
    outs = [attend(q, k, v) for q, k, v in parts]
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


# torch's FlashAttention varlen op and its keyword names, looked up once here: inside a compiled block's trace both
# lookups are graph breaks on torch 2.11 (dynamo does not trace importlib's find_spec: "Attempted to call function
# marked as skipped", the first H100 run of issue 38) and would cost a signature parse per layer otherwise.
_TORCH_VARLEN = importlib.util.find_spec("torch.nn.attention.varlen") is not None
_VARLEN_FN: Callable | None = None
_VARLEN_PARAMS: tuple[str, ...] = ()
if _TORCH_VARLEN:
    from torch.nn.attention.varlen import varlen_attn as _VARLEN_FN

    _VARLEN_PARAMS = tuple(inspect.signature(_VARLEN_FN).parameters)  # a tuple: constant to dynamo in every version


def _torch_varlen_available() -> bool:
    """torch ships FlashAttention's varlen kernel as ``torch.nn.attention.varlen.varlen_attn`` (torch >= 2.10)."""
    return _TORCH_VARLEN


def _needs_torch_varlen(device: torch.device) -> None:
    if not _torch_varlen_available():
        raise ImportError(f"model.attn_implementation=torch_varlen needs torch.nn.attention.varlen (torch >= 2.10); "
                          f"this is torch {torch.__version__}: choose 'auto' or 'sdpa_varlen'")
    if device.type != "cuda":
        raise ValueError(f"model.attn_implementation: torch_varlen runs on CUDA only, not on {device.type}")


def _varlen_call_options(varlen_attn: Callable, window: int | None, gqa: bool) -> dict[str, Any]:
    """Keyword arguments for causal attention across torch versions: 2.10-2.11 take ``is_causal``, later ones a
    ``window_size`` ((-1, 0) = causal); GQA is native where ``enable_gqa`` exists (else the caller repeats kv)."""
    params = _VARLEN_PARAMS if varlen_attn is _VARLEN_FN else inspect.signature(varlen_attn).parameters
    options: dict[str, Any] = {}
    if "window_size" in params:
        options["window_size"] = (-1 if window is None else window - 1, 0)
    else:
        options["is_causal"] = True
    if gqa and "enable_gqa" in params:
        options["enable_gqa"] = True
    return options


def _torch_varlen(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                  sliding_window: int | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers attention function of ``"torch_varlen"``: a packed row through torch's own FlashAttention
    varlen kernel, one launch per layer whatever the number of sequences, with no host sync (the boundaries stay
    on the device as ``cu_seq_lens_q`` int32, the longest length is a host int from the packing plan).

    query ``[1, Hq, T, d]``, key / value ``[1, Hkv, T, d]`` -> ``[1, T, Hq, d]``. FlashAttention computes in
    bfloat16 / float16 only: a float32 forward, or one without the packed row's boundaries (a plain forward,
    e.g. the head probe), runs :func:`_sdpa_per_sequence` instead, which gives the same causal attention.
    """
    cu = kwargs.get("cu_seq_lens_q")
    device_type = query.device.type
    if query.dtype == torch.float32 and torch.is_autocast_enabled(device_type):
        # Under autocast (one plain GPU, float32 masters) q and k leave the rotary embedding in float32 (its cos/sin
        # follow the float32 residual stream); sdpa would cast them to the autocast dtype itself, so do the same.
        dtype = torch.get_autocast_dtype(device_type)
        query, key, value = (t.to(dtype) for t in (query, key, value))
    if cu is None or query.dtype not in (torch.bfloat16, torch.float16) or dropout:
        return _sdpa_per_sequence(module, query, key, value, attention_mask, dropout, scaling, sliding_window,
                                  **kwargs)
    from torch.nn.attention.varlen import varlen_attn

    gqa = query.shape[1] != key.shape[1]
    options = _varlen_call_options(varlen_attn, sliding_window, gqa)
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [T, H, d]
    if gqa and "enable_gqa" not in options:
        k, v = (t.repeat_interleave(query.shape[1] // key.shape[1], dim=1) for t in (k, v))
    max_len = int(kwargs["max_length_q"])
    out = varlen_attn(q, k, v, cu, cu, max_len, max_len, scale=scaling, **options)  # [T, Hq, d]
    return out[None], None


def _varlen_op(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
               sliding_window: int | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers attention function of ``"varlen_op"``, the backend of compiled blocks: one traceable node per
    layer whatever the row's boundaries, no host value in the graph. query ``[1, Hq, T, d]``, key / value
    ``[1, Hkv, T, d]`` -> ``[1, T, Hq, d]``. On CUDA in bfloat16/float16 (torch >= 2.10) torch's FlashAttention
    varlen op (as ``"torch_varlen"``); elsewhere ``torch.ops.fastgrpo.varlen_attn`` (:mod:`fastgrpo.models.varlen_op`).
    Needs the packed row's ``cu_seq_lens_q`` (``packed_attention_inputs``): no padding, KV cache or sliding window."""
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None or dropout or sliding_window is not None:
        raise ValueError("model.attn_implementation=varlen_op runs packed rows only (cu_seq_lens_q), without "
                         "dropout or sliding-window layers")
    device_type = query.device.type
    if torch.is_autocast_enabled(device_type):
        # Under autocast q and k leave the rotary embedding in float32 and v its projection in bf16: cast all three
        # to the autocast dtype (as sdpa does itself) before choosing, so that CUDA takes FlashAttention's op
        dtype = torch.get_autocast_dtype(device_type)
        query, key, value = (t.to(dtype) for t in (query, key, value))
    if device_type == "cuda" and query.dtype in (torch.bfloat16, torch.float16) and _torch_varlen_available():
        return _torch_varlen(module, query, key, value, attention_mask, dropout, scaling, sliding_window, **kwargs)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [T, H, d]
    out = varlen_attn(q, k, v, cu, int(kwargs["max_length_q"]), float(scale))  # [T, Hq, d]
    return out[None], None


def _sdpa_varlen_mask(*, q_length: int, kv_length: int, attention_mask: torch.Tensor | None = None, **_) -> None:
    """transformers mask function of ``"sdpa_varlen"``: builds nothing (the attention needs only the boundaries),
    but refuses what per-sequence causal attention would get wrong: padding, and a KV cache (decoding)."""
    no_padding = attention_mask is None or (attention_mask.dim() == 2 and attention_mask.stride() == (0, 0))
    if not no_padding and not bool(attention_mask.all()):
        raise ValueError("model.attn_implementation=sdpa_varlen runs packed rows and unpadded sequences only, "
                         "without padding (the rollout engine decodes with sdpa)")
    if q_length != kv_length:
        raise ValueError("model.attn_implementation=sdpa_varlen runs packed rows and unpadded sequences only, "
                         "without a KV cache (the rollout engine decodes with sdpa)")
    return None


def register_with_transformers() -> None:
    """Make fastgrpo's own attention implementations (``"sdpa_varlen"``, ``"torch_varlen"``, ``"varlen_op"``) known to
    transformers; idempotent.
    ``load_model`` calls it; call it before building a model from a config with one of them."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register("sdpa_varlen", _sdpa_per_sequence)
    AttentionMaskInterface.register("sdpa_varlen", _sdpa_varlen_mask)
    AttentionInterface.register("torch_varlen", _torch_varlen)
    AttentionMaskInterface.register("torch_varlen", _sdpa_varlen_mask)
    AttentionInterface.register("varlen_op", _varlen_op)
    AttentionMaskInterface.register("varlen_op", _sdpa_varlen_mask)


@dataclass(frozen=True, kw_only=True)
class AttnBackend:
    """What fastgrpo needs to know about one transformers attention implementation."""

    check: Callable[[torch.device], None] = _runs_anywhere
    """Raises (ImportError saying what to install, or ValueError) if it cannot run on a device."""
    packed_inputs: Callable[[MicroBatch], dict[str, Any]] = _position_ids_only
    """Extra trunk kwargs that mark the sequence boundaries of a packed row."""
    decode_with: str | None = None
    """Implementation the HF rollout engine decodes with; None = this one."""
    plain_forward: bool = True
    """Whether it runs a plain forward (no packed-row boundaries); False: packed rows only."""


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
register_attn_backend("sdpa_varlen", AttnBackend(packed_inputs=_own_varlen_inputs, decode_with="sdpa"))
register_attn_backend("eager", AttnBackend())
# torch's FlashAttention varlen kernel (CUDA, bf16/fp16): the CUDA default without flash-attn; decodes with sdpa.
register_attn_backend("torch_varlen", AttnBackend(check=_needs_torch_varlen, packed_inputs=_own_varlen_inputs,
                                                  decode_with="sdpa"))
# One registered op per layer (fastgrpo.models.varlen_op; torch's varlen op on CUDA in bf16): what compiled blocks
# run (parallel.compile switches sdpa_varlen / torch_varlen to it); decodes with sdpa.
register_attn_backend("varlen_op", AttnBackend(packed_inputs=_op_varlen_inputs, decode_with="sdpa",
                                               plain_forward=False))


def choose_attn_implementation(requested: str, device: torch.device | str) -> str:
    """Resolve ``model.attn_implementation`` to a transformers backend name for ``device``.

    'auto' on CUDA -> flash_attention_2 when flash-attn is installed, else torch_varlen (torch's own FlashAttention
    varlen kernel, torch >= 2.10), else sdpa_varlen; elsewhere sdpa_varlen (sdpa per sequence of a packed row: no
    [T, T] mask). Never flex_attention: its kernels are compiled per shape, and a packed row of a new length
    compiles again (name it explicitly to use it). An explicit name is checked (flash_attention_2 without
    flash-attn raises ImportError saying how to install it) and returned unchanged.
    """
    device = torch.device(device)
    if requested == "auto":
        if device.type == "cuda":
            if _flash_attn_installed():
                return "flash_attention_2"
            return "torch_varlen" if _torch_varlen_available() else "sdpa_varlen"
        return "sdpa_varlen"
    if requested not in ATTN_BACKENDS:
        raise ValueError(f"model.attn_implementation: unknown backend {requested!r} "
                         f"(auto, {', '.join(ATTN_BACKENDS)})")
    ATTN_BACKENDS[requested].check(device)
    return requested


def decoding_attn_implementation(impl: str | None) -> str | None:
    """The implementation to decode with (KV cache, one token per step) for a model that trains with ``impl``."""
    backend = ATTN_BACKENDS.get(impl) if impl is not None else None
    if backend is None or backend.decode_with is None:
        return impl
    return backend.decode_with


def plain_forward_attn_implementation(impl: str | None) -> str | None:
    """The implementation to run a plain forward (no packed-row boundaries) with: ``impl`` itself, or for a
    packed-rows-only backend the one it decodes with."""
    backend = ATTN_BACKENDS.get(impl) if impl is not None else None
    return impl if backend is None or backend.plain_forward else backend.decode_with


def packed_attention_inputs(config: Any, mb: MicroBatch) -> dict[str, Any]:
    """Extra trunk kwargs that mark the sequence boundaries of packed row ``mb`` for a model with ``config``."""
    impl = getattr(config, "_attn_implementation", None) or "sdpa"
    layer_types = getattr(config, "layer_types", None) or []
    if any(t != "full_attention" for t in layer_types):
        return {}
    backend = ATTN_BACKENDS.get(impl)
    return backend.packed_inputs(mb) if backend is not None else {}
