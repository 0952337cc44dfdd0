"""One GRPO update (the trainer's ``grpo_update``) with shared prompt prefixes on FSDP2 ranks, for
tests/test_shared_prefix.py, which compares it with one process without sharing.

Run as a script once per rank with torchrun's environment set; rank 0 saves the gathered gradients to ``--out``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere
sys.path.insert(0, str(Path(__file__).resolve().parent))

from dist_helpers import VOCAB, clean_name, start_rank, tiny_qwen2  # noqa: E402

from fastgrpo.algorithms.grpo import GRPOBatch, grpo_update  # noqa: E402
from fastgrpo.config import GRPOConfig, ParallelConfig, RolloutConfig  # noqa: E402
from fastgrpo.distributed import groups as fdist  # noqa: E402
from fastgrpo.distributed.parallelize import parallelize_model  # noqa: E402
from fastgrpo.runtime.metrics import StepMetrics  # noqa: E402

BUDGET = 40
"""Small enough that the largest groups are split over micro-batches and the ranks plan different counts."""
RANK_SEQUENCES = [list(range(12)), list(range(12, 16))]
"""Rank 0: three groups of 4; rank 1: one (it pads with dummy micro-batches to rank 0's count)."""


def grouped_problem() -> GRPOBatch:
    """4 prompts of different lengths, 4 completions each, one advantage per sequence."""
    g = torch.Generator().manual_seed(0)

    def seq(lo: int, hi: int) -> list[int]:
        return torch.randint(0, VOCAB, (int(torch.randint(lo, hi + 1, (1,), generator=g)),), generator=g).tolist()

    prompts = [p for p in (seq(8, 18) for _ in range(4)) for _ in range(4)]
    completions = [seq(1, 10) for _ in prompts]
    return GRPOBatch(prompt_ids=prompts, completion_ids=completions, advantages=torch.randn(len(prompts), generator=g))


def update(model: torch.nn.Module, seqs: list[int], *, shared: bool) -> dict[str, float]:
    """The trainer's update (dapo weights over the global batch, lr 0: .grad keeps the gradients) on ``seqs``."""
    full = grouped_problem()
    batch = GRPOBatch(prompt_ids=[full.prompt_ids[i] for i in seqs],
                      completion_ids=[full.completion_ids[i] for i in seqs], advantages=full.advantages[seqs])
    metrics = StepMetrics()
    grpo_update(model, batch, grpo=GRPOConfig(loss_type="dapo", max_tokens_per_microbatch=BUDGET, head_backend="torch",
                                              shared_prefix="true" if shared else "false"),
                rollout=RolloutConfig(max_completion_length=16), optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
                max_grad_norm=0.0, metrics=metrics, device="cpu")
    return metrics.reduce()


def main() -> None:
    from torch.distributed.tensor import DTensor

    args, info = start_rank()
    model = parallelize_model(tiny_qwen2(), ParallelConfig(), device="cpu", world_size=info.world_size)
    record = update(model, RANK_SEQUENCES[info.rank], shared=True)
    grads = {clean_name(n): (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach().clone()
             for n, p in model.named_parameters() if p.grad is not None}
    if fdist.is_main():
        torch.save({"grads": grads, "metrics": record}, args.out)
    fdist.barrier()
    fdist.destroy_distributed()


if __name__ == "__main__":
    main()
