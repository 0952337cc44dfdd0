"""Apply training parallelism to a loaded Hugging Face causal LM: master weights, activation checkpointing, FSDP2.

The model code knows nothing of this; ``parallelize_model`` changes the module in place, in a fixed order:

1. with ``parallel.master_weights``, a cast to ``param_dtype`` (the optimizer keeps float32 masters:
   ``fastgrpo.update.master_weights``),
2. activation checkpointing per transformer block (wraps the block),
3. the attention switch to the registered ``varlen_op`` where compiled blocks or CUDA graphs cannot run the
   configured backend,
4. FSDP2 ``fully_shard`` per block, then on the root module (several ranks; one GPU: ``parallel.one_gpu``).

Compiled blocks (:func:`compiled_block_forwards`: ``fullgraph=True``, ``dynamic=False``, one graph per token bucket)
and everything else a packed pass needs (buckets, the autocast dtype of a plain module on one GPU, graphs, the
FSDP2 hooks around the head) live in :class:`fastgrpo.distributed.runner.ModelRunner`, built by
:func:`fastgrpo.distributed.runner.prepare_model`: the module itself carries no trainer state.

FSDP's all-gather / reduce-scatter hooks sit on each block's call, *outside* its checkpointed and compiled forward,
so that recomputation in backward does not all-gather again and dynamo does not trace collectives.

Blocks are found generically as ``model.get_decoder().layers`` (``model.model.layers`` for Qwen2, Llama,
Mistral, Qwen3, ...). Everything else (embedding, final norm, lm_head) belongs to the root FSDP unit. That is
also what keeps tied embeddings right: ``embed_tokens.weight`` and ``lm_head.weight`` are one Parameter, and
``fully_shard`` de-duplicates parameters within a unit, so the shared weight is sharded once and both modules
keep pointing at the same (sharded, later gathered) tensor. Sharding the embedding as its own unit would
split the tie.

With activation checkpointing the wrapper adds ``_checkpoint_wrapped_module.`` to ``named_parameters()``;
``state_dict()`` keys (and torch.distributed.checkpoint) strip it, so read weights by state-dict key.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from fastgrpo.config import ParallelConfig

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def transformer_blocks(model: nn.Module) -> nn.ModuleList:
    """The ModuleList of decoder blocks: ``model.get_decoder().layers``; ValueError naming the model if absent."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", None)
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        raise ValueError(f"{type(model).__name__}: no transformer blocks at get_decoder().layers; "
                         "parallelize_model supports decoder-only HF models laid out like Llama/Qwen2")
    return layers


def _apply_activation_checkpointing(blocks: nn.ModuleList) -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    # Non-reentrant: works with keyword arguments (position_embeddings, masks) and with FSDP2 hooks.
    for i, block in enumerate(blocks):
        blocks[i] = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT)


# Backends that hand the attention host ints of the row's boundaries: each new set would be a guard failure (a
# recompile) in a compiled block, so compiled blocks run the same attention as one registered op on a boundary tensor.
_HOST_BOUNDS_BACKENDS = ("sdpa_varlen", "torch_varlen")
# Backends a captured CUDA graph cannot run: sdpa_varlen reads the row's boundaries on the host without the packed
# forward's host copy (which a captured block does not get), a sync that capture refuses. (torch_varlen takes the
# boundaries as a device tensor and max_seqlen as an int fixed per captured shape.)
_UNCAPTURABLE_BACKENDS = ("sdpa_varlen",)


def _use_varlen_op(model: nn.Module, cfg: ParallelConfig) -> None:
    """Switch to the registered varlen op (boundaries on the device) where compiled blocks or CUDA graphs cannot
    run the configured attention."""
    refused = _HOST_BOUNDS_BACKENDS if cfg.compile else _UNCAPTURABLE_BACKENDS if cfg.cuda_graphs else ()
    if getattr(model.config, "_attn_implementation", None) in refused:
        model.set_attn_implementation("varlen_op")


