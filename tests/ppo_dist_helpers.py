"""One PPO update (``fastgrpo.algorithms.ppo.ppo_update``, the trainer's own) of a tiny Qwen2 policy and its critic, shared by
the single-process oracle and the FSDP2 workers of ``tests/test_ppo.py``.

Run as a script once per rank with torchrun's environment set; rank 0 saves the gathered parameters to ``--out``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere
sys.path.insert(0, str(Path(__file__).resolve().parent))

from dist_helpers import clean_name, problem, split_sequences, start_rank, tiny_lora, tiny_qwen2  # noqa: E402

from fastgrpo.distributed import groups as fdist  # noqa: E402
from fastgrpo.config import GRPOConfig, ParallelConfig, PPOConfig, RolloutConfig  # noqa: E402
from fastgrpo.config import LoraConfig  # noqa: E402
from fastgrpo.algorithms.critic import apply_critic_lora, attach_value_head  # noqa: E402
from fastgrpo.distributed.runner import AdapterDisabled  # noqa: E402
from fastgrpo.runtime.metrics import StepMetrics  # noqa: E402
from fastgrpo.distributed.parallelize import parallelize_model  # noqa: E402
from fastgrpo.algorithms.ppo import PPOBatch, ppo_update  # noqa: E402

LR = 0.5
PPO = PPOConfig(gamma=0.95, lam=0.9, kl_coef=0.05, num_ppo_epochs=2, vf_coef=0.5, cliprange_value=0.05)
"""Two epochs (the second sees a moved policy: ratios != 1, clipping), a KL penalty in the reward (a reference
model), discount and lambda < 1, a value clip range small enough to bite."""


def models(world_size: int, *, lora: bool = False) -> tuple[torch.nn.Module, torch.nn.Module, object]:
    """(policy, critic, reference), parallelized for ``world_size`` ranks (plain modules for 1). With ``lora``:
    adapters on both (the critic's value head trains too), the reference being the policy with adapters off."""
    cfg = ParallelConfig(activation_checkpointing=lora)
    critic = attach_value_head(tiny_qwen2(1), seed=3)
    if lora:
        critic = apply_critic_lora(critic, LoraConfig(rank=4, alpha=8))
    critic = parallelize_model(critic, cfg, device="cpu", world_size=world_size)
    policy = parallelize_model(tiny_lora(0) if lora else tiny_qwen2(0), cfg, device="cpu", world_size=world_size)
    if lora:
        return policy, critic, AdapterDisabled(policy)
    ref = parallelize_model(tiny_qwen2(2).requires_grad_(False), cfg, device="cpu", world_size=world_size)
    return policy, critic, ref


def ppo_step(policy: torch.nn.Module, critic: torch.nn.Module, ref: torch.nn.Module, seqs: list[int], *,
             budget: int) -> dict[str, float]:
    """The trainer's PPO update on the sequences ``seqs`` of the global batch (SGD, no clipping, one mini-batch per
    epoch); returns the step's metrics (reduced over ranks)."""
    prompts, completions, rewards = problem()
    batch = PPOBatch(prompt_ids=[prompts[i] for i in seqs], completion_ids=[completions[i] for i in seqs],
                     rewards=rewards[seqs])
    metrics = StepMetrics()
    ppo_update(policy, critic, batch, grpo=GRPOConfig(loss_type="grpo", max_tokens_per_microbatch=budget,
                                                      head_backend="torch", epsilon_low=0.02, epsilon_high=0.02),
               ppo=PPO, rollout=RolloutConfig(max_completion_length=16),
               optimizer=torch.optim.SGD([p for p in policy.parameters() if p.requires_grad], lr=LR),
               critic_optimizer=torch.optim.SGD([p for p in critic.parameters() if p.requires_grad], lr=LR), max_grad_norm=0.0, metrics=metrics,
               device="cpu", ref_model=ref, seed=7)
    return metrics.reduce()


def full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {clean_name(n): (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for n, p in model.named_parameters()}


def main() -> None:
    args, info = start_rank()
    prompts, completions, _ = problem()
    lengths = [len(p) + len(c) for p, c in zip(prompts, completions)]
    out = {}
    for lora in (False, True):  # both in one launch: process start-up dominates the test's time
        policy, critic, ref = models(info.world_size, lora=lora)
        record = ppo_step(policy, critic, ref, split_sequences(lengths, "balanced", info.rank, info.world_size),
                          budget=40)
        out["lora" if lora else "full"] = {"policy": full_params(policy), "critic": full_params(critic),
                                           "metrics": record,
                                           "param_type": type(critic.get_input_embeddings().weight).__name__}
    if fdist.is_main():
        torch.save(out, args.out)
    fdist.barrier()
    fdist.destroy_distributed()


if __name__ == "__main__":
    main()
