"""What the trainer adds to a model, kept off the model: the object that runs packed passes on it.

A policy, reference or critic stays a plain ``nn.Module`` (its own attributes and forward), so a decode copy, an
export or a user takes it as is. What a packed pass needs on top lives in a :class:`ModelRunner`:

- ``token_buckets``: what the step plan pads each packed row to (static shapes for compiled blocks, CUDA graphs);
- ``autocast_dtype``: a plain module on one GPU with float32 weights computes under autocast in this dtype;
- ``block_forwards``: one forward per decoder block that replaces the block's own for the duration of a packed
  pass only: the compiled blocks (``parallel.compile``) or the blocks' CUDA graphs
  (:class:`fastgrpo.update.cuda_graphs.BlockGraphs`). Outside a packed pass (decoding in the rollout, an export)
  the blocks run their plain forward, so decoding never meets a graph guarded on the update's shapes;
- ``lean_forwards``: forwards of the RMSNorms and SwiGLU MLPs that keep only their inputs for backward
  (:mod:`fastgrpo.models.lean_activations`, ``parallel.lean_activations``), installed, like the block forwards,
  for the duration of a packed pass only;
- ``head_graphs``: the head loss replayed from CUDA graphs (:class:`fastgrpo.update.cuda_graphs.HeadGraphs`);
- ``gradient_buffers``: the ``.grad`` buffers a graphed backward adds into
  (:class:`fastgrpo.update.cuda_graphs.GradientBuffers`).

:func:`prepare_model` builds it in a fixed order: the lean forwards (probed on the unsharded modules), master
weights (cast), activation checkpointing, the varlen attention switch, compile, FSDP2
(``fastgrpo.distributed.parallelize``); ``fastgrpo.update.bundle.build_trained`` adds the CUDA graphs and gradient
buffers of a trained model. LoRA is applied at load, before all of these.

Under FSDP2 the loss runs on the lm_head weight outside ``module.forward``, so :meth:`ModelRunner.packed_forward`
runs the root unit's pre- and post-forward hooks around the pass itself, as FSDP2's
``register_fsdp_forward_method`` would around a method registered on the module: the root's parameters (embedding,
final norm, lm_head) are gathered while the head uses them and their gradients reduce-scattered afterwards.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from fastgrpo.config import ParallelConfig
from fastgrpo.distributed.parallelize import (autocast_dtype, compiled_block_forwards, parallelize_model,
                                              transformer_blocks)
from fastgrpo.models.attention import packed_inputs_for
from fastgrpo.models.lean_activations import lean_forwards
from fastgrpo.models.loading import get_trunk_and_head, packed_head_forward
from fastgrpo.models.lora import adapters_disabled, is_lora
from fastgrpo.models.packing import AUTO_BUCKETS, MicroBatch

__all__ = ["AdapterDisabled", "ModelRunner", "as_runner", "prepare_model"]


class HeadGraphsLike(Protocol):
    """What :func:`fastgrpo.models.loading.packed_head_forward` asks of head graphs."""

    def forward(self, head: Callable, hidden: torch.Tensor, dtype: torch.dtype | None,
                eager: Callable[[], Any]) -> Any: ...


class GradientBuffersLike(Protocol):
    def install(self) -> None: ...


def _is_fsdp(module: nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # builds without distributed support
        return False
    return isinstance(module, FSDPModule)


@dataclass(eq=False)
class ModelRunner:
    """A module and what runs packed passes on it (module doc). Built by :func:`prepare_model`; a plain module
    passed where a runner is expected gets the defaults (:func:`as_runner`)."""

    module: nn.Module
    """The model: a plain module (one process) or FSDP2-sharded; never carries trainer state."""
    token_buckets: Sequence[int] | str = ()
    """Token counts the step plan pads each packed row to ('auto': the budget's; () = no padding)."""
    autocast_dtype: torch.dtype | None = None
    """The dtype packed passes (and the hf engine's decoding) compute in under autocast, or None."""
    block_forwards: list[Callable] | None = None
    """One forward per decoder block, in place of the block's own during a packed pass (compiled or graphed)."""
    block_graphs: Any = None
    """The blocks' CUDA graphs (``fastgrpo.update.cuda_graphs.BlockGraphs``) whose forwards those are, or None."""
    head_graphs: HeadGraphsLike | None = None
    """The head loss's CUDA graphs, or None (eager head)."""
    gradient_buffers: GradientBuffersLike | None = None
    """Persistent ``.grad`` buffers installed before each update's backward passes, or None."""
    blocks: list[nn.Module] = field(default_factory=list)
    """The decoder blocks ``block_forwards`` stand in for (as the module holds them: wrapped, sharded)."""
    lean_forwards: list[tuple[nn.Module, Callable]] = field(default_factory=list)
    """``(module, forward)``: RMSNorm and MLP forwards that save less for backward, during packed passes."""
    attention_inputs: Callable[[MicroBatch], dict[str, Any]] | None = None
    """A packed row's boundary kwargs for the module's attention backend, resolved once (at construction)."""

    def __post_init__(self) -> None:
        if self.attention_inputs is None:
            self.attention_inputs = packed_inputs_for(get_trunk_and_head(self.module)[0].config)

    def packed_forward(self, mb: MicroBatch, head: Callable[[torch.Tensor, torch.Tensor], Any]) -> Any:
        """``head(hidden [N, H], lm_head weight [V, H])`` on one packed micro-batch; returns what ``head`` returns
        (:func:`fastgrpo.models.loading.packed_head_forward`), inside FSDP2's root hooks when the module is sharded."""
        with self._block_forwards():
            if not _is_fsdp(self.module):
                return self._run(mb, head)
            # The root unit's hooks, as register_fsdp_forward_method runs them around a method of the module, with
            # no arguments: the pre-forward hook would rebuild the micro-batch and the head (it moves and casts the
            # tensors of any dataclass it is given), and the head finds its per-micro-batch inputs by identity.
            state = self.module._get_fsdp_state()
            state._pre_forward(self.module, (), {})
            out = self._run(mb, head)
            return state._post_forward(self.module, (), out)

    def _run(self, mb: MicroBatch, head: Callable) -> Any:
        return packed_head_forward(self.module, mb, head, autocast_dtype=self.autocast_dtype,
                                   head_graphs=self.head_graphs, attention_inputs=self.attention_inputs)

    @contextlib.contextmanager
    def _block_forwards(self) -> Iterator[None]:
        """The blocks run ``block_forwards``, and the lean modules their lean forwards, inside; their own forwards
        again on exit (nothing stays on a module)."""
        swaps = list(zip(self.blocks, self.block_forwards or ())) + list(self.lean_forwards)
        if not swaps:
            yield
            return
        before = [vars(module).get("forward") for module, _ in swaps]  # a forward some library set on the instance
        for module, forward in swaps:
            module.forward = forward  # an instance attribute, read by nn.Module.__call__ before the class's forward
        try:
            yield
        finally:
            for (module, _), prior in zip(swaps, before):
                if prior is None:
                    vars(module).pop("forward", None)
                else:
                    module.forward = prior

    def train(self, mode: bool = True) -> "ModelRunner":
        self.module.train(mode)
        return self


def as_runner(model: ModelRunner | nn.Module | Any) -> Any:
    """``model`` as something with ``packed_forward``: a runner as it is, a plain module in a default runner (no
    buckets, no autocast, eager blocks and head; FSDP2's hooks when sharded), any other object (a reference policy
    that wraps a runner, e.g. ``fastgrpo.models.lora.AdapterDisabled``) as it is."""
    return ModelRunner(model) if isinstance(model, nn.Module) else model


class AdapterDisabled:
    """The reference policy of a LoRA run: the policy runner's ``packed_forward`` with the adapters switched off,
    i.e. the base model, for the update's log-prob passes (a runner or a module, run by a default runner)."""

    def __init__(self, policy: ModelRunner | nn.Module) -> None:
        self.runner = as_runner(policy)
        if not is_lora(self.runner.module):
            raise TypeError("AdapterDisabled needs a peft-wrapped model (fastgrpo.models.lora.apply_lora)")

    def packed_forward(self, mb: MicroBatch, head: Callable[[torch.Tensor, torch.Tensor], Any]) -> Any:
        with adapters_disabled(self.runner.module):
            return self.runner.packed_forward(mb, head)


def prepare_model(model: nn.Module, cfg: ParallelConfig, *, device: torch.device | str,
                  world_size: int) -> ModelRunner:
    """``model`` (loaded, LoRA applied) made trainable per ``cfg``, in a fixed order: the lean norm and MLP forwards
    (probed while the modules are whole; their ops follow the weights' dtype, so the cast after them keeps them
    exact), master-weight cast, activation checkpointing, the varlen attention switch, FSDP2
    (:func:`fastgrpo.distributed.parallelize.parallelize_model`), then the compiled block forwards; and the runner
    that holds what its packed passes need (module doc).

    Compile after FSDP2 is the same program as before it: the compiled function is the block's forward, which
    FSDP2's hooks (on the block's call) surround either way, so collectives stay outside the compiled region."""
    device = torch.device(device)
    # before sharding (the probes run the modules' own forwards); compiled blocks recompute pointwise ops themselves,
    # and activation checkpointing keeps no activations and must recompute the very forward it checkpointed
    lean = lean_forwards(model) if cfg.lean_activations and not (
        cfg.compile or cfg.cuda_graphs or cfg.activation_checkpointing) else []
    module = parallelize_model(model, cfg, device=device, world_size=world_size)
    blocks = list(transformer_blocks(module))
    forwards = compiled_block_forwards(blocks, mode="reduce-overhead" if cfg.cuda_graphs else None) \
        if cfg.compile else None
    return ModelRunner(
        module=module,
        # static shapes: what the step plan pads each packed row to (compiled blocks: one graph per bucket)
        token_buckets=list(cfg.token_buckets) or (AUTO_BUCKETS if cfg.compile or cfg.cuda_graphs else ()),
        # one plain GPU: packed passes run under autocast, float32 weights as masters (none with master weights)
        autocast_dtype=None if cfg.master_weights else autocast_dtype(cfg, device, world_size),
        block_forwards=forwards,
        blocks=blocks,
        lean_forwards=lean,
    )