MAX_BLOCK_GRAPHS = 64
"""Compiled graphs one block's forward may have (dynamo's recompile limit is raised to it): row shapes of a run."""


def compiled_block_forwards(blocks: list[nn.Module], mode: str | None = None) -> list[Callable]:
    """Each block's forward compiled (``fullgraph=True, dynamic=False``, inductor ``mode``), for a runner to put in
    place during its packed passes only (``fastgrpo.distributed.runner``)."""
    # Per block, not the whole model: every block has the same graph, so one compilation serves all (dynamo passes
    # the parameters as inputs). fullgraph: a graph break would split the block and bring back the host dispatch
    # compiling is there to remove. dynamic=False: the packed rows are padded to a few token buckets
    # (parallel.token_buckets), so each bucket is one static-shape graph, reused by every later step.
    # One graph per row shape (bucket, boundary count, max_seqlen; fastgrpo.update.step.plan_step keeps each to a
    # few values), every one an entry of the same code object (all blocks share their forward): past dynamo's
    # default of 8 entries the blocks of a run's later shapes would run eagerly, with only a log line to say so.
    config = torch._dynamo.config
    limit = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    setattr(config, limit, max(getattr(config, limit), MAX_BLOCK_GRAPHS))
    return [torch.compile(block.forward, fullgraph=True, dynamic=False, mode=mode) for block in blocks]


def _sum_gradient_reduction(module: nn.Module) -> None:
    """Make FSDP2 *sum* gradients over ranks instead of averaging them.

    Our loss is sum(w * l) with per-token weights normalised over the GLOBAL batch, so the true gradient is the
    sum of the ranks' gradients. The alternative, multiplying the loss by world_size and letting FSDP average,
    adds a rounding step whenever world_size is not a power of two and hides the invariant in the trainer.
    Divide factor 1.0 + forced SUM gives a plain ReduceOp.SUM reduce-scatter, which NCCL and gloo both support
    (gloo has no PREMUL_SUM/AVG). ``set_gradient_divide_factor`` and ``set_force_sum_reduction_for_comms``
    exist from torch 2.8 (we run 2.11 and 2.13); older versions only have ``set_reduce_scatter_divide_factor``.
    """
    from torch.distributed.fsdp import FSDPModule

    for m in module.modules():
        if not isinstance(m, FSDPModule):
            continue
        if hasattr(m, "set_gradient_divide_factor"):
            m.set_gradient_divide_factor(1.0)
        else:  # pragma: no cover - torch < 2.8
            m.set_reduce_scatter_divide_factor(1.0)
        if hasattr(m, "set_force_sum_reduction_for_comms"):
            m.set_force_sum_reduction_for_comms(True)


def _tied(model: nn.Module) -> bool:
    inp, out = model.get_input_embeddings(), model.get_output_embeddings()
    return out is not None and inp.weight is out.weight


