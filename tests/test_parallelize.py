"""Single-process parallelize_model options: torch.compile per block and activation checkpointing keep the maths."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from fastgrpo.config import ParallelConfig
from fastgrpo.models.packing import pack
from fastgrpo.distributed.runner import prepare_model
from fastgrpo.models.tiny import build_tiny


def _loss_and_grads(cfg: ParallelConfig):
    model = AutoModelForCausalLM.from_pretrained(build_tiny(), attn_implementation="sdpa").train()
    runner = prepare_model(model, cfg, device="cpu", world_size=1)
    mb = pack([[1, 2, 3, 4], [5, 6, 7]], [[8, 9], [10, 11, 12]], [[0, 1]], "cpu")[0]
    loss = runner.packed_forward(mb, lambda h, w: torch.log_softmax(h @ w.T, -1).gather(1, mb.targets[:, None]).sum())
    loss.backward()
    return loss.detach(), {n.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", ""): p.grad.clone()
                           for n, p in model.named_parameters()}


def test_compile_and_activation_checkpointing_give_the_eager_gradients():
    pytest.importorskip("torch._inductor")
    ref_loss, ref = _loss_and_grads(ParallelConfig())
    loss, grads = _loss_and_grads(ParallelConfig(compile=True, activation_checkpointing=True))
    torch.testing.assert_close(loss, ref_loss)
    assert grads.keys() == ref.keys()
    for name in ref:
        torch.testing.assert_close(grads[name], ref[name], rtol=1e-4, atol=1e-5, msg=name)
