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
from fastgrpo.models.varlen_op import bottom_right_causal, varlen_attn, varlen_attn_kv

__all__ = ["ATTN_BACKENDS", "STATIC_SHAPES_PROBLEM", "AttnBackend", "block_causal_mask", "choose_attn_implementation",
           "decoding_attn_implementation", "packed_attention_inputs", "packed_inputs_for", "register_attn_backend",
           "register_with_transformers", "shared_prefix_problem", "use_shared_prefix"]


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
#
# A row with a shared prefix (fastgrpo.models.packing, "Shared prefixes") is not a set of sequences that position_ids
# could tell apart (an own segment's positions continue its prefix's), so only the backends that take the layout
# run it (AttnBackend.shared_prefix): sdpa gets the mask with each prefix visible to its sequences' tokens; the varlen
# ones gather each segment's keys and values by kv_index ([prefix ; own] for a sequence's own segment) and attend
# causally aligned bottom-right on cu_seq_lens_k; the gather's backward adds each prefix key's gradient over the
# segments that read it (flash_attention_2: transformers' own function for every other row, flash-attn's varlen
# kernel on the gathered keys for these). eager and flex_attention (position_ids) cannot, and say so before a step
# runs (use_shared_prefix).


def block_causal_mask(mb: MicroBatch) -> torch.Tensor:
    """[1, 1, T, T] bool: token q may attend to token k iff same segment and k <= q, or (a row with a shared prefix)
    k is in the prefix segment q sees in full (``context_ids``; a prefix comes before its sequences)."""
    seg = mb.segment_ids  # [T], already on the device: no host->device copy inside the micro-batch loop
    same = seg[:, None] == seg[None, :]  # [T, T]
    causal = torch.ones(mb.num_tokens, mb.num_tokens, dtype=torch.bool, device=seg.device).tril_()
    mask = same & causal
    if mb.context_ids is not None:
        mask |= mb.context_ids[:, None] == seg[None, :]  # [T, T]; -1 matches no segment
    return mask[None, None]


def _sdpa_inputs(mb: MicroBatch) -> dict[str, Any]:
    return {"attention_mask": block_causal_mask(mb)}


def _varlen_inputs(mb: MicroBatch) -> dict[str, Any]:
    return {"cu_seq_lens_q": mb.cu_seqlens, "cu_seq_lens_k": mb.cu_seqlens,
            "max_length_q": mb.max_seqlen, "max_length_k": mb.max_seqlen}


def _shared_varlen_inputs(mb: MicroBatch) -> dict[str, Any]:
    # fastgrpo's varlen backends: a row with a shared prefix adds the keys each segment attends (kv_index [Tk]) and
    # their boundaries; max_seqlen is the longest key segment (a sequence's prompt + completion)
    if not mb.shares_prefix:
        return _varlen_inputs(mb)
    return {**_varlen_inputs(mb), "cu_seq_lens_k": mb.cu_seqlens_k, "kv_index": mb.kv_index}


def _no_padding(mb: MicroBatch) -> torch.Tensor:
    """[1, T] bool, every token real: a stride-0 view of one True. Passing it (instead of no mask) keeps
    transformers from reading the row's packing out of position_ids, a host sync per forward; fastgrpo's own mask
    function (:func:`_sdpa_varlen_mask`) knows the marker and builds nothing."""
    return torch.ones((), dtype=torch.bool, device=mb.input_ids.device).expand(1, mb.num_tokens)


def _own_varlen_inputs(mb: MicroBatch) -> dict[str, Any]:
    # fastgrpo's varlen backends: the boundaries also as host ints, from the packing plan (no device-to-host copy
    # per layer in sdpa_varlen), and the no-padding marker
    bounds, key_bounds = [0], [0]
    for length, keys in zip(mb.segment_lengths, mb.key_segment_lengths):  # the real segments, then the padding's
        bounds.append(bounds[-1] + length)
        key_bounds.append(key_bounds[-1] + keys)
    shared = {"key_bounds": key_bounds} if mb.shares_prefix else {}
    return {**_shared_varlen_inputs(mb), **shared, "sequence_bounds": bounds, "attention_mask": _no_padding(mb)}


