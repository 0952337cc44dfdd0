"""One plain GPU (``parallel.one_gpu: plain``): float32 masters, forwards under autocast, a bf16 decode copy.

The CPU tests simulate the GPU path by giving a CPU model's runner ``autocast_dtype = bfloat16`` (what ``prepare_model``
sets on one CUDA rank): CPU autocast runs the same code. The last test runs the real thing on CUDA when one exists.
"""

import pytest
import torch
from transformers import AutoModelForCausalLM

from fastgrpo.config import ParallelConfig
from fastgrpo.kernels import linear_logprobs
from transformers import AutoTokenizer
from fastgrpo.models.packing import pack
from fastgrpo.distributed.parallelize import autocast_dtype, parallelize_model, uses_fsdp
from fastgrpo.distributed.runner import ModelRunner, prepare_model
from fastgrpo.rollout import SamplingParams
from fastgrpo.rollout.hf import HFEngine, decode_copy
from fastgrpo.models.tiny import build_tiny


def test_one_cuda_rank_is_plain_with_autocast_and_fsdp_only_when_asked():
    cfg = ParallelConfig()
    assert not uses_fsdp(cfg, "cuda", 1) and autocast_dtype(cfg, "cuda", 1) == torch.bfloat16
    assert uses_fsdp(cfg, "cuda", 2) and autocast_dtype(cfg, "cuda", 2) is None  # several ranks: FSDP2 computes
    one_fsdp = ParallelConfig(one_gpu="fsdp")
    assert uses_fsdp(one_fsdp, "cuda", 1) and autocast_dtype(one_fsdp, "cuda", 1) is None
    assert autocast_dtype(cfg, "cpu", 1) is None and not uses_fsdp(cfg, "cpu", 1)  # CPU computes in float32
    assert autocast_dtype(ParallelConfig(param_dtype="float32"), "cuda", 1) is None


def _policy(seed=0):
    model = AutoModelForCausalLM.from_pretrained(build_tiny(seed=seed), dtype=torch.float32,
                                                 attn_implementation="sdpa")
    return parallelize_model(model, ParallelConfig(), device="cpu", world_size=1)


def _logp_sum(model, mb, autocast_dtype=None):
    return ModelRunner(model, autocast_dtype=autocast_dtype).packed_forward(mb, lambda h, w: (linear_logprobs(h, w, mb.targets, backend="torch"), h.dtype,
                                                  w.dtype))


def test_autocast_forward_is_bf16_compute_with_float32_master_gradients():
    model = _policy()
    mb = pack([[1, 2, 3, 4], [5, 6, 7]], [[8, 9], [10, 11, 12]], [[0, 1]], "cpu")[0]
    ref, h_dtype, w_dtype = _logp_sum(model, mb)
    assert h_dtype == w_dtype == torch.float32
    lp, h_dtype, w_dtype = _logp_sum(model, mb, torch.bfloat16)
    assert h_dtype == w_dtype == torch.bfloat16  # the head gets both operands in the compute dtype
    assert not torch.equal(lp, ref)  # bf16 compute really happened ...
    torch.testing.assert_close(lp, ref, atol=0.15, rtol=0.05)  # ... and is the same function
    lp.sum().backward()
    for name, p in model.named_parameters():
        assert p.dtype == torch.float32 and p.grad is not None and p.grad.dtype == torch.float32, name
        assert torch.isfinite(p.grad).all(), name
    assert model.lm_head.weight.grad.abs().sum() > 0


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(build_tiny())


