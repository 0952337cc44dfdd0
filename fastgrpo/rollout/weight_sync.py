"""Streaming the policy's weights to a rollout engine: full tensors, one layer-aligned bucket at a time.

The trainer's parameters may be FSDP2 shards (``DTensor``). An engine with its own copy of the weights (vLLM,
one per rank) needs full tensors, but gathering the whole model at once would double peak memory and sending
one parameter per call pays the per-call overhead hundreds of times. So:

- :func:`fastgrpo.models.policy_state.iter_policy_tensors` gathers one parameter at a time (``DTensor.full_tensor()`` is
  a collective: every rank must iterate the same model in the same order) and yields it under its Hugging Face
  name;
- :func:`bucket_by_layer` groups the stream into buckets of about ``bucket_bytes``, never splitting one
  transformer block across two buckets: vLLM fuses q/k/v (and gate/up) into one parameter and processes a
  layer once all its pieces arrived, so half a block in one call would leave the fused weight half-written.

Peak extra memory is one bucket plus one block.
"""

from __future__ import annotations

import re
from typing import Iterable, Iterator

import torch

__all__ = ["bucket_by_layer", "layer_key", "tensor_bytes"]

# `model.layers.12.self_attn.q_proj.weight` -> `model.layers.12.`: everything up to the block index.
_BLOCK = re.compile(r"^(.*?\.(?:layers|h|blocks)\.\d+\.)")


def layer_key(name: str) -> str:
    """The unit that must travel in one piece: the transformer block (``model.layers.3.``) or, outside the
    blocks, the owning module (``model.embed_tokens``, ``lm_head``)."""
    m = _BLOCK.match(name)
    if m:
        return m.group(1)
    return name.rpartition(".")[0]


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def bucket_by_layer(named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
                    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group a stream of ``(name, tensor)`` into lists of about ``bucket_bytes`` bytes.

    Consecutive tensors with the same :func:`layer_key` form one group, and a group is never split: a bucket
    is closed before a group that would overflow it, and a group larger than ``bucket_bytes`` forms a bucket
    of its own. A block whose tensors arrive non-consecutively (after its group was closed) raises
    ``ValueError``: streaming it in two calls would corrupt the engine's fused weights.
    """
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes: must be >= 1, got {bucket_bytes}")
    bucket: list[tuple[str, torch.Tensor]] = []
    bucket_size = 0
    group: list[tuple[str, torch.Tensor]] = []
    group_size = 0
    group_key: str | None = None
    closed: set[str] = set()

    def close_group() -> Iterator[list[tuple[str, torch.Tensor]]]:
        nonlocal bucket, bucket_size
        if bucket and bucket_size + group_size > bucket_bytes:
            yield bucket
            bucket, bucket_size = [], 0
        bucket.extend(group)
        bucket_size += group_size

    for name, t in named_tensors:
        key = layer_key(name)
        if key != group_key:
            if key in closed:
                raise ValueError(f"weight sync: {name!r} arrived after the rest of {key!r} was sent; "
                                 "stream each layer's tensors consecutively")
            yield from close_group()
            if group_key is not None:
                closed.add(group_key)
            group, group_size, group_key = [], 0, key
        group.append((name, t))
        group_size += tensor_bytes(t)
    yield from close_group()
    if bucket:
        yield bucket
