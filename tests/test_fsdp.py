"""FSDP2 with 2 gloo processes on CPU: the trainer's GRPO update (``fastgrpo.algorithms.grpo.grpo_update``) gives the
single-process gradients and optimizer step.

The loss uses global token weights, so world size 1 and 2 must give the same gradient; that also checks the
sum (not average) gradient reduction, the equal micro-batch count across ranks, and that tied embeddings stay
tied through sharding.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import dist_helpers as dh  # tests/ is on sys.path (pytest rootdir-relative import)
from _launch import run_ranks
from fastgrpo.config import ParallelConfig
from fastgrpo.distributed.parallelize import parallelize_model, transformer_blocks

pytest.importorskip("transformers")
HELPER = Path(__file__).with_name("dist_helpers.py")


def _run_two_ranks(out: Path) -> dict:
    run_ranks([sys.executable, str(HELPER), "--out", str(out)], what="FSDP workers", timeout=120)
    return torch.load(out)


@pytest.fixture(scope="module")
def oracle():
    """Single process, plain module, all sequences in one step (tiny budget: many micro-batches)."""
    torch.set_num_threads(1)
    model = parallelize_model(dh.tiny_qwen2(), ParallelConfig(), device="cpu", world_size=1)
    dh.train_step(model, list(range(dh.NUM_SEQS)), budget=25)
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return grads, params


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """Both scenarios of dist_helpers.SCENARIOS from one launch of 2 gloo processes."""
    return _run_two_ranks(tmp_path_factory.mktemp("fsdp") / "rank0.pt")


@pytest.mark.parametrize("scenario", list(dh.SCENARIOS))
def test_fsdp_two_ranks_match_single_process(oracle, two_ranks, scenario):
    got = two_ranks[scenario]
    grads, params = oracle
    assert got["param_type"] == "DTensor"  # really sharded
    assert got["offload_policy"] == ("CPUOffloadPolicy" if scenario == "cpu_offload" else "OffloadPolicy")
    assert got["tied_after_shard"] and got["tied_after_step"]
    own, run = zip(*got["counts"])
    assert len(set(run)) == 1 and run[0] == max(own)  # every rank ran the same number of micro-batches
    if scenario == "dummy_microbatches":
        assert own[1] == 1 < own[0]  # rank 1 padded with dummy micro-batches
    assert got["grads"].keys() == grads.keys()
    for name, g in grads.items():
        torch.testing.assert_close(got["grads"][name], g, rtol=1e-4, atol=1e-6, msg=f"grad {name}")
        torch.testing.assert_close(got["params"][name], params[name], rtol=1e-5, atol=1e-6, msg=f"param {name}")


def test_lora_two_ranks_match_single_process(two_ranks):
    """LoRA under FSDP2: frozen base and adapters sharded per block (activation checkpointing around peft's layers),
    reference log-probs from the same module with adapters off (beta > 0); 2 ranks give the 1-process gradients,
    only adapters have them, and the frozen base is unchanged by the step."""
    pytest.importorskip("peft")
    torch.set_num_threads(1)
    model = parallelize_model(dh.tiny_lora(), ParallelConfig(), device="cpu", world_size=1)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    dh.train_step(model, list(range(dh.NUM_SEQS)), budget=25, beta=dh.LORA_BETA)
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    got = two_ranks["lora"]
    assert got["param_type"] == "DTensor" and got["tied_after_shard"] and got["tied_after_step"]
    assert grads and all("lora_" in n for n in grads)  # only adapters train
    assert got["grads"].keys() == grads.keys()
    for name, g in grads.items():
        assert g.abs().sum() > 0, name
        torch.testing.assert_close(got["grads"][name], g, rtol=1e-4, atol=1e-6, msg=f"grad {name}")
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]) != ("lora_" in name), name  # adapters moved, the base did not
        torch.testing.assert_close(got["params"][name], p.detach(), rtol=1e-5, atol=1e-6, msg=f"param {name}")


def test_single_process_parallelize_keeps_a_plain_module():
    model = dh.tiny_qwen2()
    cfg = ParallelConfig(activation_checkpointing=True)
    out = parallelize_model(model, cfg, device="cpu", world_size=1)
    assert out is model and not type(model).__name__.startswith("FSDP")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert all("CheckpointWrapper" in type(b).__name__ for b in transformer_blocks(model))
    assert not hasattr(model, "packed_forward")  # packed passes go through a ModelRunner, not the module
    # State-dict keys stay the Hugging Face names despite the checkpoint wrapper.
    assert all("_checkpoint_wrapped_module" not in k for k in model.state_dict())


def test_parallelize_rejects_offload_without_fsdp():
    with pytest.raises(ValueError, match="cpu_offload"):
        parallelize_model(dh.tiny_qwen2(), ParallelConfig(cpu_offload=True), device="cpu", world_size=1)
