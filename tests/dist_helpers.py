"""One GRPO-like training step on a tiny Qwen2, shared by the single-process oracle and the FSDP2 workers.

Run as a script by ``tests/test_fsdp.py`` once per rank with torchrun's environment variables set
(RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT); rank 0 saves gathered gradients and parameters to ``--out``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from fastgrpo import distributed as fdist  # noqa: E402
from fastgrpo.config import ParallelConfig  # noqa: E402
from fastgrpo.packing import pack, partition_balanced, plan_microbatches, split_to_count  # noqa: E402
from fastgrpo.parallelize import parallelize_model  # noqa: E402

VOCAB = 131
NUM_SEQS = 10
LR = 0.5


def tiny_qwen2(seed: int = 0) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, Qwen2Config

    # 3 blocks (so that the first, middle and last-block reshard settings all run); tied like Qwen2.5-0.5B;
    # odd vocab and hidden sizes so FSDP's dim-0 padding is exercised.
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=72, num_hidden_layers=3,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=128,
                      tie_word_embeddings=True, attn_implementation="sdpa")
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg).float().train()


def problem(seed: int = 0):
    """Sequences, global token weights (dapo: 1 / sum L) and advantages for the whole (global) batch."""
    g = torch.Generator().manual_seed(seed)

    def seq(lo: int, hi: int) -> list[int]:
        return torch.randint(0, VOCAB, (int(torch.randint(lo, hi + 1, (1,), generator=g)),), generator=g).tolist()

    prompts = [seq(1, 12) for _ in range(NUM_SEQS)]
    completions = [seq(1, 16) for _ in range(NUM_SEQS)]
    lengths = [len(c) for c in completions]
    weights = [torch.full((n,), 1.0 / sum(lengths)) for n in lengths]  # per sequence: [L_i]
    advantages = [torch.full((n,), float(a)) for n, a in zip(lengths, torch.randn(NUM_SEQS, generator=g))]
    return prompts, completions, weights, advantages


def clean_name(name: str) -> str:
    return name.replace("_checkpoint_wrapped_module.", "")


def train_step(model: torch.nn.Module, seqs: list[int], *, budget: int, num_microbatches: int | None = None,
               seed: int = 0) -> int:
    """Forward/backward over ``seqs`` (indices into the global batch) in packed micro-batches; returns the count.

    Local tensors are gathered into this rank's flat layout; the weights are the global ones, so summing the
    ranks' gradients gives the full-batch gradient.
    """
    prompts, completions, weights, advantages = problem(seed)
    P = [prompts[i] for i in seqs]
    C = [completions[i] for i in seqs]
    w = torch.cat([weights[i] for i in seqs]) if seqs else torch.zeros(0)  # [F_local]
    adv = torch.cat([advantages[i] for i in seqs]) if seqs else torch.zeros(0)  # [F_local]
    lengths = [len(p) + len(c) for p, c in zip(P, C)]
    bins = plan_microbatches(lengths, budget)
    n = fdist.all_reduce_int(len(bins), "max") if num_microbatches is None else num_microbatches
    bins = split_to_count(bins, lengths, n)
    forward = getattr(model, "packed_forward")

    for mb in pack(P, C, bins, "cpu"):
        def head(hidden: torch.Tensor, weight: torch.Tensor, mb=mb) -> torch.Tensor:
            logp = torch.log_softmax(hidden @ weight.T, -1).gather(1, mb.targets[:, None])[:, 0]  # [N]
            ratio = torch.exp(logp - logp.detach())  # GRPO with old = logp.detach()
            return -(w[mb.flat_index] * adv[mb.flat_index] * ratio).sum()

        forward(mb, head).backward()
    return len(bins)


SCENARIOS = {
    # name: (config, how sequences are split over ranks)
    "plain": (ParallelConfig(), "balanced"),
    "activation_checkpointing": (ParallelConfig(activation_checkpointing=True), "balanced"),
    # Rank 1 gets one sequence, so it must pad with dummy micro-batches to match rank 0's count.
    "dummy_microbatches": (ParallelConfig(), "one_on_last_rank"),
    # FSDP2's CPUOffloadPolicy: sharded parameters, gradients and optimizer step on the host.
    "cpu_offload": (ParallelConfig(cpu_offload=True), "balanced"),
}
"""Run back to back in the same two processes: process start-up (importing torch) dominates the test time."""


def split_sequences(lengths: list[int], how: str, rank: int, world: int) -> list[int]:
    if how == "balanced":
        return partition_balanced(lengths, world)[rank]
    last = len(lengths) - 1
    return [last] if rank == world - 1 else [i for i in range(last) if i % (world - 1) == rank]


def run_scenario(cfg: ParallelConfig, how: str, info: fdist.DistInfo) -> dict:
    from torch.distributed.tensor import DTensor

    def full(t: torch.Tensor) -> torch.Tensor:
        return t.full_tensor() if isinstance(t, DTensor) else t

    model = parallelize_model(tiny_qwen2(), cfg, device="cpu", world_size=info.world_size)
    tied_after_shard = model.lm_head.weight is model.model.embed_tokens.weight

    # Budget 40 gives the ranks different bin counts, which train_step evens out.
    prompts, completions, _, _ = problem()
    lengths = [len(p) + len(c) for p, c in zip(prompts, completions)]
    mine = split_sequences(lengths, how, info.rank, info.world_size)
    count = train_step(model, mine, budget=40)
    own_bins = len(plan_microbatches([lengths[i] for i in mine], 40))

    grads = {clean_name(n): full(p.grad).detach().clone() for n, p in model.named_parameters()}
    torch.optim.SGD(model.parameters(), lr=LR).step()
    params = {clean_name(n): full(p).detach().clone() for n, p in model.named_parameters()}
    counts = torch.tensor([own_bins, count])
    gathered = [torch.zeros_like(counts) for _ in range(info.world_size)]
    torch.distributed.all_gather(gathered, counts)
    return {
        "grads": grads, "params": params, "tied_after_shard": tied_after_shard,
        "tied_after_step": model.lm_head.weight is model.model.embed_tokens.weight,
        "param_type": type(model.model.embed_tokens.weight).__name__,
        "offload_policy": type(model._get_fsdp_state()._fsdp_param_group.offload_policy).__name__,
        "counts": [c.tolist() for c in gathered],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    info = fdist.init_distributed("cpu")
    results = {name: run_scenario(cfg, how, info) for name, (cfg, how) in SCENARIOS.items()}
    if fdist.is_main():
        torch.save(results, args.out)
    fdist.barrier()
    fdist.destroy_distributed()


if __name__ == "__main__":
    main()
