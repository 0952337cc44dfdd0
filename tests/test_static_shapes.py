"""Static shapes: packed rows padded to token buckets give the loss and gradients of the unpadded rows,
through the real packed forward and the fused GRPO head on the tiny model, for every attention backend that runs a
packed row on a CPU; the padded tensors have the fixed shapes a compiled block or a CUDA graph needs."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from fastgrpo.algorithms.sft import sft_update
from fastgrpo.config import ParallelConfig
from fastgrpo.distributed.parallelize import parallelize_model
from fastgrpo.kernels import linear_grpo_loss
from fastgrpo.models.attention import register_with_transformers
from fastgrpo.models.packing import AUTO_BUCKETS, pack, plan_microbatches, resolve_buckets, segment_capacity
from fastgrpo.models.tiny import build_tiny
from fastgrpo.runtime.metrics import StepMetrics
from fastgrpo.distributed.runner import ModelRunner, prepare_model
from fastgrpo.update.step import plan_step


def _batch(rng, n=5):
    prompts = [[rng.randrange(3, 250) for _ in range(rng.randrange(1, 9))] for _ in range(n)]
    completions = [[rng.randrange(3, 250) for _ in range(rng.randrange(1, 12))] for _ in range(n)]
    return prompts, completions


def _loss_and_grads(model, mbs, adv, weights):
    """The GRPO loss of the step summed over micro-batches, and every parameter's gradient."""
    model.zero_grad(set_to_none=True)
    total = torch.zeros(())
    for mb in mbs:
        def head(h, w, mb=mb):  # h [n, H], w [V, H]
            return linear_grpo_loss(h, w, mb.targets, adv[mb.flat_index], weights[mb.flat_index], backend="torch")[0]
        loss = ModelRunner(model).packed_forward(mb, head)
        loss.backward()
        total += loss.detach()
    return total, {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("attn", ["sdpa_varlen", "sdpa", "varlen_op", "eager"])
def test_a_padded_microbatch_gives_the_loss_and_gradients_of_the_unpadded_one(rng, attn):
    register_with_transformers()
    model = AutoModelForCausalLM.from_pretrained(build_tiny(), attn_implementation=attn).train()
    model = parallelize_model(model, ParallelConfig(), device="cpu", world_size=1)
    prompts, completions = _batch(rng)
    bins = plan_microbatches([len(p) + len(c) for p, c in zip(prompts, completions)], 24)
    n_tok = sum(map(len, completions))
    adv = torch.randn(n_tok, generator=torch.Generator().manual_seed(rng.randrange(1 << 30)))  # [N]
    weights = torch.rand(n_tok, generator=torch.Generator().manual_seed(rng.randrange(1 << 30)))  # [N]
    plain = pack(prompts, completions, bins, "cpu")
    padded = pack(prompts, completions, bins + [[]], "cpu", buckets=[16, 32, 64], max_seqlen=20)
    assert any(mb.pad_lengths for mb in padded)
    ref_loss, ref = _loss_and_grads(model, plain, adv, weights)
    loss, grads = _loss_and_grads(model, padded, adv, weights)  # with a dummy row padded too: it adds nothing
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    for name in ref:
        torch.testing.assert_close(grads[name], ref[name], rtol=1e-4, atol=1e-6, msg=name)


def test_padded_rows_have_the_bucket_shapes_and_a_tail_that_predicts_nothing(rng):
    prompts, completions = _batch(rng, n=7)
    lengths = [len(p) + len(c) for p, c in zip(prompts, completions)]
    bins = plan_microbatches(lengths, 30)
    plain = pack(prompts, completions, bins, "cpu")
    for mb, ref in zip(pack(prompts, completions, bins, "cpu", buckets=[32, 8, 16], max_seqlen=20), plain):
        bucket = min(b for b in (8, 16, 32) if b >= ref.num_tokens)
        assert mb.num_tokens == bucket and mb.input_ids.shape == mb.position_ids.shape == (1, bucket)
        assert mb.cu_seqlens.shape == (segment_capacity(bucket),) and mb.cu_seqlens.dtype == torch.int32
        cu = mb.cu_seqlens.tolist()
        assert cu[:len(ref.cu_seqlens)] == ref.cu_seqlens.tolist() and cu[-1] == bucket
        assert cu == sorted(cu) and mb.max_seqlen == 20 and max(mb.segment_lengths) <= 20
        assert sum(mb.segment_lengths) == bucket
        # the real tokens are untouched and nothing reads the tail: same targets, same hidden positions
        for field in ("hidden_index", "targets", "flat_index"):
            assert torch.equal(getattr(mb, field), getattr(ref, field)), field
        tail = mb.position_ids[0, ref.num_tokens:].tolist()
        starts = [sum(mb.pad_lengths[:i]) for i in range(len(mb.pad_lengths))]  # none when the row fills its bucket
        assert [tail[s] for s in starts] == [0] * len(starts)  # position ids restart in every dummy segment
        assert set(mb.input_ids[0, ref.num_tokens:].tolist()) <= {0}


def test_a_row_longer_than_every_bucket_keeps_its_length():
    mb = pack([[1] * 30], [[2] * 10], [[0]], "cpu", buckets=[16, 32])[0]
    assert mb.num_tokens == 40 and not mb.pad_lengths and mb.cu_seqlens.tolist() == [0, 40] and mb.max_seqlen == 40


def test_bad_buckets_and_a_sequence_over_the_cap_are_refused():
    with pytest.raises(ValueError, match="buckets"):
        pack([[1]], [[2]], [[0]], "cpu", buckets=[1])
    with pytest.raises(ValueError, match="longer than max_seqlen=4"):
        pack([[1, 2, 3]], [[4, 5]], [[0]], "cpu", buckets=[8], max_seqlen=4)


def test_auto_buckets_are_the_budget_and_its_half_and_quarter():
    assert resolve_buckets(AUTO_BUCKETS, 4096) == [1024, 2048, 4096]
    assert resolve_buckets(AUTO_BUCKETS, 1000) == [256, 512, 1000]
    assert resolve_buckets(AUTO_BUCKETS, 40) == [40]
    assert resolve_buckets([64, 16, 64], 100) == [16, 64]


def test_the_step_plan_pads_to_the_models_buckets(rng):
    prompts, completions = _batch(rng, n=9)
    plan = plan_step(prompts, completions, 64, device="cpu", buckets=AUTO_BUCKETS)
    assert {mb.num_tokens for mb in plan.mbs} <= {64}  # auto buckets of a 64-token budget: [64]
    plan = plan_step(prompts, completions, 64, device="cpu", buckets=[16, 32, 64])
    assert {mb.num_tokens for mb in plan.mbs} <= {16, 32, 64}
    assert sum(mb.num_completion_tokens for mb in plan.mbs) == sum(map(len, completions))


def test_the_step_plan_keeps_padded_rows_to_few_shapes_that_launch_few_empty_blocks(rng):
    """A padded row's max_seqlen is the step's longest sequence rounded up to a power of two (not the bucket) and
    its cu_seqlens the power of two >= the entries it uses (not the bucket's worst case): the varlen kernels launch
    a block per (sequence slot, max_seqlen tile, head), so both set how many empty blocks each layer launches (the
    first H100 run: an eager-graphed update 4x slower than eager at max_seqlen = the bucket). Same segments,
    same loss inputs as the row pack gives."""
    prompts, completions = _batch(rng, n=40)  # sequences of 2..19 tokens, and one of 20: the longest is 20..
    prompts, completions = prompts + [[5, 6, 7]], completions + [[8] * 17]
    longest = max(len(p) + len(c) for p, c in zip(prompts, completions))
    plan = plan_step(prompts, completions, 256, device="cpu", buckets=[64, 128, 256])
    seq_lens = [len(p) + len(c) for p, c in zip(prompts, completions)]
    full = pack(prompts, completions, plan_microbatches(seq_lens, 256), "cpu", buckets=[64, 128, 256],
                max_seqlen=plan.mbs[0].max_seqlen)
    assert {mb.max_seqlen for mb in plan.mbs} == {32} and longest == 20  # every row's bucket is >= 64 here
    for mb, ref in zip(plan.mbs, full, strict=True):
        used = len(mb.segment_lengths) + 1
        c = mb.cu_seqlens.numel()
        assert c >= used and c & (c - 1) == 0 and (c == 8 or c < 2 * used)  # a power of two, at least 8
        assert c < segment_capacity(mb.num_tokens)  # far fewer than the bucket's worst case here
        assert mb.cu_seqlens.tolist() == ref.cu_seqlens[:c].tolist() and mb.cu_seqlens[-1] == mb.num_tokens
        assert set(ref.cu_seqlens[c:].tolist()) <= {mb.num_tokens}  # what was cut: empty segments only
        for field in ("input_ids", "hidden_index", "targets", "flat_index"):
            assert torch.equal(getattr(mb, field), getattr(ref, field)), field
    # a bucket shorter than the step's max_seqlen: the row's max_seqlen is the bucket (no sequence can be longer)
    small = plan_step(prompts[:2], completions[:2], 16, device="cpu", buckets=[16]).mbs
    assert {mb.max_seqlen for mb in small if mb.num_tokens == 16} <= {16}
    # without buckets nothing changes: exact boundaries, the row's own longest sequence
    for mb in plan_step(prompts, completions, 256, device="cpu").mbs:
        assert mb.cu_seqlens.numel() == len(mb.seq_lengths) + 1 and mb.max_seqlen == max(mb.seq_lengths)


def test_throughput_counts_the_real_tokens_of_padded_rows(rng):
    model = AutoModelForCausalLM.from_pretrained(build_tiny()).train()
    runner = prepare_model(model, ParallelConfig(token_buckets=[64]), device="cpu", world_size=1)
    prompts, completions = _batch(rng, n=3)  # at most 3 x 19 tokens: one row, always padded
    metrics = StepMetrics()
    mbs = sft_update(runner, prompts, completions, normalization="token", max_tokens_per_microbatch=64,
                     head_backend="torch", optimizer=torch.optim.SGD(model.parameters(), lr=0.0), max_grad_norm=0.0,
                     metrics=metrics, device="cpu")
    assert {mb.num_tokens for mb in mbs} == {64}  # padded to the model's bucket: more slots than real tokens
    assert sum(mb.num_tokens for mb in mbs) > sum(mb.num_real_tokens for mb in mbs)
    real = sum(len(p) + len(c) for p, c in zip(prompts, completions))
    assert metrics.reduce()["perf/update_tokens"] == real