def _apply_fsdp(model: nn.Module, blocks: nn.ModuleList, cfg: ParallelConfig, device: torch.device,
                world_size: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    on_cuda = device.type == "cuda"
    # Sharded (master) parameters keep the dtype they were loaded in (load float32 for true mixed precision);
    # gathered parameters are cast to param_dtype for compute. CPU computes in float32: bf16 matmuls on CPU
    # are slow and gloo reductions of bf16 gain nothing.
    mp = MixedPrecisionPolicy(
        param_dtype=_DTYPES[cfg.param_dtype] if on_cuda else torch.float32,
        reduce_dtype=_DTYPES[cfg.reduce_dtype] if on_cuda else torch.float32,
    )
    # Pinned host memory makes the host-device copies asynchronous; it needs an accelerator to exist.
    offload = CPUOffloadPolicy(pin_memory=on_cuda) if cfg.cpu_offload else OffloadPolicy()
    mesh = init_device_mesh(device.type, (world_size,))
    last = len(blocks) - 1
    for i, block in enumerate(blocks):
        # The last block is not resharded after forward: backward starts with it, so freeing and
        # re-gathering its parameters would be pure waste.
        fully_shard(block, mesh=mesh, mp_policy=mp, offload_policy=offload, reshard_after_forward=i < last)
    # Root unit: embedding, final norm and lm_head (tied or not). FSDP never reshards the root after forward.
    fully_shard(model, mesh=mesh, mp_policy=mp, offload_policy=offload)
    _sum_gradient_reduction(model)


def uses_fsdp(cfg: ParallelConfig, device: torch.device | str, world_size: int) -> bool:
    """FSDP2 applies with several ranks, and with one CUDA rank when ``parallel.one_gpu`` is 'fsdp'."""
    return cfg.fsdp and (world_size > 1 or (torch.device(device).type == "cuda" and cfg.one_gpu == "fsdp"))


def check_parallel(cfg: ParallelConfig, device: torch.device | str, world_size: int) -> None:
    """ValueError naming the setting when ``cfg`` does not fit ``world_size`` processes on ``device`` (the trainer's
    preflight calls it before the model loads, ``parallelize_model`` again)."""
    device = torch.device(device)
    fsdp = uses_fsdp(cfg, device, world_size)
    if cfg.cpu_offload and not fsdp:
        raise ValueError("parallel.cpu_offload needs FSDP: set parallel.fsdp=true (and, on CPU, world size > 1)")
    if cfg.cuda_graphs and (device.type != "cuda" or fsdp):
        raise ValueError(f"parallel.cuda_graphs needs one plain CUDA device (no FSDP2), and this run has {world_size} "
                         f"process(es) on {device.type}; set it to false here")
    if cfg.master_weights and fsdp:
        raise ValueError("parallel.master_weights applies to a plain module (one process, parallel.one_gpu=plain); "
                         "FSDP2 keeps float32 shards and gathers them in param_dtype itself")


def autocast_dtype(cfg: ParallelConfig, device: torch.device | str, world_size: int) -> torch.dtype | None:
    """The dtype a plain (not FSDP2) CUDA module computes in under autocast, or None (no autocast: CPU, FSDP2,
    or ``param_dtype`` float32). Its parameters stay in the dtype they were loaded in (float32 masters)."""
    if torch.device(device).type != "cuda" or uses_fsdp(cfg, device, world_size):
        return None
    return None if cfg.param_dtype == "float32" else _DTYPES[cfg.param_dtype]


def parallelize_model(model: nn.Module, cfg: ParallelConfig, *, device: torch.device | str,
                      world_size: int) -> nn.Module:
    """Apply master weights, activation checkpointing, the varlen switch and FSDP2 per ``cfg`` (module doc); return
    the same (modified) model, which carries no trainer state: packed passes go through a
    :class:`fastgrpo.distributed.runner.ModelRunner` (``prepare_model`` builds both).

    FSDP2 applies per :func:`uses_fsdp` (a process group must exist); with one CPU process the model stays a
    plain module (no collectives, no DTensors) but goes through the same steps otherwise.
    Gradients are SUMMED over ranks (``_sum_gradient_reduction``): weight tokens by global normalisers.
    """
    device = torch.device(device)
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    check_parallel(cfg, device, world_size)
    fsdp = uses_fsdp(cfg, device, world_size)
    tied = _tied(model)
    blocks = transformer_blocks(model)
    if not (fsdp and cfg.cpu_offload):
        model.to(device)  # fully_shard moves parameters itself; with offload they must stay on the host
    if cfg.master_weights:  # compute weights in param_dtype; the optimizer keeps their float32 masters
        model.to(_DTYPES[cfg.param_dtype])
    if cfg.activation_checkpointing:
        _apply_activation_checkpointing(blocks)
    _use_varlen_op(model, cfg)
    if fsdp:
        dist = torch.distributed
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError("FSDP needs an initialised process group "
                             "(fastgrpo.distributed.groups.init_distributed)")
        _apply_fsdp(model, blocks, cfg, device, world_size)
    assert _tied(model) == tied, "parallelize_model must not untie (or tie) the embeddings"
    return model