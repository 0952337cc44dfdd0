"""Compiled blocks (``parallel.compile``): each decoder block compiled with ``fullgraph=True,
dynamic=False`` on the CPU with inductor (the backend that runs on a GPU too; a warm inductor cache makes the test
~10 s, a cold one ~30 s on 2 cores). Through the real GRPO update (``grpo_update`` -> ``plan_step`` with the model's
token buckets -> ``optimizer_update``): no graph break, no recompile across steps whose micro-batches fall in the
buckets already seen, one new graph for a new bucket, and the losses, gradients and weights of three AdamW steps
equal eager's within float32 rounding of a differently fused program (tolerances at the asserts)."""

import random

import pytest
import torch
from torch._dynamo.utils import counters
from transformers import AutoModelForCausalLM

from fastgrpo.algorithms.grpo import GRPOBatch, grpo_update
from fastgrpo.config import GRPOConfig, OptimConfig, ParallelConfig, RolloutConfig
from fastgrpo.models.attention import register_with_transformers
from fastgrpo.models.tiny import build_tiny
from fastgrpo.runtime.metrics import StepMetrics
from fastgrpo.update.bundle import build_trained

pytest.importorskip("torch._inductor")

BUDGET = 64
"""Micro-batch budget; buckets 32 and 64 (parallel.token_buckets)."""


def _batch(seed: int, n: int, lengths: tuple[int, int]) -> GRPOBatch:
    """n sequences of total length in ``lengths`` (prompt 4..8 tokens, the rest completion)."""
    r = random.Random(seed)
    prompts, completions = [], []
    for _ in range(n):
        total, p = r.randint(*lengths), r.randint(4, 8)
        prompts.append([r.randrange(3, 250) for _ in range(p)])
        completions.append([r.randrange(3, 250) for _ in range(total - p)])
    return GRPOBatch(prompt_ids=prompts, completion_ids=completions,
                     advantages=torch.randn(n, generator=torch.Generator().manual_seed(seed)))


# Rows over 32 tokens (each sequence 33..40 long: one per 64-token row) -> bucket 64 only; then one short sequence
# -> bucket 32.
STEPS = [_batch(1, 3, (33, 40)), _batch(2, 2, (33, 40)), _batch(3, 1, (10, 20))]


def _run(compile: bool):
    register_with_transformers()
    model = AutoModelForCausalLM.from_pretrained(build_tiny(), attn_implementation="sdpa_varlen").train()
    parallel = ParallelConfig(compile=compile, token_buckets=[32, 64])
    trained = build_trained(model, parallel=parallel, optim=OptimConfig(lr=1e-3), device="cpu", world_size=1,
                            total_steps=len(STEPS))
    losses, graphs, buckets, grads = [], [], [], []
    for batch in STEPS:
        metrics = StepMetrics()
        mbs = grpo_update(trained.runner, batch, grpo=GRPOConfig(max_tokens_per_microbatch=BUDGET, head_backend="torch"),
                          rollout=RolloutConfig(max_completion_length=40), optimizer=trained.optimizer,
                          scheduler=trained.scheduler, max_grad_norm=1.0, metrics=metrics, device="cpu")
        losses.append(metrics.reduce()["loss"])
        graphs.append(counters["stats"]["unique_graphs"])
        buckets.append({mb.num_tokens for mb in mbs})
        grads.append({n.replace("_orig_mod.", ""): p.grad.clone() for n, p in trained.model.named_parameters()})
    weights = {k: v.detach().clone() for k, v in trained.model.state_dict().items()}
    return losses, graphs, buckets, grads, weights


def test_compiled_blocks_have_no_graph_break_no_recompile_in_seen_buckets_and_train_as_eager():
    torch._dynamo.reset()
    counters.clear()
    losses, graphs, buckets, grads, weights = _run(compile=True)
    assert buckets == [{64}, {64}, {32}]
    assert dict(counters["graph_break"]) == {}, dict(counters["graph_break"])
    # step 1 compiles the 64-token graph (shared by both blocks), step 2 reuses it, step 3's bucket adds one
    assert graphs == [1, 1, 2], graphs
    assert sum(counters["recompiles"].values()) <= 1  # the one for the new bucket at most
    ref_losses, _, ref_buckets, ref_grads, ref_weights = _run(compile=False)
    assert ref_buckets == buckets
    assert losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
    for step in range(len(STEPS)):  # the gradients of each step, on weights that differ by rounding after step 1
        assert grads[step].keys() == ref_grads[step].keys()
        for name in ref_grads[step]:
            torch.testing.assert_close(grads[step][name], ref_grads[step][name], rtol=1e-3, atol=1e-5,
                                       msg=f"step {step + 1}: {name}")
    # AdamW divides by sqrt(v): a gradient entry near 0 that rounds differently can move its weight by up to lr
    # (1e-3); bound the drift by a tenth of that
    for name in ref_weights:
        torch.testing.assert_close(weights[name], ref_weights[name], rtol=0, atol=1e-4, msg=name)


def test_a_compiled_block_under_autocast_gives_the_eager_loss_and_gradients():
    """float32 weights under bf16 autocast (the one-GPU default) with compiled blocks: q and k reach the varlen op in
    float32, v in bf16 (the first H100 run's failure, "Expected query, key, and value to have the same dtype"); the
    op's autocast rule casts them as sdpa would, so compiled = eager (autocast on the CPU here). Inductor's caches
    are off: a graph cached by a run with the rule would hide its absence."""
    from fastgrpo.distributed.runner import prepare_model
    from fastgrpo.models.packing import pack

    torch._dynamo.reset()
    counters.clear()
    register_with_transformers()
    results = []
    for compile in (True, False):
        model = AutoModelForCausalLM.from_pretrained(build_tiny(), attn_implementation="varlen_op").train()
        runner = prepare_model(model, ParallelConfig(compile=compile), device="cpu", world_size=1)
        runner.autocast_dtype = torch.bfloat16  # what prepare_model sets on one plain GPU
        mb = pack([[1, 2, 3, 4], [9] * 7], [[5, 6, 7], [8] * 9], [[0, 1]], "cpu", buckets=[32], max_seqlen=16)[0]
        with torch._inductor.config.patch(fx_graph_cache=False), \
                torch._functorch.config.patch(enable_autograd_cache=False):
            loss = runner.packed_forward(mb, lambda h, w: torch.log_softmax((h @ w.T).float(), -1).gather(
                1, mb.targets[:, None]).sum())
            loss.backward()
        results.append((loss.detach(), {n.replace("_orig_mod.", ""): p.grad for n, p in model.named_parameters()}))
    assert dict(counters["graph_break"]) == {} and counters["stats"]["unique_graphs"] == 1
    (loss, grads), (ref_loss, ref_grads) = results
    torch.testing.assert_close(loss, ref_loss, rtol=1e-2, atol=1e-2)
    for name in ref_grads:  # bf16 products fused differently: each gradient as a whole within 3% (seen: <= 1.2%)
        err = ((grads[name] - ref_grads[name]).norm() / ref_grads[name].norm()).item()
        assert err < 3e-2, (name, err)