def _op_varlen_inputs(mb: MicroBatch) -> dict[str, Any]:
    # "varlen_op": the boundaries as a device tensor only (host ints would be guarded values in a compiled block)
    return {**_shared_varlen_inputs(mb), "attention_mask": _no_padding(mb)}


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
    A row with a shared prefix (``kv_index``): each segment's keys and values are gathered (its prefix's, then its
    own; boundaries from ``key_bounds``, host ints, else ``cu_seq_lens_k``) and attended causally aligned
    bottom-right, so a sequence's own tokens see its whole prefix.
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
    key_bounds = bounds
    kv_index = kwargs.get("kv_index")
    if kv_index is not None:  # a shared prefix: the keys of each segment, [1, Hkv, Tk, d]
        key, value = (t.index_select(2, kv_index) for t in (key, value))
        key_bounds = kwargs.get("key_bounds") or kwargs["cu_seq_lens_k"].tolist()

    def band(n: int) -> torch.Tensor | None:  # sliding-window layers: causal and at most `window` back, [n, n]
        if sliding_window is None or sliding_window >= n:
            return None
        i = torch.arange(n, device=query.device)
        return (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < sliding_window)

    masks: dict[tuple[int, int], torch.Tensor] = {}  # bottom-right causal masks by (queries, keys): one per shape

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:  # [1, Hq, L_i, d]
        if q.shape[2] != k.shape[2]:  # a sequence's own segment after its shared prefix
            if sliding_window is not None and sliding_window < k.shape[2]:
                raise ValueError("model.attn_implementation=sdpa_varlen: a shared prefix with sliding-window "
                                 "layers is not supported (set the update's shared_prefix to false)")
            shape = (q.shape[2], k.shape[2])
            mask = masks.get(shape)
            if mask is None:
                mask = masks[shape] = bottom_right_causal(*shape, q.device)
        else:
            mask = band(q.shape[2])
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=mask is None, scale=scaling, enable_gqa=gqa)

    # One split per tensor, not a slice per sequence: a split's backward is one concatenation, where each slice's
    # backward writes its gradient into a fresh zero tensor of the whole row (3 K zero-fills and adds per layer).
    pairs = [(b - a, kb - ka) for a, b, ka, kb in zip(bounds[:-1], bounds[1:], key_bounds[:-1], key_bounds[1:])
             if b > a]
    lengths, key_lengths = [n for n, _ in pairs], [n for _, n in pairs]
    parts = zip(query.split(lengths, dim=2), *(t.split(key_lengths, dim=2) for t in (key, value)))
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
# marked as skipped", an H100 run of the graphed update) and would cost a signature parse per layer otherwise.
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
    kv_index = kwargs.get("kv_index")
    if kv_index is not None and sliding_window is not None:
        raise ValueError("model.attn_implementation=torch_varlen: a shared prefix with sliding-window layers is not "
                         "supported (set the update's shared_prefix to false)")
    options = _varlen_call_options(varlen_attn, sliding_window, gqa)
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [T, H, d]
    cu_k = cu
    if kv_index is not None:  # a shared prefix: each segment's keys [Tk, Hkv, d]; FlashAttention's causal mask is
        # aligned bottom-right, so a sequence's own tokens see its whole prefix
        k, v = (t.index_select(0, kv_index) for t in (k, v))
        cu_k = kwargs["cu_seq_lens_k"]
    if gqa and "enable_gqa" not in options:
        k, v = (t.repeat_interleave(query.shape[1] // key.shape[1], dim=1) for t in (k, v))
    max_q, max_k = int(kwargs["max_length_q"]), int(kwargs.get("max_length_k") or kwargs["max_length_q"])
    out = varlen_attn(q, k, v, cu, cu_k, max_q, max_k, scale=scaling, **options)  # [T, Hq, d]
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
    kv_index = kwargs.get("kv_index")
    if kv_index is not None:  # a shared prefix: each segment's keys [Tk, Hkv, d], attended bottom-right aligned
        k, v = (t.index_select(0, kv_index) for t in (k, v))
        out = varlen_attn_kv(q, k, v, cu, kwargs["cu_seq_lens_k"], int(kwargs["max_length_q"]), float(scale))
        return out[None], None
    out = varlen_attn(q, k, v, cu, int(kwargs["max_length_q"]), float(scale))  # [T, Hq, d]
    return out[None], None


def _flash_attention_2(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                       sliding_window: int | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers attention function of ``"flash_attention_2"``: transformers' own, except for a packed row with a
    shared prefix (``kv_index``), which goes to flash-attn's varlen kernel with each segment's keys and values
    gathered (its prefix's, then its own) and ``causal=True``, which flash-attn aligns bottom-right: a sequence's own
    tokens see its whole prefix. query ``[1, Hq, T, d]``, key / value ``[1, Hkv, T, d]`` -> ``[1, T, Hq, d]``."""
    from transformers.integrations import flash_attention  # loaded with the model: a lookup, not an import

    kv_index = kwargs.pop("kv_index", None)
    if kv_index is None:
        return flash_attention.flash_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                                       scaling=scaling, sliding_window=sliding_window, **kwargs)
    if sliding_window is not None:
        raise ValueError("model.attn_implementation=flash_attention_2: a shared prefix with sliding-window layers is "
                         "not supported (set the update's shared_prefix to false)")
    from flash_attn import flash_attn_varlen_func

    dtype = query.dtype
    if dtype == torch.float32:  # as transformers' own: the autocast dtype, or the projections' weights'
        target = flash_attention.get_target_dtype(query, module) or torch.bfloat16
        query, key, value = (t.to(target) for t in (query, key, value))
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [T, H, d]
    k, v = (t.index_select(0, kv_index) for t in (k, v))  # [Tk, Hkv, d]
    out = flash_attn_varlen_func(q, k, v, kwargs["cu_seq_lens_q"], kwargs["cu_seq_lens_k"],
                                 int(kwargs["max_length_q"]), int(kwargs["max_length_k"]), dropout_p=dropout,
                                 softmax_scale=scaling, causal=True)  # [T, Hq, d]
    return out[None].to(dtype), None


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
    transformers, and ``"flash_attention_2"`` the same as transformers' but for rows with a shared prefix; idempotent.
    ``load_model`` calls it; call it before building a model from a config with one of them."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    # transformers' flash_attention_2 with one addition: rows with a shared prefix (_flash_attention_2)
    AttentionInterface.register("flash_attention_2", _flash_attention_2)

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
    shared_prefix: bool = False
    """Whether its packed inputs express a row with a shared prefix (``MicroBatch.kv_index`` / ``context_ids``)."""


ATTN_BACKENDS: dict[str, AttnBackend] = {}
"""Backend name (transformers' attn_implementation, the choices of model.attn_implementation) -> AttnBackend."""


def register_attn_backend(name: str, backend: AttnBackend) -> None:
    """Make ``name`` a valid ``model.attn_implementation`` with the given checks and packed inputs."""
    ATTN_BACKENDS[name] = backend


register_attn_backend("flash_attention_2", AttnBackend(check=_needs_flash_attn, packed_inputs=_shared_varlen_inputs,
                                                       shared_prefix=True))
# flex's compiled kernels are specialised to shapes and a KV cache changes shape every token: decode with sdpa.
register_attn_backend("flex_attention", AttnBackend(decode_with="sdpa"))
register_attn_backend("sdpa", AttnBackend(packed_inputs=_sdpa_inputs, shared_prefix=True))
# sdpa per sequence of a packed row (see _sdpa_per_sequence): the CPU default; decoding needs sdpa's masks.
register_attn_backend("sdpa_varlen", AttnBackend(packed_inputs=_own_varlen_inputs, decode_with="sdpa",
                                                 shared_prefix=True))
register_attn_backend("eager", AttnBackend())
# torch's FlashAttention varlen kernel (CUDA, bf16/fp16): the CUDA default without flash-attn; decodes with sdpa.
register_attn_backend("torch_varlen", AttnBackend(check=_needs_torch_varlen, packed_inputs=_own_varlen_inputs,
                                                  decode_with="sdpa", shared_prefix=True))
# One registered op per layer (fastgrpo.models.varlen_op; torch's varlen op on CUDA in bf16): what compiled blocks
# run (parallel.compile switches sdpa_varlen / torch_varlen to it); decodes with sdpa.
register_attn_backend("varlen_op", AttnBackend(packed_inputs=_op_varlen_inputs, decode_with="sdpa",
                                               plain_forward=False, shared_prefix=True))


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


def shared_prefix_problem(impl: str | None, config: Any = None) -> str | None:
    """Why attention ``impl`` (of a model with ``config``, when given) cannot run a row with a shared prefix, or None
    when it can."""
    backend = ATTN_BACKENDS.get(impl or "sdpa")
    if backend is None or not backend.shared_prefix:
        able = ", ".join(name for name, b in ATTN_BACKENDS.items() if b.shared_prefix)
        return (f"{impl} cannot attend a shared prefix (it reads the sequences from position_ids, or attends each "
                f"row's own keys); these can: {able}")
    layer_types = getattr(config, "layer_types", None) or []
    if any(t != "full_attention" for t in layer_types):
        return "the model's sliding-window layers take their masks from position_ids, which a shared prefix breaks"
    return None


STATIC_SHAPES_PROBLEM = ("compiled blocks and CUDA graphs (parallel.compile, parallel.cuda_graphs) run fixed row "
                         "shapes, and the keys a shared prefix gathers vary with every row")
"""Why a runner with compiled or graphed blocks never shares a prefix."""


def use_shared_prefix(setting: str, *, impl: str | None, config: Any = None, static_shapes: bool = False,
                      key: str = "grpo.shared_prefix", requested: str | None = None) -> bool:
    """Whether packed passes share each group's prompt prefix, for ``setting`` (the value of config key ``key``:
    'auto', 'true' or 'false'), attention ``impl`` (as resolved; ``requested``: model.attn_implementation as set, for
    the message) of a model with ``config`` (when known), and ``static_shapes`` (compiled or graphed blocks). 'auto'
    shares wherever the attention can; 'true' where it cannot is a one-line ValueError naming ``key`` and
    model.attn_implementation."""
    if setting not in ("auto", "true", "false"):
        raise ValueError(f"{key} must be auto, true or false, got {setting!r}")
    if setting == "false":
        return False
    problem = STATIC_SHAPES_PROBLEM if static_shapes else shared_prefix_problem(impl, config)
    if problem is not None and setting == "true":
        raise ValueError(f"{key}=true, but model.attn_implementation={requested or impl}: {problem}; set {key} to "
                         "auto or false")
    return problem is None


def packed_inputs_for(config: Any) -> Callable[[MicroBatch], dict[str, Any]]:
    """``inputs(mb)``: the extra trunk kwargs that mark the sequence boundaries of packed row ``mb`` for a model
    with ``config``, the attention backend looked up once (a model runner holds it for the run); a row with a shared
    prefix that the model's attention cannot express is a ValueError, never a wrong result."""
    impl = getattr(config, "_attn_implementation", None) or "sdpa"
    problem = shared_prefix_problem(impl, config)
    layer_types = getattr(config, "layer_types", None) or []
    # sliding-window layers read no boundaries from these kwargs (the loader refuses packing them)
    backend = None if any(t != "full_attention" for t in layer_types) else ATTN_BACKENDS.get(impl)

    def inputs(mb: MicroBatch) -> dict[str, Any]:
        if mb.shares_prefix and problem is not None:
            raise ValueError(f"a packed row with a shared prefix: {problem}")
        return backend.packed_inputs(mb) if backend is not None else {}

    return inputs


def packed_attention_inputs(config: Any, mb: MicroBatch) -> dict[str, Any]:
    """:func:`packed_inputs_for` ``(config)(mb)``, for one row."""
    return packed_inputs_for(config)(mb)
