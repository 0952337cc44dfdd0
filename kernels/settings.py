"""``LossSettings``: the settings of the GRPO-family policy loss, one typed object checked once when built.

The trainer builds it from its config (``fastgrpo.config.GRPOConfig.loss_settings``), the TRL adapter from TRL's
``GRPOConfig``, ``FusedLinearGRPOLoss`` from Liger's constructor options, and ``linear_grpo_loss`` from its keyword
arguments; each passes it unchanged to the kernel (``grpo_loss.fused_grpo_loss``), which hands it to
``objective.TokenObjective`` with the per-row tensors of one call. A bad value raises ``LossSettingError``, a
``ValueError`` whose ``field`` names the setting, so a config can report it under its own key.
"""

from __future__ import annotations

from dataclasses import dataclass

from .terms import POLICY_LOSSES

__all__ = ["IMPORTANCE_SAMPLING_LEVELS", "LossSettingError", "LossSettings"]

IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
"""``"token"``: one ratio per token (GRPO); ``"sequence"``: the sequence's ``exp(mean(logp - old))`` (GSPO)."""


class LossSettingError(ValueError):
    """A bad ``LossSettings`` value: ``field`` is the setting, ``reason`` what is wrong with it; the message is
    ``"<field> <reason>"`` unless given (a check of a pair of settings names both)."""

    def __init__(self, field: str, reason: str, message: str | None = None):
        super().__init__(message or f"{field} {reason}")
        self.field, self.reason = field, reason


@dataclass(frozen=True)
class LossSettings:
    """What the policy loss is, apart from the per-token tensors of a call (``objective.py`` writes out the maths)."""

    policy_loss: str = "clip"
    """The per-token policy term, a key of ``objective.POLICY_LOSSES``: "clip", "cispo" or "sapo"."""
    epsilon_low: float = 0.2
    """Lower clip range of the ratio: ``r >= 1 - epsilon_low`` ("clip")."""
    epsilon_high: float = 0.2
    """Upper clip range of the ratio: ``r <= 1 + epsilon_high`` ("clip"); "cispo": the truncation bound itself,
    ``min(r, epsilon_high)`` (TRL's eps_max; ScaleRL recommends 5.0)."""
    delta: float | None = None
    """Upper clamp of the unclipped ratio (two-sided clipping, "clip"); None disables it."""
    beta: float = 0.0
    """Weight of the k3 KL penalty towards the reference model (0: no KL term, no reference needed)."""
    sapo_temperature_pos: float = 1.0
    """"sapo": gate temperature of tokens with positive advantage (TRL's default)."""
    sapo_temperature_neg: float = 1.05
    """"sapo": gate temperature of tokens with advantage <= 0 (TRL's default)."""
    use_bias_correction_kl: bool = False
    """Multiply k3 by the (differentiable) ratio r, as TRL's ``use_bias_correction_kl``."""
    importance_sampling_level: str = "token"
    """One of ``IMPORTANCE_SAMPLING_LEVELS``; at "sequence" a call numbers its rows by sequence."""
    temperature: float = 1.0
    """The logits are divided by it (the sampler's temperature); checked where the logits are scaled."""

    def __post_init__(self):
        if self.policy_loss not in POLICY_LOSSES:
            raise LossSettingError("policy_loss", f"must be one of {sorted(POLICY_LOSSES)}, got {self.policy_loss!r}")
        if self.importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
            raise LossSettingError("importance_sampling_level", f"must be 'token' or 'sequence', got "
                                                                f"{self.importance_sampling_level!r}")
        _each_at_least(self, ("epsilon_low", "epsilon_high"), 0.0, strict=False)
        if not self.beta >= 0:
            raise LossSettingError("beta", f"must be >= 0, got {self.beta}")
        if POLICY_LOSSES[self.policy_loss].bound_is_epsilon_high and not self.epsilon_high > 0:
            raise LossSettingError("epsilon_high", f"must be > 0: policy_loss {self.policy_loss!r} truncates the "
                                                   f"ratio at epsilon_high (TRL recommends 5.0), got "
                                                   f"{self.epsilon_high}")
        if self.delta is not None and not self.delta > 0:
            raise LossSettingError("delta", f"must be > 0 (TRL recommends > 1 + epsilon_high), got {self.delta}")
        _each_at_least(self, ("sapo_temperature_pos", "sapo_temperature_neg"), 0.0, strict=True)

    @property
    def sequence_level(self) -> bool:
        """Whether the ratio is the sequence's (GSPO)."""
        return self.importance_sampling_level == "sequence"


def _each_at_least(settings: LossSettings, pair: tuple[str, str], bound: float, *, strict: bool) -> None:
    """LossSettingError naming the first of ``pair`` that is not ``> bound`` (``strict``) or ``>= bound``."""
    values = [getattr(settings, name) for name in pair]
    for name, value in zip(pair, values):
        if not (value > bound if strict else value >= bound):
            need = f"must be {'>' if strict else '>='} {bound:g}"
            raise LossSettingError(name, f"{need}, got {value}",
                                   f"{' / '.join(pair)} {need}, got {', '.join(map(str, values))}")
