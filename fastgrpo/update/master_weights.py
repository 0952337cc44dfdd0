"""bf16 compute weights with float32 masters (``parallel.master_weights``): AdamW whose parameters are the model's
low-precision weights and whose state holds a float32 master of each.

Why: with float32 weights under autocast (the default on one plain GPU) every forward casts every weight to bf16
again, and the casts dominate the host's dispatch of a small model's update (issue 38: 981 ``_to_copy`` and 1,322
``copy_`` in one update of Qwen2.5-0.5B). Here the forward and backward run on bf16 parameters with no autocast; the
optimizer keeps the float32 masters (TE's ``FusedAdam(master_weights=True)``, Megatron's distributed optimizer) and
per step (1) copies the bf16 gradients into float32 master gradients with one multi-tensor op, (2) runs AdamW on the
masters, (3) writes the bf16 weights from the masters with one multi-tensor op.

AdamW (decoupled weight decay, as ``torch.optim.AdamW``), per step t on master w, gradient g:
    w <- w (1 - lr wd);  m <- b1 m + (1 - b1) g;  v <- b2 v + (1 - b2) g^2
    w <- w - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
``fused`` runs it as torch's fused AdamW kernel (one pass per chunk of tensors), ``foreach`` as multi-tensor ops.

The state of parameter p is ``step``, ``exp_avg``, ``exp_avg_sq`` (float32) and ``master`` (float32), keyed by p like
any torch optimizer's, so ``state_dict`` and torch.distributed.checkpoint save and reshard it by the parameter's
name; :meth:`MasterAdamW.load_state_dict` keeps the float32 entries float32 (torch casts a floating state tensor to
its parameter's dtype on load, which would round the masters to bf16).

``clip_grad_norm_`` runs on the float32 master gradients (:func:`gradients_for_clipping`), not on the bf16 ones.
"""

from __future__ import annotations

import math
from typing import Iterable

import torch

__all__ = ["FLOAT32_STATE", "MasterAdamW", "gradients_for_clipping"]

FLOAT32_STATE = ("step", "exp_avg", "exp_avg_sq", "master")
"""State entries kept in float32 whatever the parameter's dtype (copied on load: a step counter shared with the
saved optimizer would advance twice)."""


