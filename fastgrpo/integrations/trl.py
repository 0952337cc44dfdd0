"""``GRPOTrainer``: ``trl.GRPOTrainer`` (TRL >= 1.16) whose policy loss is fastgrpo's fused lm_head + GRPO loss.

    from fastgrpo.integrations.trl import GRPOTrainer     # instead of: from trl import GRPOTrainer
    trainer = GRPOTrainer(model=..., reward_funcs=..., args=GRPOConfig(...), train_dataset=...)

Same constructor, same ``GRPOConfig``, same generation, rewards, advantages, logging and checkpoints; only
``compute_loss`` differs. Shapes: B sequences of the micro-batch, P prompt and C completion positions (TRL's padded
layout), H hidden size, V vocabulary size.

How the loss is formed, and why this way:
  * Hidden states, never logits. At construction, after TRL has patched the model's ``forward`` with its own fused
    head, one more keyword is added beside TRL's ``fused_lm_head``: ``fastgrpo_head``. Given it, ``forward`` runs
    the decoder (``model.base_model``) only and returns what that callable makes of the last hidden state and the
    lm_head. ``compute_loss`` calls the model TRL hands it, the wrapped one, so DDP's and FSDP2's forward hooks run
    around the whole loss as they do around TRL's call; PEFT passes the keyword through as it passes TRL's. The
    state before completion token t is at position P + t - 1.
  * The lm_head as it is: a DTensor weight (FSDP2) is gathered with ``full_tensor()`` (its gradient is
    reduce-scattered back), the bias goes to the kernel, ``cast_lm_head_to_fp32`` runs the head in float32, and
    otherwise the weight takes the hidden states' dtype (autocast's choice for a matmul); the kernel itself runs
    with autocast off.
  * TRL's normaliser per loss type becomes a per-token weight (the ``trl`` column of the loss-type table,
    ``fastgrpo.kernels.loss_types.LOSS_TYPES``, beside the policy term): per micro-batch, divided by the
    gradient-accumulation steps, dapo/cispo by ``num_items_in_batch`` as TRL rescales it. The loss's settings are
    one ``LossSettings`` built from TRL's at each call.
  * The entropy mask, the off-policy sequence mask and the vLLM importance ratio multiply the policy term's weight
    only; the KL term keeps the plain weight (``kl_token_weights``), as in TRL. The masks are recomputed at every
    call, so at every one of the ``num_iterations`` passes, as TRL does: a no-grad log-prob + entropy pass of the
    fused head first (``padded_logprobs``), then TRL's own ``get_high_entropy_mask`` / ``get_off_policy_mask``.
  * Metrics under TRL's names (``entropy``, ``kl``, ``clip_ratio/*``, ``cispo_clip_ratio``), from the log-probs
    the loss computed, with TRL's reductions across processes.

TRL options this cannot serve raise a one-line ValueError at construction naming the option (``_refuse``): the
vespo loss, the entropy bonus, an MoE router loss, a logit soft-cap or scale, a PEFT adapter on the lm_head,
DeepSpeed ZeRO-3. Vision inputs are refused at the first loss call.
"""

from __future__ import annotations

import functools
import inspect
import types
from typing import Callable

import torch

try:
    import trl
    from trl.trainer.utils import nanmax, nanmin
except ImportError as exc:  # pragma: no cover - exercised in a subprocess by the tests
    raise ImportError("fastgrpo.integrations.trl needs TRL >= 1.16: pip install fastgrpo[trl]") from exc

from fastgrpo.kernels.loss_types import LOSS_TYPES, BatchCounts
from fastgrpo.kernels.module import padded_grpo_loss, padded_logprobs
from fastgrpo.kernels.settings import LossSettings
from fastgrpo.kernels.terms import clip_masks

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - torch without the distributed package
    DTensor = ()

__all__ = ["GRPOTrainer"]



def _dapo_count(trainer, mask, inputs):
    """dapo / cispo's token count: ``num_items_in_batch`` (the generation batch's) per process and per accumulation
    window, as TRL rescales it."""
    count = inputs["num_items_in_batch"].clamp(min=1.0) / trainer.accelerator.num_processes
    if trainer.model.training:
        count = count * trainer.current_gradient_accumulation_steps / trainer.args.steps_per_generation
    return count.to(mask.device, torch.float32)


