"""CUDA graphs of the decoder blocks per token bucket (issue 38, ``parallel.cuda_graphs``): refused with one line on
a machine without CUDA; on a GPU, a graphed update gives the eager update's loss and gradients, a row that fits no
bucket runs eagerly, and replays launch no capture again (these skip without CUDA)."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from fastgrpo.config import ParallelConfig
from fastgrpo.distributed.parallelize import parallelize_model, transformer_blocks
from fastgrpo.models.attention import register_with_transformers
from fastgrpo.models.packing import pack
from fastgrpo.models.tiny import build_tiny
from fastgrpo.update.cuda_graphs import graph_blocks

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")


def _model(device: str, attn: str = "varlen_op", **parallel):
    register_with_transformers()
    model = AutoModelForCausalLM.from_pretrained(build_tiny(), attn_implementation=attn).train()
    return parallelize_model(model, ParallelConfig(**parallel), device=device, world_size=1)


def test_cuda_graphs_are_refused_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="parallel.cuda_graphs needs one plain CUDA device"):
        _model("cpu", cuda_graphs=True, token_buckets=[32])
    with pytest.raises(ValueError, match="parallel.cuda_graphs needs a CUDA device"):
        graph_blocks(transformer_blocks(_model("cpu")), [32])


def _loss_and_grads(model, mbs):
    model.zero_grad(set_to_none=True)
    total = 0.0
    for mb in mbs:
        loss = model.packed_forward(mb, lambda h, w, mb=mb: torch.log_softmax((h @ w.T).float(), -1).gather(
            1, mb.targets[:, None]).sum())
        loss.backward()
        total += loss.detach()
    return total, {n: p.grad.clone() for n, p in model.named_parameters()}


@needs_cuda
@pytest.mark.parametrize("weights", ["bf16", "float32+autocast"])
def test_a_graphed_update_gives_the_eager_loss_and_gradients_and_runs_other_rows_eagerly(weights):
    """bf16 weights without autocast (parallel.master_weights) and float32 weights under bf16 autocast (the one-GPU
    default; capture refuses autocast's weight-cast cache, the first H100 run's failure): graphed = eager."""
    prompts, completions = [[1, 2, 3, 4], [5, 6, 7], [9] * 40], [[8, 9], [10, 11, 12], [13] * 30]
    bins = [[0, 1], [2]]  # a 12-token row (bucket 16) and a 70-token row (no bucket: eager)
    parallel = {"master_weights": True} if weights == "bf16" else {}
    # torch_varlen: what an eager CUDA update runs (choose_attn_implementation's CUDA default without flash-attn)
    eager, graphed = _model("cuda", "torch_varlen", **parallel), _model("cuda", "torch_varlen", **parallel)
    assert (eager.autocast_dtype is None) == (weights == "bf16")
    blocks = transformer_blocks(graphed)
    graphs = graph_blocks(blocks, [32, 16])
    assert blocks.block_graphs is graphs
    for _ in range(3):  # replays after the first capture
        mbs = pack(prompts, completions, bins, "cuda", buckets=[16, 32])
        assert [mb.num_tokens for mb in mbs] == [16, 70]
        ref_loss, ref = _loss_and_grads(eager, mbs)
        loss, grads = _loss_and_grads(graphed, mbs)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-2, atol=1e-2)
        for name in ref:
            torch.testing.assert_close(grads[name].float(), ref[name].float(), rtol=2e-2, atol=2e-2, msg=name)
    layers = len(blocks)
    assert (graphs.captures, graphs.replays, graphs.eager_calls) == (1, 3 * layers, 3 * layers)


@needs_cuda
def test_the_graphed_grpo_update_trains_as_the_eager_one_and_captures_each_row_shape_once():
    """Through the trainer's own update (build_trained -> grpo_update -> plan_step's padded rows): bf16 weights with
    float32 masters, eager blocks against CUDA-graphed ones over three steps of one batch shape."""
    from fastgrpo.algorithms.grpo import GRPOBatch, grpo_update
    from fastgrpo.config import GRPOConfig, OptimConfig, RolloutConfig
    from fastgrpo.runtime.metrics import StepMetrics
    from fastgrpo.update.bundle import build_trained

    gen = torch.Generator().manual_seed(0)
    batches = [GRPOBatch(prompt_ids=torch.randint(3, 250, (6, 9), generator=gen).tolist(),
                         completion_ids=torch.randint(3, 250, (6, 14), generator=gen).tolist(),
                         advantages=torch.randn(6, generator=gen)) for _ in range(3)]
    losses = {}
    for name, graphs_on in (("eager", False), ("graphed", True)):
        register_with_transformers()
        model = AutoModelForCausalLM.from_pretrained(build_tiny(), attn_implementation="torch_varlen").train()
        parallel = ParallelConfig(master_weights=True, cuda_graphs=graphs_on, token_buckets=[32, 64])
        trained = build_trained(model, parallel=parallel, optim=OptimConfig(lr=1e-3), device="cuda", world_size=1,
                                total_steps=3)
        losses[name] = []
        for batch in batches:
            metrics = StepMetrics()
            grpo_update(trained.model, batch, grpo=GRPOConfig(max_tokens_per_microbatch=64),
                        rollout=RolloutConfig(max_completion_length=14), optimizer=trained.optimizer,
                        scheduler=trained.scheduler, max_grad_norm=1.0, metrics=metrics, device="cuda")
            losses[name].append(metrics.reduce()["loss"])
        if graphs_on:
            graphs = transformer_blocks(trained.model).block_graphs
            # 6 sequences of 23 tokens: rows of 2 (46 -> bucket 64) and the same row shapes at every step
            assert graphs.captures == len({(s.tokens, s.boundaries, s.max_seqlen) for s in graphs.graphed})
            assert 1 <= graphs.captures <= 2 and graphs.replays > 0
    assert losses["graphed"] == pytest.approx(losses["eager"], rel=2e-2, abs=2e-3)
