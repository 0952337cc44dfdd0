"""LoRA through peft: adapters on the policy, the base model as the reference, merged tensors for engines and export.

Legend: H_in / H_out a linear layer's input / output size, r the adapter rank.

With ``model.lora.rank > 0`` the loaded ``*ForCausalLM`` is wrapped by :func:`apply_lora` (``peft.get_peft_model``):
every targeted ``nn.Linear`` becomes a peft ``lora.Linear`` holding the frozen ``base_layer`` and two trainable
matrices ``lora_A`` [r, H_in] and ``lora_B`` [H_out, r]; its output is ``base(x) + scale * B(A(dropout(x)))`` with
``scale = alpha / r``. Everything else in fastgrpo is unchanged:

- ``parallelize_model`` finds the blocks through peft's attribute forwarding (``model.get_decoder()``), so FSDP2
  shards each block's frozen base weights and adapters together, with the same mixed-precision policy;
- the packed forward and the fused head run as before: the head (``lm_head``) is never an adapter target, so the
  kernels see the base ``lm_head.weight``, frozen (``requires_grad=False``);
- the reference policy is the same module with the adapters switched off (:class:`AdapterDisabled`), so
  ``beta > 0`` loads no second model;
- engines with their own copy of the weights (vLLM) and the merged export receive Hugging Face names and merged
  weights ``W + scale * B @ A``, computed one layer at a time (:func:`merged_tensors`). The policy's own weights are
  never merged in place: merging and unmerging float weights would change their bits, and with them the run.
"""

from __future__ import annotations

import contextlib
import importlib.util
from typing import Any, Callable, Iterator

import torch
from torch import nn

from fastgrpo.config import LoraConfig
from fastgrpo.models.policy_state import is_lora, merged_tensors  # noqa: F401  (re-exported: the LoRA API)

__all__ = ["AdapterDisabled", "apply_lora", "check_peft_available", "is_lora", "merged_tensors",
           "trainable_parameters"]

_INSTALL_HINT = "model.lora needs peft, which is not installed: pip install fastgrpo[lora]  (or peft>=0.17)"

def check_peft_available() -> None:
    """Cheap check (no import), run before any model loads: ImportError saying what to install."""
    if importlib.util.find_spec("peft") is None:
        raise ImportError(_INSTALL_HINT)


def apply_lora(model: nn.Module, cfg: LoraConfig) -> nn.Module:
    """Wrap ``model`` in a peft ``PeftModel`` with adapters per ``cfg``; only the adapters require gradients.

    The adapters are created with the current torch RNG (lora_A random, lora_B zero: the wrapped model starts
    exactly equal to the base). Raises ValueError naming ``model.lora.target_modules`` when nothing matches.
    """
    check_peft_available()
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    targets: Any = cfg.target_modules
    if targets == ["all-linear"]:
        targets = "all-linear"  # peft's own shorthand: every nn.Linear but the output layer
    peft_cfg = PeftLoraConfig(r=cfg.rank, lora_alpha=cfg.alpha if cfg.alpha is not None else 2 * cfg.rank,
                              lora_dropout=cfg.dropout, target_modules=targets, bias="none", task_type="CAUSAL_LM",
                              modules_to_save=list(cfg.modules_to_save) or None)
    try:
        peft_model = get_peft_model(model, peft_cfg)
    except ValueError as e:  # peft: "Target modules {...} not found in the base model"
        field = "modules_to_save" if "modules_to_save" in str(e) else "target_modules"
        raise ValueError(f"model.lora.{field}: {e}") from e
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.other import AuxiliaryTrainingWrapper

    if isinstance(peft_model.get_output_embeddings(), BaseTunerLayer):
        raise ValueError("model.lora.target_modules: the output layer (lm_head) cannot take an adapter: the fused "
                         "head kernels read lm_head.weight, which would bypass it")
    wrapped = [n for n, m in peft_model.named_modules() if isinstance(m, AuxiliaryTrainingWrapper)]
    missing = [m for m in cfg.modules_to_save if not any(n.endswith(m) for n in wrapped)]
    if missing:  # peft leaves them out silently
        raise ValueError(f"model.lora.modules_to_save: {missing} matched no module")
    if any(isinstance(m, AuxiliaryTrainingWrapper)
           for m in (peft_model.get_output_embeddings(), peft_model.get_input_embeddings())):
        raise ValueError("model.lora.modules_to_save: the embeddings and lm_head cannot be trained in full here: "
                         "the fused head kernels read lm_head.weight, which would bypass a trained copy")
    if not any(p.requires_grad for p in peft_model.parameters()):
        raise ValueError(f"model.lora.target_modules: {cfg.target_modules} matched no linear layer")
    return peft_model


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters the optimizer updates: the adapters under LoRA, every parameter otherwise."""
    return [p for p in model.parameters() if p.requires_grad]


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """Run ``model`` as its base model: every LoRA layer skips its adapters, and no ``requires_grad`` flag changes.

    Why not peft's ``disable_adapter()``: it also sets the adapters' ``requires_grad`` to False (and back on exit).
    Under FSDP2 the last block stays unsharded after forward, and its unsharded adapter parameters kept the flag
    into the next, training, forward: their gradients came out wrong or missing (caught by the 1-vs-2-rank test).
    So only the layers' disabled switch (peft's ``BaseTunerLayer._disable_adapters``, read by every LoRA forward)
    is flipped.
    """
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.other import AuxiliaryTrainingWrapper

    # AuxiliaryTrainingWrapper: model.lora.modules_to_save, whose forward runs the frozen original when disabled
    layers = [m for m in model.modules() if isinstance(m, (BaseTunerLayer, AuxiliaryTrainingWrapper))]
    if not layers or not all(hasattr(m, "_disable_adapters") for m in layers):
        raise RuntimeError("fastgrpo.models.lora: this peft version has no BaseTunerLayer._disable_adapters switch; "
                           "install peft==0.21.2 (pip install fastgrpo[lora])")
    before = [m._disable_adapters for m in layers]
    for m in layers:
        m._disable_adapters = True
    try:
        yield
    finally:
        for m, was in zip(layers, before):
            m._disable_adapters = was