def _trl_version_ok() -> bool:
    major, minor = (int(p) for p in trl.__version__.split(".")[:2])
    return (major, minor) >= (1, 16)


if not _trl_version_ok():  # pragma: no cover
    raise ImportError(f"fastgrpo.integrations.trl needs TRL >= 1.16, found {trl.__version__}: "
                      "pip install fastgrpo[trl]")


def _refuse_config(args) -> None:
    """One-line ValueError for a GRPOConfig option the fused loss cannot serve (never a silent difference)."""
    served = [name for name, row in LOSS_TYPES.items() if row.trl is not None]
    if args.loss_type not in served:
        raise ValueError(f"loss_type={args.loss_type!r} is not served by fastgrpo's GRPOTrainer "
                         f"(served: {', '.join(served)})")
    if args.entropy_coef != 0.0 or args.use_adaptive_entropy:
        raise ValueError("entropy_coef / use_adaptive_entropy is not served by fastgrpo's GRPOTrainer: the fused "
                         "head does not differentiate the entropy")


class GRPOTrainer(trl.GRPOTrainer):
    """``trl.GRPOTrainer`` with fastgrpo's fused lm_head + GRPO loss (module docstring). Same arguments."""

    def __init__(self, *args, **kwargs):
        bound = _bind_trainer_args(args, kwargs)
        if bound.get("args") is not None:
            _refuse_config(bound["args"])  # before the model loads
        super().__init__(*args, **kwargs)
        _refuse_config(self.args)
        target = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        _refuse_model(self, target)
        _add_hidden_forward(target)

    # ------------------------------------------------------------------------------------------ the loss

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if return_outputs:
            raise ValueError("The GRPOTrainer does not support returning outputs")
        for key in ("pixel_values", "image_grid_thw", "pixel_attention_mask"):
            if inputs.get(key) is not None:
                raise ValueError(f"{key}: vision inputs are not served by fastgrpo's GRPOTrainer")
        prompt_ids, completion_ids = inputs["prompt_ids"], inputs["completion_ids"]  # [B, P], [B, C]
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)  # [B, P + C]
        attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)  # [B, P + C]
        mask = inputs["completion_mask"]  # [B, C]
        if "tool_mask" in inputs:
            mask = mask * inputs["tool_mask"]
        head = functools.partial(self._fused_head, inputs=inputs, mask=mask.float(), start=prompt_ids.shape[1] - 1)
        with self.accelerator.autocast():
            loss, stats = model(input_ids=input_ids, attention_mask=attention_mask, fastgrpo_head=head)
        self._log_loss_metrics(inputs, mask.float(), stats)
        return loss

    def _fused_head(self, hidden_states, lm_head, *, inputs, mask, start):
        """Run inside the model's forward: the loss and its stats from the decoder's last hidden state."""
        hidden = hidden_states[:, start:start + mask.shape[1]]  # [B, C, H]
        weight, bias = lm_head.weight, lm_head.bias  # [V, H], [V] or None
        if isinstance(weight, DTensor):
            weight = weight.full_tensor()
            bias = bias.full_tensor() if bias is not None else None
        hidden = hidden.to(weight.device)
        # The head's dtype is decided here, once; the kernel then runs with autocast off (it keeps its own float32
        # accumulations, which an active autocast would turn into bf16 matmuls).
        dtype = torch.float32 if self.args.cast_lm_head_to_fp32 else hidden.dtype
        hidden, weight = hidden.to(dtype), weight.to(dtype)
        bias = bias.to(dtype) if bias is not None else None
        with torch.autocast(hidden.device.type, enabled=False):
            return self._fused_loss(hidden, weight, bias, inputs, mask)

    def _fused_loss(self, hidden, weight, bias, inputs, mask):
        """TRL's ``_compute_loss`` objective on ``hidden [B, C, H]``, as token weights for the fused kernel."""
        targets = inputs["completion_ids"]  # [B, C]
        advantages = inputs["advantages"]  # [B] or [B, C]
        old = inputs.get("old_per_token_logps")  # [B, C] or None (then: the current log-probs, r == 1)
        weights = self._loss_weights(mask, inputs)  # [B, C]: the KL term's weight
        policy_weights = weights  # [B, C]: times the masks and the ratio below
        entropy = None
        if self.top_entropy_quantile < 1.0 or self.off_policy_mask_threshold is not None:
            with torch.no_grad():  # the current policy's log-probs and entropies: the masks depend on them
                logp_now, entropy = padded_logprobs(hidden.detach(), weight.detach(), targets, mask,
                                                    bias=None if bias is None else bias.detach(),
                                                    temperature=self.temperature, return_entropy=True)
            if self.top_entropy_quantile < 1.0:
                policy_weights = policy_weights * self.get_high_entropy_mask(entropy, mask,
                                                                             1 - self.top_entropy_quantile)
            if self.off_policy_mask_threshold is not None:
                behaviour = logp_now if old is None else old
                adv = advantages[:, None] if advantages.dim() == 1 else advantages
                policy_weights = policy_weights * self.get_off_policy_mask(
                    advantages=adv, per_token_logps=logp_now,
                    sampling_per_token_logps=inputs.get("sampling_per_token_logps", behaviour), mask=mask,
                    off_policy_threshold=self.off_policy_mask_threshold)
        if self.use_vllm and self.vllm_importance_sampling_correction:
            policy_weights = policy_weights * inputs["importance_sampling_ratio"]
        loss, stats = padded_grpo_loss(
            hidden, weight, targets, mask, advantages, policy_weights, self._loss_settings(),
            kl_token_weights=weights, old_logprobs=old,
            ref_logprobs=inputs["ref_per_token_logps"] if self.beta != 0.0 else None, bias=bias,
            return_entropy=entropy is None)
        if entropy is not None:
            stats["entropy"] = entropy
        return loss, stats

    def _loss_settings(self) -> LossSettings:
        """The loss's settings from TRL's, as the trainer holds them (its constructor sets them from the
        ``GRPOConfig``; ``LossSettings`` checks them)."""
        return LossSettings(
            policy_loss=LOSS_TYPES[self.loss_type].term, epsilon_low=self.epsilon_low,
            # delta clamps the clip term's ratio only; the other terms never read it
            epsilon_high=self.epsilon_high, delta=self.args.delta, beta=self.beta,
            sapo_temperature_pos=self.args.sapo_temperature_pos, sapo_temperature_neg=self.args.sapo_temperature_neg,
            use_bias_correction_kl=self.args.use_bias_correction_kl,
            importance_sampling_level=self.importance_sampling_level, temperature=self.temperature)

    def _loss_weights(self, mask, inputs):
        """``[B, C]``: each token's weight under TRL's normaliser of ``self.loss_type`` (the ``trl`` column of
        ``LOSS_TYPES``), over the micro-batch times the accumulation steps in training."""
        accumulation = self.current_gradient_accumulation_steps if self.model.training else 1
        counts = BatchCounts(num_sequences=mask.shape[0] * accumulation, num_tokens=mask.sum() * accumulation,
                             max_completion_length=self.max_completion_length,
                             global_tokens_of=lambda: _dapo_count(self, mask, inputs))
        return mask * LOSS_TYPES[self.loss_type].trl(mask.sum(-1), counts)[:, None]

    # --------------------------------------------------------------------------------------- metrics

    @torch.no_grad()
    def _log_loss_metrics(self, inputs, mask, stats):
        """TRL's per-call metrics under its names, from the log-probs the loss computed (``[B, C]``)."""
        metrics = self._metrics["train" if self.model.training else "eval"]
        logp = stats["logprobs"]
        old = inputs.get("old_per_token_logps")
        log_ratio = logp - old if old is not None else torch.zeros_like(logp)
        if self.importance_sampling_level == "sequence":
            log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0))[:, None]  # [B, 1]
        ratio = torch.exp(log_ratio)  # [B, C] or [B, 1]
        advantages = inputs["advantages"]
        adv = advantages[:, None] if advantages.dim() == 1 else advantages

        def masked_mean(x):  # over the tokens of all processes; [B, 1] values count once per sequence
            if x.shape[1] == 1:
                local = torch.stack([x.sum(), torch.tensor(float(x.shape[0]), device=x.device)])
            else:
                local = torch.stack([(x * mask).sum(), mask.sum()])
            total = self.accelerator.reduce(local, reduction="sum")
            return (total[0] / total[1].clamp(min=1.0)).item()

        def per_sequence(x):  # [B]
            return x[:, 0] if x.shape[1] == 1 else (x * mask).sum(-1) / mask.sum(-1)

        if self.beta != 0.0:
            diff = inputs["ref_per_token_logps"] - logp
            kl = torch.exp(diff) - diff - 1
            metrics["kl"].append(masked_mean(kl * ratio if self.args.use_bias_correction_kl else kl))
        metrics["entropy"].append(masked_mean(stats["entropy"]))
        term = LOSS_TYPES[self.loss_type].term
        low, high = (x.float() for x in clip_masks(term, ratio, adv, epsilon_low=self.epsilon_low,
                                                    epsilon_high=self.epsilon_high))
        _CLIP_METRICS[term](metrics, masked_mean, lambda x: self.accelerator.gather(per_sequence(x)), low, high)


