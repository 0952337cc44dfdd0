"""The value model of PPO (``algorithm: ppo``): a causal LM's trunk with a scalar value head in place of its lm_head.

Legend: N completion tokens (flat layout), n those of one micro-batch, H hidden size.

The critic is loaded like the policy (:func:`fastgrpo.models.loading.load_model`, from ``ppo.critic_init`` or the policy's
``model.name_or_path``), and its output layer is replaced by ``value_head``, an ``nn.Linear(H, 1, bias=False)``:
``get_output_embeddings()`` then returns the value head, so everything written for the policy runs unchanged on the
critic. ``prepare_model`` shards it the same way (the head joins the root FSDP unit, as lm_head does),
its runner's ``packed_forward(mb, head)`` hands ``head`` the hidden states of the packed row's completion positions and the
value head's weight ``[1, H]`` (gathered under FSDP2), and checkpoints hold it like any parameter. With tied
embeddings (Qwen2.5-0.5B..3B) the embedding stays as it was and the tie is cut: the value head is its own weight.

Which position's value: token t of a completion is predicted from the hidden state at the position before it
(``MicroBatch.hidden_index``), i.e. the state in which token t is chosen. ``V_t`` is the value of that state, so
values, log-probs and advantages share the flat layout of the step (as oat's critic, whose value at position p is
sliced ``[:, :-1]`` against the response mask ``[:, 1:]``).

The head starts at ``N(0, 1 / (H + 1))`` (oat's and OpenRLHF's initialisation): values near 0 at first, whatever the
trunk's hidden-state scale. The draw uses a private generator, so the trainer's RNG stream is not consumed.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from fastgrpo.algorithms.interface import ModelSetup
from fastgrpo.config import LoraConfig, ModelConfig
from fastgrpo.distributed.parallelize import uses_fsdp
from fastgrpo.distributed.runner import ModelRunner, as_runner
from fastgrpo.models.lora import apply_lora, check_peft_available
from fastgrpo.models.loading import load_model
from fastgrpo.models.packing import MicroBatch
from fastgrpo.update.bundle import TrainedModel, build_trained

__all__ = ["apply_critic_lora", "attach_value_head", "build_critic", "is_value_model", "load_critic", "packed_values",
           "value_head_forward"]


def attach_value_head(model: nn.Module, *, seed: int = 0) -> nn.Module:
    """Replace ``model``'s output layer by a scalar value head (``nn.Linear(H, 1, bias=False)``, ``N(0, 1/(H+1))``
    from a generator seeded by ``seed``); returns ``model``. A tied lm_head is untied (the embedding is kept)."""
    head = model.get_output_embeddings()
    if head is None or getattr(head, "weight", None) is None:
        raise ValueError(f"{type(model).__name__} has no output layer to replace with a value head")
    hidden = head.weight.shape[1]
    value_head = nn.Linear(hidden, 1, bias=False, device=head.weight.device, dtype=head.weight.dtype)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        value_head.weight.copy_(torch.randn((1, hidden), generator=g) / (hidden + 1))
    model.set_output_embeddings(value_head)
    text_cfg = model.config.get_text_config()
    text_cfg.tie_word_embeddings = False  # nothing may tie the embedding back onto the value head
    model.config.tie_word_embeddings = False
    return model


def is_value_model(model: nn.Module) -> bool:
    """Whether ``model``'s output layer is a scalar value head (:func:`attach_value_head`)."""
    head = model.get_output_embeddings()
    return head is not None and tuple(head.weight.shape)[0] == 1


def load_critic(cfg: ModelConfig, *, init: str | None, device: torch.device | str,
                dtype: str | torch.dtype | None = None, seed: int = 0) -> nn.Module:
    """The critic, not yet parallelized: ``init`` (a registered name, folder or hub id; None = ``cfg.name_or_path``)
    loaded as a causal LM, its output layer replaced by a value head; with ``cfg.lora`` enabled, adapters on its
    trunk and a trainable value head (only they reach the critic's optimizer and checkpoints)."""
    if cfg.lora.enabled:
        check_peft_available()
    # a critic_init folder is its own model: the policy's GGUF file name (model.gguf_file) does not apply to it
    source = dataclasses.replace(cfg, name_or_path=init or cfg.name_or_path, gguf_file=None if init else cfg.gguf_file)
    try:
        loaded = load_model(source, device=device, dtype=dtype, seed=seed)
    except (ValueError, OSError) as e:  # the loader names model.name_or_path; here the folder is ppo.critic_init's
        if init is None:
            raise
        text = str(e)
        raise ValueError(f"ppo.critic_init: {text.removeprefix('model.name_or_path: ')}"
                         if text.startswith("model.name_or_path") else f"ppo.critic_init={init!r}: {text}") from None
    model = attach_value_head(loaded, seed=seed + 1)
    return apply_critic_lora(model, cfg.lora) if cfg.lora.enabled else model


def build_critic(setup: ModelSetup, *, total_steps: int) -> TrainedModel:
    """PPO's critic (:func:`load_critic`), parallelized like the policy, with its own AdamW (ppo.critic_lr; optim's
    betas, weight decay, warm-up and schedule over ``total_steps`` updates) and non-finite guard."""
    cfg = setup.cfg
    critic = load_critic(cfg.model, init=cfg.ppo.critic_init, device=setup.device, dtype=setup.dtype, seed=cfg.seed)
    if cfg.model.lora.enabled and not uses_fsdp(cfg.parallel, setup.device, setup.world_size):
        # the new value head trains in full: float32 like any master weight (a frozen bfloat16 base needs no
        # masters, but lr ~ 1e-6 updates of a bfloat16 head would vanish); under FSDP2 the model is float32
        # already, or all bfloat16 by model.dtype (FSDP2 shards one dtype per unit)
        critic.get_output_embeddings().float()
    return build_trained(critic, parallel=cfg.parallel, optim=cfg.optim, device=setup.device,
                         world_size=setup.world_size, total_steps=total_steps, lr=cfg.ppo.critic_lr)


def apply_critic_lora(model: nn.Module, cfg: LoraConfig) -> nn.Module:
    """Adapters on a value model's trunk (:func:`fastgrpo.models.lora.apply_lora`) and a trainable value head: peft
    freezes every base weight, the new head included, which has no pretrained value to keep."""
    model = apply_lora(model, cfg)
    model.get_output_embeddings().weight.requires_grad_(True)
    return model


def value_head_forward(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Values [n] float32 from hidden states [n, H] and the value head's weight [1, H] (computed in float32: one
    column, so its cost is nothing beside the trunk's)."""
    return (hidden.float() @ weight.float().t()).squeeze(-1)  # [n]


@torch.no_grad()
def packed_values(critic: ModelRunner | nn.Module, mbs: list[MicroBatch], num_tokens: int) -> torch.Tensor:
    """The critic's values [N] float32 of every completion token's state, in the step's flat layout (``critic``: its
    runner, or the module run by a default one)."""
    critic = as_runner(critic)
    device = mbs[0].targets.device if mbs else "cpu"
    out = torch.zeros(num_tokens, dtype=torch.float32, device=device)  # [N]
    for mb in mbs:
        out[mb.flat_index] = critic.packed_forward(mb, value_head_forward)
    return out
