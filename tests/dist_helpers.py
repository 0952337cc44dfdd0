"""One GRPO update (``fastgrpo.algorithms.grpo.grpo_update``, the trainer's own) on a tiny Qwen2, shared by the
single-process oracle and the FSDP2 workers.

Run as a script by ``tests/test_fsdp.py`` once per rank with torchrun's environment variables set
(RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT); rank 0 saves gathered gradients and parameters to ``--out``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from fastgrpo.distributed import groups as fdist  # noqa: E402
from fastgrpo.config import GRPOConfig, LoraConfig, ParallelConfig, RolloutConfig  # noqa: E402
from fastgrpo.distributed.runner import AdapterDisabled  # noqa: E402
from fastgrpo.models.lora import apply_lora  # noqa: E402
from fastgrpo.runtime.metrics import StepMetrics  # noqa: E402
from fastgrpo.models.packing import partition_balanced, plan_microbatches  # noqa: E402
from fastgrpo.distributed.parallelize import parallelize_model  # noqa: E402
from fastgrpo.algorithms.grpo import GRPOBatch, grpo_update  # noqa: E402

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


def tiny_lora(seed: int = 0) -> torch.nn.Module:
    """tiny_qwen2 with rank-4 adapters on every linear layer; lora_B is made non-zero (peft starts it at zero) so
    that both adapter matrices get gradients and the adapted model differs from its base."""
    model = apply_lora(tiny_qwen2(seed), LoraConfig(rank=4, alpha=8))
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return model


def problem(seed: int = 0):
    """Prompts, completions and one advantage per sequence for the whole (global) batch."""
    g = torch.Generator().manual_seed(seed)

    def seq(lo: int, hi: int) -> list[int]:
        return torch.randint(0, VOCAB, (int(torch.randint(lo, hi + 1, (1,), generator=g)),), generator=g).tolist()

    prompts = [seq(1, 12) for _ in range(NUM_SEQS)]
    completions = [seq(1, 16) for _ in range(NUM_SEQS)]
    advantages = torch.randn(NUM_SEQS, generator=g)  # [S]
    return prompts, completions, advantages


def clean_name(name: str) -> str:
    return name.replace("_checkpoint_wrapped_module.", "")


def train_step(model: torch.nn.Module, seqs: list[int], *, budget: int, seed: int = 0, beta: float = 0.0) -> int:
    """The trainer's GRPO update (dapo token weights over the global batch, SGD, no clipping) on ``seqs``
    (indices into the global batch); returns the number of micro-batches it ran.

    Gradients are left in ``.grad`` after the step. The token weights are normalised over all ranks, so summing the
    ranks' gradients gives the full-batch gradient.
    """
    prompts, completions, advantages = problem(seed)
    batch = GRPOBatch(prompt_ids=[prompts[i] for i in seqs], completion_ids=[completions[i] for i in seqs],
                      advantages=advantages[seqs])
    # With LoRA and beta > 0 the reference is the base model: the same module with its adapters off.
    ref = AdapterDisabled(model) if beta > 0 else None
    mbs = grpo_update(model, batch, grpo=GRPOConfig(loss_type="dapo", max_tokens_per_microbatch=budget,
                                                    head_backend="torch", beta=beta),
                      rollout=RolloutConfig(max_completion_length=16),
                      optimizer=torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR),
                      max_grad_norm=0.0, metrics=StepMetrics(), device="cpu", ref_model=ref)
    return len(mbs)


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

LORA_SCENARIO = (ParallelConfig(activation_checkpointing=True), "balanced")
"""LoRA adapters (tiny_lora) with beta > 0 (reference = adapters off), activation checkpointing around peft's layers."""
LORA_BETA = 0.1


def split_sequences(lengths: list[int], how: str, rank: int, world: int) -> list[int]:
    if how == "balanced":
        return partition_balanced(lengths, world)[rank]
    last = len(lengths) - 1
    return [last] if rank == world - 1 else [i for i in range(last) if i % (world - 1) == rank]


def run_scenario(cfg: ParallelConfig, how: str, info: fdist.DistInfo, *, lora: bool = False) -> dict:
    from torch.distributed.tensor import DTensor

    def full(t: torch.Tensor) -> torch.Tensor:
        return t.full_tensor() if isinstance(t, DTensor) else t

    model = parallelize_model(tiny_lora() if lora else tiny_qwen2(), cfg, device="cpu", world_size=info.world_size)
    tied_after_shard = model.get_output_embeddings().weight is model.get_input_embeddings().weight

    # Budget 40 gives the ranks different bin counts, which train_step evens out.
    prompts, completions, _ = problem()
    lengths = [len(p) + len(c) for p, c in zip(prompts, completions)]
    mine = split_sequences(lengths, how, info.rank, info.world_size)
    count = train_step(model, mine, budget=40, beta=LORA_BETA if lora else 0.0)
    own_bins = len(plan_microbatches([lengths[i] for i in mine], 40))

    grads = {clean_name(n): full(p.grad).detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    params = {clean_name(n): full(p).detach().clone() for n, p in model.named_parameters()}
    counts = torch.tensor([own_bins, count])
    gathered = [torch.zeros_like(counts) for _ in range(info.world_size)]
    torch.distributed.all_gather(gathered, counts)
    return {
        "grads": grads, "params": params, "tied_after_shard": tied_after_shard,
        "tied_after_step": model.get_output_embeddings().weight is model.get_input_embeddings().weight,
        "param_type": type(model.get_input_embeddings().weight).__name__,
        "offload_policy": type(model._get_fsdp_state()._fsdp_param_group.offload_policy).__name__,
        "counts": [c.tolist() for c in gathered],
    }


def start_rank() -> tuple[argparse.Namespace, fdist.DistInfo]:
    """What every rank script starts with: its --out argument, one thread, the gloo process group."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    return args, fdist.init_distributed("cpu")


def main() -> None:
    args, info = start_rank()
    results = {name: run_scenario(cfg, how, info) for name, (cfg, how) in SCENARIOS.items()}
    results["lora"] = run_scenario(*LORA_SCENARIO, info, lora=True)
    if fdist.is_main():
        torch.save(results, args.out)
    fdist.barrier()
    fdist.destroy_distributed()


if __name__ == "__main__":
    main()
