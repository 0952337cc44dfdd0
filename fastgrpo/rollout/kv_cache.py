"""The hf engine's decode KV cache: each layer's keys and values in buffers sized once for the whole generation.

Legend: B rows, Hkv key/value heads, T tokens, d head size.
"""

from __future__ import annotations

import functools

from torch import nn

__all__ = ["preallocated_kv_cache"]


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

        def batch_select_indices(self, indices):  # indices: [B'] rows, repeats allowed
            """Row ``indices[i]`` becomes row i, in new buffers of the same length (the hf engine fans one prefilled
            prompt out to its samples this way); only the filled slots are copied."""
            if not self.is_initialized:
                return
            end = self.keys.shape[-2]
            k = self._k.new_empty((len(indices), *self._k.shape[1:]))
            v = self._v.new_empty((len(indices), *self._v.shape[1:]))
            k[:, :, :end] = self._k[indices, :, :end]
            v[:, :, :end] = self._v[indices, :, :end]
            self._k, self._v = k, v
            self.keys, self.values = k[:, :, :end], v[:, :, :end]

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
