"""A lean one-token decode step for Qwen2 / Llama decoders, used by the hf rollout engine.

Why: for a small model a transformers forward of one new token per row is mostly Python and dispatch (mask
construction, the rotary module, cache bookkeeping, output dataclasses, module calls), not arithmetic; on the tiny
models of the demo and the TRL benchmark the decode loop was no faster than ``model.generate``. This module writes
the same step as a few dozen torch calls on the model's own parameters: embedding, per layer RMSNorm, q/k/v
projections, RoPE from a cos/sin table, k/v appended to the cache, single-query attention as two batched matrix
products against a padding bias, the MLP, then the final norm and the lm_head. Nothing is copied
out of the model, so an optimizer step is seen by the next call; the arithmetic is transformers' (float32 norm and
softmax, the same rotation), so logits match the transformers forward to float rounding.

Limits: the prompt (prefill) still runs through transformers' forward into ``model.preallocated_kv_cache``, whose
buffers this step then extends (values in place, keys in a transposed copy made once per chunk).
:func:`lean_unsupported_reason` says why it cannot be used for a model, and the engine falls back to transformers'
forward, for anything it does not reproduce exactly: other architectures, sliding-window layers, RoPE variants
whose frequencies depend on the sequence length (dynamic, longrope), FSDP2/DTensor-sharded parameters, adapters or
quantized layers (projections that are not plain ``nn.Linear``), and modules with hooks. Where the lm_head and the
sampler dominate (a 152k vocabulary, as on the 108M-style benchmark model) it gains nothing (benchmarks/RESULTS.md).

Legend: N rows, S cache slots filled (prompt + decoded), M cache length, H hidden, Hq / Hkv query / key-value
heads, G = Hq / Hkv, d head dim, V vocabulary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GraphedStep", "LeanDecoder", "lean_unsupported_reason"]

_ARCHITECTURES = ("Qwen2ForCausalLM", "LlamaForCausalLM")
"""Model classes whose decoder layer is exactly: x + attn(norm(x)), then x + mlp(norm(x)), with rotate-half RoPE."""

_LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")
"""rope_type values whose frequencies change with the sequence length (transformers' dynamic_rope_update)."""


def _is_plain_linear(m: nn.Module) -> bool:
    return type(m) is nn.Linear


def lean_unsupported_reason(model: nn.Module) -> str | None:
    """None when :class:`LeanDecoder` reproduces ``model``'s forward; otherwise why not (one line)."""
    name = type(model).__name__
    if name not in _ARCHITECTURES:
        return f"{name} is not one of {', '.join(_ARCHITECTURES)}"
    cfg = model.config
    if any(t != "full_attention" for t in (getattr(cfg, "layer_types", None) or [])):
        return "sliding-window attention layers"
    rope_type = (getattr(cfg, "rope_parameters", None) or {}).get("rope_type", "default")
    if any(kind in str(rope_type) for kind in _LENGTH_DEPENDENT_ROPE):
        return f"rope_type {rope_type!r} depends on the sequence length"
    for param in model.parameters():
        if type(param).__name__ == "DTensor" or type(param.data).__name__ == "DTensor":
            return "sharded (DTensor) parameters"
    for module in model.modules():
        if module._forward_hooks or module._forward_pre_hooks:
            return f"{type(module).__name__} has forward hooks, which the lean step would not run"
    for i, layer in enumerate(model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        projections = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj)
        if not all(_is_plain_linear(p) for p in projections):
            return f"layer {i} has projections that are not plain nn.Linear (adapters or quantization)"
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            if not type(norm).__name__.endswith("RMSNorm") or not hasattr(norm, "variance_epsilon"):
                return f"layer {i}'s norm is {type(norm).__name__}, not an RMSNorm"
    if not _is_plain_linear(model.lm_head):
        return "the lm_head is not a plain nn.Linear"
    return None


def _rms_norm(x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
    """transformers' RMSNorm (normalise in float32, cast back, then scale); one fused op in float32."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, x.shape[-1:], norm.weight, norm.variance_epsilon)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return norm.weight * xf.to(x.dtype)


class LeanDecoder:
    """Decode steps of one chunk: :meth:`start` after the prefill, then :meth:`step` once per new token.

    The parameters are read from the modules at every step (the lists below hold modules, not tensors). Keys are
    kept transposed, ``[N * Hkv, d, M]``, so that the scores are a plain batched product (``baddbmm`` with the
    padding bias, twice as fast on a CPU as a product with a transposed view); values stay in the prefill's cache.
    """

    def __init__(self, model: nn.Module):
        cfg = model.config
        self.model = model
        self.embed = model.model.embed_tokens
        self.layers = list(model.model.layers)
        self.norm = model.model.norm
        self.lm_head = model.lm_head
        self.rotary = model.model.rotary_emb
        attn = self.layers[0].self_attn
        self.d = attn.head_dim
        self.hq, self.hkv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.scaling = attn.scaling
        self.keys_t: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    def start(self, cache, key_mask: torch.Tensor, max_position: int, *, static: bool = False) -> None:
        """Adopt the prefilled ``cache`` (``preallocated_kv_cache``, prompt in its first P slots) and the chunk's
        key mask; the caller may drop ``cache`` afterwards.

        key_mask: [N, M] (1 = a real token: left padding is 0, every decoded slot 1). max_position: one more than
        the largest RoPE position any step will use. ``static``: prepare :meth:`step_static` (every step attends
        over all M slots, the ones not yet decoded masked out), whose shapes do not change from step to step.
        """
        n, m = key_mask.shape
        filled = cache.layers[0].keys.shape[-2]  # P
        self.keys_t, self.values = [], []
        for layer in cache.layers:
            k = layer._k  # [N, Hkv, M, d]
            keys_t = k.new_empty(n * self.hkv, self.d, m)  # [N * Hkv, d, M]
            keys_t[..., :filled] = k[:, :, :filled].reshape(n * self.hkv, filled, self.d).transpose(1, 2)
            self.keys_t.append(keys_t)
            self.values.append(layer._v.view(n * self.hkv, m, self.d))  # [N * Hkv, M, d]
            if static:  # unwritten slots get weight 0 but still enter the products: 0 * garbage must not be NaN
                keys_t[..., filled:] = 0
                self.values[-1][:, filled:] = 0
        dtype = self.values[0].dtype
        # Additive bias, one row per (row, KV head): -inf on padding, so a padded slot gets exactly zero weight.
        bias = torch.zeros((n, m), dtype=dtype, device=key_mask.device).masked_fill_(key_mask == 0, float("-inf"))
        if static:
            bias[:, filled:] = float("-inf")  # opened slot by slot as step_static writes them
        self.bias = bias.repeat_interleave(self.hkv, dim=0)[:, None, :]  # [N * Hkv, 1, M]
        # cos/sin of every position from the model's own rotary module (its rope_theta, scaling and attention
        # factor). rotate_half(x) * sin == swap_halves(x) * (sin with its first half negated): one table each.
        positions = torch.arange(max_position, device=key_mask.device)[None]  # [1, P_max]
        cos, sin = self.rotary(torch.empty(0, dtype=dtype, device=key_mask.device), positions)  # [1, P_max, d]
        half = self.d // 2
        self.cos = cos[0]  # [P_max, d]
        self.sin = torch.cat((-sin[0, :, :half], sin[0, :, half:]), dim=-1)  # [P_max, d]

    @torch.no_grad()
    def step(self, tokens: torch.Tensor, positions: torch.Tensor, slot: int) -> torch.Tensor:
        """Logits [N, V] of the token after ``tokens`` [N], which sit at RoPE ``positions`` [N] and cache ``slot``;
        attends over the slots filled so far."""
        return self._layers(tokens, positions, slot)

    @torch.no_grad()
    def step_static(self, tokens: torch.Tensor, positions: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
        """:meth:`step` with ``slot`` a one-element device tensor ``[1]``: the new token's k/v are written at that
        slot, the slot is opened in the bias, and attention runs over all M slots (unwritten ones weigh exactly
        0). Every shape is fixed for the chunk and nothing reads the host, so :class:`GraphedStep` can capture it
        once and replay it. Needs :meth:`start` with ``static=True``."""
        return self._layers(tokens, positions, slot)

    def _layers(self, tokens: torch.Tensor, positions: torch.Tensor, slot: int | torch.Tensor) -> torch.Tensor:
        N, d, hq, hkv, half = tokens.shape[0], self.d, self.hq, self.hkv, self.d // 2
        static = isinstance(slot, torch.Tensor)
        cos, sin = self.cos[positions][:, None], self.sin[positions][:, None]  # [N, 1, d]
        if static:
            self.bias.index_fill_(2, slot, 0.0)
            bias = self.bias  # [N * Hkv, 1, M]
        else:
            bias = self.bias[..., :slot + 1]  # [N * Hkv, 1, S]
        h = F.embedding(tokens, self.embed.weight)  # [N, H]
        for layer, keys_t, values in zip(self.layers, self.keys_t, self.values):
            attn, mlp = layer.self_attn, layer.mlp
            x = _rms_norm(h, layer.input_layernorm)
            qk = torch.cat((F.linear(x, attn.q_proj.weight, attn.q_proj.bias),
                            F.linear(x, attn.k_proj.weight, attn.k_proj.bias)), dim=-1).view(N, hq + hkv, d)
            qk = qk * cos + torch.cat((qk[..., half:], qk[..., :half]), dim=-1) * sin  # RoPE, [N, Hq + Hkv, d]
            q, k = qk[:, :hq], qk[:, hq:]
            v = F.linear(x, attn.v_proj.weight, attn.v_proj.bias).view(N * hkv, d)
            if static:
                keys_t.index_copy_(2, slot, k.reshape(N * hkv, d, 1))
                values.index_copy_(1, slot, v[:, None])
                keys_s, values_s = keys_t, values  # [N * Hkv, d, M], [N * Hkv, M, d]
            else:
                keys_t[:, :, slot] = k.reshape(N * hkv, d)
                values[:, slot] = v
                keys_s, values_s = keys_t[..., :slot + 1], values[:, :slot + 1]
            # One query per row: the G query heads sharing a KV head are the rows of one small product.
            q = q.reshape(N * hkv, hq // hkv, d)  # [N * Hkv, G, d]
            scores = torch.baddbmm(bias, q, keys_s, alpha=self.scaling)  # [N * Hkv, G, S]
            weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
            out = torch.bmm(weights, values_s).view(N, hq * d)  # [N, Hq * d]
            h = h + F.linear(out, attn.o_proj.weight, attn.o_proj.bias)
            x = _rms_norm(h, layer.post_attention_layernorm)
            gate = mlp.act_fn(F.linear(x, mlp.gate_proj.weight, mlp.gate_proj.bias))
            h = h + F.linear(gate * F.linear(x, mlp.up_proj.weight, mlp.up_proj.bias), mlp.down_proj.weight,
                             mlp.down_proj.bias)
        h = _rms_norm(h, self.norm)
        return F.linear(h, self.lm_head.weight, self.lm_head.bias)  # [N, V]


class GraphedStep:
    """:meth:`LeanDecoder.step_static` captured once per chunk in a CUDA graph and replayed per token (gpt-fast's
    way of decoding a small model: one graph launch per token instead of a few hundred kernel launches).

    The graph reads its inputs from, and writes its logits to, fixed buffers: :meth:`__call__` copies the step's
    tokens, positions and slot in (device-to-device, no host sync) and replays. Capturing needs a warm-up run on a
    side stream; both write a throw-away k/v into the last cache slot, which is then masked and zeroed again (it
    is rewritten before it is ever attended to). The parameters are read in place, so an optimizer step between
    calls is seen; a new chunk (other N or M) captures a new graph.
    """

    def __init__(self, decoder: LeanDecoder, num_rows: int, device: torch.device):
        self.decoder = decoder
        last = decoder.bias.shape[-1] - 1
        self.tokens = torch.zeros(num_rows, dtype=torch.long, device=device)  # [N]
        self.positions = torch.zeros(num_rows, dtype=torch.long, device=device)  # [N]
        self.slot = torch.full((1,), last, dtype=torch.long, device=device)  # [1]
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            decoder.step_static(self.tokens, self.positions, self.slot)
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = decoder.step_static(self.tokens, self.positions, self.slot)  # [N, V]
        self._forget_slot(last)

    @torch.no_grad()
    def _forget_slot(self, slot: int) -> None:
        d = self.decoder
        d.bias[..., slot] = float("-inf")
        for keys_t, values in zip(d.keys_t, d.values):
            keys_t[..., slot] = 0
            values[:, slot] = 0

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
        """Logits [N, V] (a view of the graph's output buffer: read it before the next call)."""
        self.tokens.copy_(tokens)
        self.positions.copy_(positions)
        self.slot.copy_(slot)
        self.graph.replay()
        return self.logits
