"""The policy's weights as a Hugging Face model sees them: full tensors under Hugging Face names, and for a LoRA
policy the base model's names with the adapters merged in.

Checkpoints (the merged export), LoRA and the rollout engines' weight sync all read the policy this way, so this
module sits below all of them and imports none of them. Gathering is one parameter at a time: under FSDP2
``DTensor.full_tensor()`` is a collective, so every rank iterates the same model in the same order.

Legend: H_in / H_out a linear layer's input / output size, r the adapter rank.
"""

from __future__ import annotations

import re
from typing import Iterable, Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor

__all__ = ["clean_param_name", "hf_name", "is_lora", "iter_full_tensors", "iter_policy_tensors", "merged_tensors"]

# Wrappers that insert a level into parameter names but not into the checkpoint's names.
_WRAPPER_PARTS = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")

# The parts peft adds to a parameter's name: the wrapper prefix and the frozen layer inside a LoRA layer.
_PEFT_PREFIX = "base_model.model."
_BASE_LAYER = ".base_layer"
# model.lora.modules_to_save: peft's trained copy (``model.norm.modules_to_save.default.weight``) and the frozen
# original it keeps for the reference (``model.norm.original_module.weight``)
_SAVED = re.compile(r"\.modules_to_save\.[^.]+\.")
_ORIGINAL = ".original_module."


def clean_param_name(name: str) -> str:
    """The Hugging Face name of a parameter seen through activation-checkpointing / compile wrappers."""
    for part in _WRAPPER_PARTS:
        name = name.replace(part, "")
    return name


def is_lora(model: nn.Module) -> bool:
    """Whether ``model`` is a peft-wrapped policy (also after ``parallelize_model``)."""
    return hasattr(model, "peft_config") and hasattr(model, "disable_adapter")


def iter_full_tensors(model: nn.Module, *, dtype: torch.dtype | None = None
                      ) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, full_tensor)`` for every parameter of ``model``, one at a time.

    FSDP2 shards are all-gathered with ``DTensor.full_tensor()`` (so every rank must consume the iterator in
    lock-step); plain tensors are yielded as they are (detached, no copy). ``dtype`` casts each tensor as it
    is gathered, so a float32 master copy streams as bfloat16 to a bfloat16 engine at half the bytes.
    Tied parameters (``lm_head.weight`` is ``embed_tokens.weight``) appear once, under their first name, as
    ``named_parameters`` reports them.
    """
    for name, param in model.named_parameters():
        t = param.detach()
        if isinstance(t, DTensor):
            t = t.full_tensor()
        if dtype is not None:
            t = t.to(dtype)
        yield clean_param_name(name), t


def iter_policy_tensors(model: nn.Module, *, dtype: torch.dtype | None = None
                        ) -> Iterator[tuple[str, torch.Tensor]]:
    """The policy as a Hugging Face model sees it: :func:`iter_full_tensors`, and for a LoRA model the base
    names with the adapters merged in, one layer at a time (:func:`merged_tensors`)."""
    if not is_lora(model):
        yield from iter_full_tensors(model, dtype=dtype)
        return
    for name, t in merged_tensors(model, iter_full_tensors(model)):
        yield name, t if dtype is None else t.to(dtype)


def hf_name(name: str) -> str:
    """A peft parameter name -> the base model's Hugging Face name (``...q_proj.base_layer.weight`` ->
    ``...q_proj.weight``, ``model.norm.modules_to_save.default.weight`` -> ``model.norm.weight``). Adapter names
    (``lora_A``/``lora_B``) are returned with the prefix removed only."""
    if name.startswith(_PEFT_PREFIX):
        name = name[len(_PEFT_PREFIX):]
    return _SAVED.sub(".", name.replace(_BASE_LAYER + ".", "."))


def _lora_layers(model: nn.Module) -> dict[str, nn.Module]:
    """Hugging Face module name (``model.layers.0.self_attn.q_proj``) -> its peft LoRA layer."""
    from peft.tuners.lora import LoraLayer

    return {hf_name(clean_param_name(n)): m for n, m in model.named_modules() if isinstance(m, LoraLayer)}


def merged_tensors(model: nn.Module, named_tensors: Iterable[tuple[str, torch.Tensor]]
                   ) -> Iterator[tuple[str, torch.Tensor]]:
    """Turn a stream of a LoRA model's ``(name, full tensor)`` (:func:`iter_full_tensors`) into the base
    model's Hugging Face names and merged weights: ``W + scale * B @ A`` for each adapted layer, other tensors
    unchanged.

    A layer's frozen weight is held until its two adapter matrices arrive (peft registers them right after it), so
    at most one layer's tensors are held; the merged weight is a new tensor, computed in float32 and cast back.
    """
    layers = _lora_layers(model)
    held: dict[str, dict[str, torch.Tensor]] = {}  # module name -> {"W": .., "A": .., "B": ..}
    for name, t in named_tensors:
        if _ORIGINAL in name:  # the frozen original of a module trained in full: the engine gets the trained copy
            continue
        name = hf_name(name)
        module, _, leaf = name.rpartition(".")
        if ".lora_A." in name or ".lora_B." in name:
            module = name.split(".lora_")[0]
            held.setdefault(module, {})["A" if ".lora_A." in name else "B"] = t
        elif leaf == "weight" and module in layers:
            held.setdefault(module, {})["W"] = t
        else:
            yield name, t
            continue
        parts = held[module]
        if len(parts) == 3:
            del held[module]
            layer = layers[module]
            (adapter,) = layer.active_adapters
            scale = layer.scaling[adapter]
            w = parts["W"]
            delta = parts["B"].float() @ parts["A"].float()  # [H_out, r] @ [r, H_in]
            yield f"{module}.weight", (w.float() + scale * delta).to(w.dtype)
    if held:
        raise ValueError(f"LoRA merge: layers {sorted(held)} lack their weight or an adapter matrix")