class MasterAdamW(torch.optim.Optimizer):
    """AdamW on float32 masters of the (bf16) parameters it is given (module doc). Same hyper-parameters as
    ``torch.optim.AdamW``; ``implementation`` 'fused' or 'foreach' (how it runs, not what it computes)."""

    def __init__(self, params: Iterable[torch.nn.Parameter], *, lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 implementation: str = "foreach") -> None:
        if implementation not in ("fused", "foreach"):
            raise ValueError(f"MasterAdamW: implementation must be fused or foreach, got {implementation!r}")
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay,
                                  "implementation": implementation})
        self._moved = False  # master gradients already hold this update's gradients

    def _params_with_grads(self, group: dict) -> list[torch.nn.Parameter]:
        return [p for p in group["params"] if p.grad is not None]

    def _init_state(self, p: torch.nn.Parameter) -> dict:
        state = self.state[p]
        if "master" not in state:  # first step, or moments loaded from a plain AdamW's checkpoint: keep them
            master = p.detach().to(torch.float32, copy=True)
            state["master"] = master
            state.setdefault("step", torch.zeros((), dtype=torch.float32, device=p.device))
            for key in ("exp_avg", "exp_avg_sq"):
                state[key] = state[key].float() if key in state else torch.zeros_like(master)
        if state["master"].grad is None:  # the float32 gradient buffer (not saved: a checkpoint has no gradients)
            state["master"].grad = torch.zeros_like(state["master"])
        return state

    @torch.no_grad()
    def gradients_to_masters(self) -> list[torch.Tensor]:
        """Copy the parameters' gradients into the masters' float32 ``.grad`` (one multi-tensor op) and return the
        masters, e.g. for ``clip_grad_norm_``; the next :meth:`step` uses their gradients as they are then."""
        grads, masters = [], []
        for group in self.param_groups:
            for p in self._params_with_grads(group):
                grads.append(p.grad)
                masters.append(self._init_state(p)["master"])
        if grads:
            torch._foreach_copy_([m.grad for m in masters], grads)
        self._moved = True
        return masters

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not self._moved:
            self.gradients_to_masters()
        self._moved = False
        for group in self.param_groups:
            params = self._params_with_grads(group)
            if not params:
                continue
            states = [self._init_state(p) for p in params]
            masters, exp_avgs, exp_avg_sqs, steps = (
                [s[k] for s in states] for k in ("master", "exp_avg", "exp_avg_sq", "step"))
            grads = [m.grad for m in masters]
            (beta1, beta2), lr, wd, eps = group["betas"], group["lr"], group["weight_decay"], group["eps"]
            if group["implementation"] == "fused":
                torch._foreach_add_(steps, 1)
                torch._fused_adamw_(masters, grads, exp_avgs, exp_avg_sqs, [], steps, lr=lr, beta1=beta1,
                                    beta2=beta2, weight_decay=wd, eps=eps, amsgrad=False, maximize=False)
            else:
                _foreach_adamw(masters, grads, exp_avgs, exp_avg_sqs, steps, lr=lr, beta1=beta1, beta2=beta2,
                               weight_decay=wd, eps=eps)
            torch._foreach_copy_(params, masters)  # the compute weights: one multi-tensor op (rounds to bf16)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clears the parameters' gradients (the master gradients are buffers, overwritten at the next step)."""
        super().zero_grad(set_to_none=set_to_none)
        self._moved = False

    def load_state_dict(self, state_dict: dict) -> None:
        saved = state_dict["state"]
        # the saved groups name their parameters by index (Optimizer.state_dict) or by name (torch.distributed's
        # get_state_dict); either way in the order of this optimizer's groups, as torch maps them
        keys = [k for group in state_dict["param_groups"] for k in group["params"]]
        super().load_state_dict(state_dict)  # casts floating state to the parameter's dtype: undone below
        params = [p for group in self.param_groups for p in group["params"]]
        for key_of_p, p in zip(keys, params):
            entry = saved.get(key_of_p, {})
            for key in FLOAT32_STATE:
                if key in entry:
                    self.state[p][key] = entry[key].to(device=p.device, dtype=torch.float32, copy=True)
        self._moved = False


def _foreach_adamw(masters: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                   exp_avg_sqs: list[torch.Tensor], steps: list[torch.Tensor], *, lr: float, beta1: float,
                   beta2: float, weight_decay: float, eps: float) -> None:
    """AdamW (module doc) with multi-tensor ops. All of a group's tensors step together, so the bias corrections
    come from the first tensor's step count: a host int on a CPU (free there), else one device scalar each (no host
    read, and a fixed number of launches whatever the number of tensors)."""
    torch._foreach_add_(steps, 1)
    if weight_decay:
        torch._foreach_mul_(masters, 1 - lr * weight_decay)
    torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2)
    denom = torch._foreach_sqrt(exp_avg_sqs)
    if _host_step(steps[0]):
        t = int(steps[0].item())
        torch._foreach_div_(denom, math.sqrt(1 - beta2 ** t))
        torch._foreach_add_(denom, eps)
        torch._foreach_addcdiv_(masters, exp_avgs, denom, -lr / (1 - beta1 ** t))
    else:
        t = steps[0]  # a 0-dim float32 tensor on the device
        torch._foreach_div_(denom, (1 - beta2 ** t).sqrt())
        torch._foreach_add_(denom, eps)
        update = torch._foreach_div(exp_avgs, (1 - beta1 ** t) / -lr)
        torch._foreach_addcdiv_(masters, update, denom)


def _host_step(step: torch.Tensor) -> bool:
    """Whether the step count may be read on the host: on a CPU it is host memory already."""
    return step.device.type == "cpu"


def gradients_for_clipping(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Iterable[torch.Tensor]:
    """What ``clip_grad_norm_`` clips: the float32 masters of a :class:`MasterAdamW` (their gradients moved there
    now), else the model's parameters."""
    if isinstance(optimizer, MasterAdamW):
        return optimizer.gradients_to_masters()
    return model.parameters()