def test_decode_copy_is_bf16_tied_and_refreshed_by_sync_from(tok):
    policy = _policy()
    assert decode_copy(policy, None) is None  # no autocast: the engine decodes with the policy itself
    assert not HFEngine(policy, tok).sync_from(policy)
    engine = HFEngine(policy, tok, batch_size=4, autocast_dtype=torch.bfloat16)
    copy = engine.model
    assert copy is not policy and all(p.dtype == torch.bfloat16 and not p.requires_grad for p in copy.parameters())
    assert copy.get_input_embeddings().weight is copy.get_output_embeddings().weight  # the tie survives
    assert vars(copy).keys() == vars(policy).keys() and engine.autocast_dtype is None  # the copy decodes in bf16
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.01)
    assert not torch.equal(copy.lm_head.weight, policy.lm_head.weight.to(torch.bfloat16))
    assert engine.sync_from(policy)
    for (name, c), p in zip(copy.named_parameters(), policy.parameters()):
        assert torch.equal(c, p.detach().to(torch.bfloat16)), name
    with pytest.raises(ValueError, match="not the policy"):
        engine.sync_from(_policy(seed=1))
    out = engine.generate([tok("12 + 3 =")["input_ids"]], 2, SamplingParams(max_tokens=6, temperature=1.0, seed=0))
    assert len(out) == 1 and len(out[0]) == 2 and all(1 <= len(c.token_ids) <= 6 for c in out[0])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_one_gpu_step_on_cuda_matches_float32_and_decodes_with_the_graph(tok):
    model = AutoModelForCausalLM.from_pretrained(build_tiny(), dtype=torch.float32, attn_implementation="sdpa")
    runner = prepare_model(model, ParallelConfig(), device="cuda", world_size=1)
    model = runner.module
    assert runner.autocast_dtype == torch.bfloat16 and next(model.parameters()).dtype == torch.float32
    mb = pack([[1, 2, 3, 4], [5, 6, 7]], [[8, 9], [10, 11, 12]], [[0, 1]], "cuda")[0]
    lp, _, _ = _logp_sum(model, mb, runner.autocast_dtype)
    ref, _, _ = _logp_sum(model, mb)
    torch.testing.assert_close(lp, ref, atol=0.15, rtol=0.05)
    engine = HFEngine(model, tok, batch_size=4, autocast_dtype=runner.autocast_dtype)
    assert engine.lean_decoder() is not None  # the bf16 copy is plain: lean step and CUDA graph apply
    out = engine.generate([tok("12 + 3 =")["input_ids"]], 4, SamplingParams(max_tokens=8, temperature=1.0, seed=0))
    assert all(1 <= len(c.token_ids) <= 8 for c in out[0])


def test_torch_varlen_under_autocast_gets_the_autocast_dtype(monkeypatch):
    """Under autocast q and k leave the rotary embedding in float32 (its cos/sin follow the float32 residual stream):
    the varlen kernel must still get bf16 (FlashAttention has no float32) instead of falling back to per-sequence
    sdpa. A stand-in with varlen_attn's contract records what it receives (the real one runs on CUDA only)."""
    import sys
    import types

    from fastgrpo.models.attention import _sdpa_per_sequence, _torch_varlen

    seen = []

    def varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, is_causal=True, enable_gqa=False):
        seen.append(q.dtype)
        bounds = cu_q.tolist()
        out = [torch.nn.functional.scaled_dot_product_attention(
            *(t[a:b].transpose(0, 1) for t in (q, k, v)), is_causal=True, scale=scale, enable_gqa=enable_gqa)
            for a, b in zip(bounds[:-1], bounds[1:])]
        return torch.cat(out, 1).transpose(0, 1)  # [T, H, d]

    monkeypatch.setitem(sys.modules, "torch.nn.attention.varlen", types.SimpleNamespace(varlen_attn=varlen_attn))
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 7, 32) for _ in range(3))  # [1, H, T, d], two sequences of 3 and 4 tokens
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    kw = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=4, max_length_k=4, sequence_bounds=[0, 3, 7])
    ref, _ = _sdpa_per_sequence(None, q, k, v, None, **kw)
    out, _ = _torch_varlen(None, q, k, v, None, **kw)
    assert seen == []  # float32 without autocast: the per-sequence fallback
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = _torch_varlen(None, q, k, v, None, **kw)
    assert seen == [torch.bfloat16] and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, atol=0.05, rtol=0.05)