def _log_clip_ratios(metrics, masked_mean, gathered, low, high) -> None:
    metrics["clip_ratio/low_mean"].append(masked_mean(low))
    metrics["clip_ratio/high_mean"].append(masked_mean(high))
    metrics["clip_ratio/region_mean"].append(masked_mean(torch.maximum(low, high)))
    metrics["clip_ratio/low_min"].append(nanmin(gathered(low)).item())
    metrics["clip_ratio/high_max"].append(nanmax(gathered(high)).item())


_CLIP_METRICS: dict[str, Callable] = {
    "clip": _log_clip_ratios,
    "cispo": lambda metrics, masked_mean, gathered, low, high: metrics["cispo_clip_ratio"].append(masked_mean(high)),
    "sapo": lambda *_: None,  # a smooth gate: TRL logs no clip ratio
}
"""The kernel's policy term -> TRL's clip metrics of it (``clip_masks``'s regions, under TRL's names)."""


def _bind_trainer_args(args, kwargs) -> dict:
    """The constructor's arguments by name (``args`` is the GRPOConfig), without calling it."""
    try:
        return inspect.signature(trl.GRPOTrainer.__init__).bind(None, *args, **kwargs).arguments
    except TypeError:
        return {}  # TRL's own constructor reports the mistake


def _refuse_model(trainer, model) -> None:
    """One-line ValueError for a model or set-up the fused head cannot serve."""
    if trainer.aux_loss_enabled:
        raise ValueError("router_aux_loss_coef: the MoE load-balancing loss is not served by fastgrpo's "
                         "GRPOTrainer; set it to 0")
    text = model.config.get_text_config()
    for name in ("final_logit_softcapping", "logit_scale", "output_multiplier", "lm_head_multiplier",
                 "logits_scaling"):
        if getattr(text, name, None) not in (None, 1.0):
            raise ValueError(f"{name}: a scaled or soft-capped lm_head is not served by fastgrpo's GRPOTrainer")
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear):
        raise ValueError(f"the lm_head ({type(head).__name__}) is not a plain nn.Linear (a PEFT adapter on it?): "
                         "not served by fastgrpo's GRPOTrainer")
    if trainer.is_deepspeed_enabled and trainer.accelerator.state.deepspeed_plugin.zero_stage == 3:
        raise ValueError("DeepSpeed ZeRO-3 is not served by fastgrpo's GRPOTrainer; use FSDP2")


def _add_hidden_forward(model) -> None:
    """Give ``model.forward`` (already TRL's fused-head forward) the keyword ``fastgrpo_head``: with it, run the
    decoder only and return ``fastgrpo_head(last_hidden_state [B, S, H], lm_head)``; without it, as before."""
    previous = model.forward

    @functools.wraps(type(model).forward)  # generate() checks model kwargs against this signature
    def forward(self, *args, fastgrpo_head=None, **kwargs):
        if fastgrpo_head is None:
            return previous(*args, **kwargs)
        for key in ("labels", "return_dict", "output_attentions", "output_hidden_states"):
            kwargs.pop(key, None)  # PEFT passes these (as None); the decoder needs none of them
        kwargs["use_cache"] = False
        # the backbone and the head are looked up per call: FSDP2 and PEFT replace them after construction
        hidden = self.base_model(*args, **kwargs).last_hidden_state  # [B, S, H]
        return fastgrpo_head(hidden, self.get_output_embeddings())

    model.forward = types.MethodType(forward, model)
