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


def _model(device: str, **parallel):
    register_with_transformers()
    model = AutoModelForCausalLM.from_pretrained(build_tiny(), attn_implementation="varlen_op").train()
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
def test_a_graphed_update_gives_the_eager_loss_and_gradients_and_runs_other_rows_eagerly():
    prompts, completions = [[1, 2, 3, 4], [5, 6, 7], [9] * 40], [[8, 9], [10, 11, 12], [13] * 30]
    bins = [[0, 1], [2]]  # a 12-token row (bucket 16) and a 70-token row (no bucket: eager)
    eager = _model("cuda").to(torch.bfloat16)
    graphed = _model("cuda").to(torch.bfloat16)
    graphs = graph_blocks(transformer_blocks(graphed), [32, 16])
    for _ in range(3):  # replays after the first capture
        mbs = pack(prompts, completions, bins, "cuda", buckets=[16, 32])
        assert [mb.num_tokens for mb in mbs] == [16, 70]
        ref_loss, ref = _loss_and_grads(eager, mbs)
        loss, grads = _loss_and_grads(graphed, mbs)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-2, atol=1e-2)
        for name in ref:
            torch.testing.assert_close(grads[name].float(), ref[name].float(), rtol=2e-2, atol=2e-2, msg=name)
    assert sorted(graphs.graphed) == [16, 32]
