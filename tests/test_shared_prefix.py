"""Shared prompt prefixes in packed rows: each group's prompt forwarded once, the same log-probs, losses, gradients and
values as the unshared rows (fastgrpo.models.packing, "Shared prefixes").

The comparisons are against the same code with ``grpo.shared_prefix=false`` (packed unshared rows, themselves checked
against unpadded forwards in tests/test_packing.py), at 1e-5 relative in float32. ``_assert_same`` is the one
comparison; the planted faults (a completion that sees a sibling's tokens, positions that restart) go through it
and must fail it.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fastgrpo.config import GRPOConfig, ParallelConfig, PPOConfig, RolloutConfig
from fastgrpo.models.attention import ATTN_BACKENDS, block_causal_mask, packed_attention_inputs, use_shared_prefix
from fastgrpo.models.loading import packed_head_forward
from fastgrpo.models.packing import (MicroBatch, common_prefix_length, pack, plan_microbatches,
                                     plan_shared_microbatches, prefix_groups)
from fastgrpo.models.varlen_op import bottom_right_causal, varlen_attn_kv
from fastgrpo.runtime.metrics import StepMetrics

transformers = pytest.importorskip("transformers")

VOCAB = 131
RTOL = 1e-5


from test_packing import _one_thread  # noqa: E402,F401 (the autouse fixture: one thread for tiny matmuls)


def grouped_batch(seed: int, groups: int = 3, size: int = 4, prompt: tuple[int, int] = (3, 14),
                  completion: tuple[int, int] = (1, 9)) -> tuple[list[list[int]], list[list[int]]]:
    """``groups`` prompts of different lengths, each sampled ``size`` times (completions of random lengths), in
    GRPO's order (a group's samples next to each other)."""
    g = torch.Generator().manual_seed(seed)

    def seq(lo: int, hi: int) -> list[int]:
        return torch.randint(0, VOCAB, (int(torch.randint(lo, hi + 1, (1,), generator=g)),), generator=g).tolist()

    prompts, completions = [], []
    for _ in range(groups):
        p = seq(*prompt)
        for _ in range(size):
            prompts.append(list(p))
            completions.append(seq(*completion))
    return prompts, completions


def _assert_same(got: torch.Tensor, want: torch.Tensor, what: str, rtol: float = RTOL) -> None:
    """Equal within ``rtol`` of the largest magnitude (float32; summation order differs where a prefix is shared)."""
    scale = want.abs().max().clamp(min=1e-6)
    gap = (got - want).abs().max()
    assert gap <= rtol * scale, f"{what}: differs by {gap:.3g} (scale {scale:.3g})"


def _assert_same_grads(model: torch.nn.Module, want: dict[str, torch.Tensor], rtol: float = RTOL) -> None:
    got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert got.keys() == want.keys() and want
    for name, g in want.items():
        _assert_same(got[name], g, f"grad {name}", rtol)


# ----------------------------------------------------------------------------------------------------------------
# Planning and layout (no model)


def _visible(mb: MicroBatch, position: int) -> list[int]:
    """The tokens row position ``position`` attends, in row order (from the row's dense mask)."""
    mask = block_causal_mask(mb)[0, 0, position]  # [T]
    return mb.input_ids[0, mask].tolist()


def test_each_predicting_position_sees_exactly_its_unshared_sequence():
    """Layout: the hidden state that predicts completion token t of sequence i sees sequence i's first P + t tokens,
    in order, at position P + t - 1, whatever the row holds beside it; and the varlen keys of every segment are what
    its last token sees in the mask."""
    prompts, completions = grouped_batch(seed=1)
    prompts[5] = prompts[5][:-1] + [(prompts[5][-1] + 1) % VOCAB]  # a rewritten prompt: shares a shorter prefix
    groups = prefix_groups(prompts, keys=[i // 4 for i in range(len(prompts))], min_saved_tokens=1)
    assert groups.prefix_lengths[1] == len(prompts[4]) - 1  # the group's common prefix stops at the rewrite
    lengths = [len(p) + len(c) for p, c in zip(prompts, completions)]
    mbs = pack(prompts, completions, plan_shared_microbatches(lengths, groups, 10_000), "cpu", groups=groups)
    assert len(mbs) == 1 and mbs[0].shares_prefix
    mb = mbs[0]
    flat = [(i, t) for i, c in enumerate(completions) for t in range(len(c))]
    for h, target, f in zip(mb.hidden_index.tolist(), mb.targets.tolist(), mb.flat_index.tolist()):
        i, t = flat[f]
        seq = prompts[i] + completions[i]
        assert target == completions[i][t]
        assert _visible(mb, h) == seq[:len(prompts[i]) + t]
        assert mb.position_ids[0, h] == len(prompts[i]) + t - 1
    # kv_index: segment k's keys are what its last token sees
    bounds, keys = [0, *torch.tensor(mb.segment_lengths).cumsum(0).tolist()], mb.cu_seqlens_k.tolist()
    for k in range(len(mb.segment_lengths)):
        last = bounds[k + 1] - 1
        assert mb.input_ids[0, mb.kv_index[keys[k]:keys[k + 1]]].tolist() == _visible(mb, last)
    assert mb.num_real_tokens < mb.num_sequence_tokens == sum(lengths)


@settings(max_examples=30, deadline=None)
@given(sizes=st.lists(st.integers(1, 5), min_size=1, max_size=4), budget=st.integers(12, 80),
       padded=st.booleans(), seed=st.integers(0, 1000))
def test_every_shared_plan_shows_each_prediction_its_unshared_context(sizes, budget, padded, seed):
    """Layout, over random groups (rewritten prompts among them), budgets and token buckets: each predicting
    position sees its sequence's tokens so far and sits at its unshared position; the keys of each segment are what
    its last token sees."""
    g = torch.Generator().manual_seed(seed)
    prompts, completions = [], []
    for n in sizes:
        p = torch.randint(0, VOCAB, (int(torch.randint(1, 15, (1,), generator=g)),), generator=g).tolist()
        for _ in range(n):
            rewrite = bool(torch.rand(1, generator=g) < 0.2) and len(p) > 1  # an environment's rewrite: own key
            prompts.append(p[:-1] + [(p[-1] + 1) % VOCAB] if rewrite else list(p))
            completions.append(torch.randint(0, VOCAB, (int(torch.randint(1, 8, (1,), generator=g)),),
                                             generator=g).tolist())
    lengths = [len(p) + len(c) for p, c in zip(prompts, completions)]
    groups = prefix_groups(prompts, min_saved_tokens=1)
    bins = plan_shared_microbatches(lengths, groups, budget)
    kw = dict(buckets=[32, 64, 128], max_seqlen=32) if padded else {}
    flat = [(i, t) for i, c in enumerate(completions) for t in range(len(c))]
    seen = []
    for mb in pack(prompts, completions, bins, "cpu", groups=groups, **kw):
        mask = block_causal_mask(mb)[0, 0]  # [T, T]
        for h, f in zip(mb.hidden_index.tolist(), mb.flat_index.tolist()):
            i, t = flat[f]
            assert mb.input_ids[0, mask[h]].tolist() == (prompts[i] + completions[i])[:len(prompts[i]) + t]
            assert mb.position_ids[0, h] == len(prompts[i]) + t - 1
            seen.append(f)
        if mb.shares_prefix:
            ends = torch.tensor(mb.segment_lengths).cumsum(0).tolist()
            keys = mb.cu_seqlens_k.tolist()
            for k, end in enumerate(ends):
                if mb.segment_lengths[k]:
                    assert torch.equal(mb.kv_index[keys[k]:keys[k + 1]], mask[end - 1].nonzero()[:, 0])
    assert sorted(seen) == list(range(len(flat)))


@settings(max_examples=40, deadline=None)
@given(sizes=st.lists(st.integers(1, 6), min_size=1, max_size=5), budget=st.integers(8, 90),
       seed=st.integers(0, 1000))
def test_shared_plan_covers_each_sequence_once_within_budget(sizes, budget, seed):
    g = torch.Generator().manual_seed(seed)
    prompts, completions = [], []
    for n in sizes:
        p = torch.randint(0, VOCAB, (int(torch.randint(1, 20, (1,), generator=g)),), generator=g).tolist()
        for _ in range(n):
            prompts.append(p)
            completions.append([1] * int(torch.randint(1, 12, (1,), generator=g)))
    lengths = [len(p) + len(c) for p, c in zip(prompts, completions)]
    groups = prefix_groups(prompts, min_saved_tokens=1)
    bins = plan_shared_microbatches(lengths, groups, budget)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    for b, mb in zip(bins, pack(prompts, completions, bins, "cpu", groups=groups)):
        assert b == sorted(b) and sorted(mb.seq_indices) == b
        # over the budget only where one sequence alone is
        assert mb.num_tokens <= budget or (len(b) == 1 and lengths[b[0]] > budget)
    for g, shared in enumerate(groups.prefix_lengths):  # a group that fits the budget, prefix once, is in one row
        members = {i for i, h in enumerate(groups.group_of) if h == g}
        if sum(lengths[i] for i in members) - (len(members) - 1) * shared <= budget:
            assert sum(members <= set(b) for b in bins) == 1


def test_a_group_over_the_budget_repeats_its_prefix_in_each_part():
    prompts, completions = grouped_batch(seed=2, groups=1, size=8, prompt=(12, 12), completion=(6, 6))
    lengths = [len(p) + len(c) for p, c in zip(prompts, completions)]  # 8 x 18: one row would hold 12 + 8 x 6
    groups = prefix_groups(prompts)
    bins = plan_shared_microbatches(lengths, groups, 40)  # 12 + 4 x 6 = 36 per part
    mbs = pack(prompts, completions, bins, "cpu", groups=groups)
    assert [len(b) for b in bins] == [4, 4] and all(mb.shares_prefix and mb.num_tokens == 36 for mb in mbs)


def test_what_does_not_pay_is_packed_as_without_groups():
    """Sequences alone with their prompt, and a group saving fewer tokens than min_saved_tokens, give exactly the rows
    of the unshared packing."""
    prompts, completions = grouped_batch(seed=3, groups=2, size=2, prompt=(3, 3))
    prompts += [[7, 8, 9]]
    completions += [[1, 2]]
    groups = prefix_groups(prompts)  # (2 - 1) x 3 tokens saved < 16
    assert groups.group_of[-1] == -1 and not groups.shares(0, 2)
    bins = [list(range(len(prompts)))]
    shared, plain = pack(prompts, completions, bins, "cpu", groups=groups)[0], pack(prompts, completions, bins, "cpu")[0]
    assert not shared.shares_prefix
    for f in ("input_ids", "position_ids", "hidden_index", "targets", "flat_index", "cu_seqlens", "segment_ids"):
        assert torch.equal(getattr(shared, f), getattr(plain, f)), f


def test_pack_refuses_groups_that_do_not_match_the_prompts():
    prompts, completions = grouped_batch(seed=4, groups=1, size=3, prompt=(20, 20))
    groups = prefix_groups(prompts)
    prompts[1] = [(t + 1) % VOCAB for t in prompts[1]]
    with pytest.raises(ValueError, match="sequence 1 does not start with its group's shared prefix"):
        pack(prompts, completions, [[0, 1, 2]], "cpu", groups=groups)
    assert common_prefix_length([[1, 2, 3], [1, 2], [1, 2, 4]]) == 2 and common_prefix_length([]) == 0


def test_padded_rows_with_a_shared_prefix_keep_their_bucket_and_keys():
    prompts, completions = grouped_batch(seed=5, groups=2, size=4, prompt=(9, 9))
    groups = prefix_groups(prompts, min_saved_tokens=1)
    mb = pack(prompts, completions, [list(range(8))], "cpu", groups=groups, buckets=[128], max_seqlen=32)[0]
    assert mb.num_tokens == 128 and mb.shares_prefix and mb.pad_lengths
    assert mb.cu_seqlens.shape == mb.cu_seqlens_k.shape and mb.cu_seqlens[-1] == 128
    assert mb.cu_seqlens_k[-1] == mb.kv_index.numel() == sum(mb.key_segment_lengths)
    assert mb.context_ids.shape == (128,) and (mb.context_ids[-sum(mb.pad_lengths):] == -1).all()


# ----------------------------------------------------------------------------------------------------------------
# The attention op with keys of their own layout


@pytest.mark.parametrize("heads", [(2, 2), (4, 2)])
def test_varlen_attn_kv_equals_masked_sdpa_with_gradients(heads):
    hq, hkv = heads
    lengths_q, lengths_k = [5, 3, 1, 4], [5, 8, 6, 4]  # bottom-right: 3 queries over 8 keys, ...
    g = torch.Generator().manual_seed(0)
    q = torch.randn(sum(lengths_q), hq, 8, generator=g, requires_grad=True)
    k = torch.randn(sum(lengths_k), hkv, 8, generator=g, requires_grad=True)
    v = torch.randn(sum(lengths_k), hkv, 8, generator=g, requires_grad=True)
    cu_q = torch.tensor([0, *torch.tensor(lengths_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lengths_k).cumsum(0).tolist()], dtype=torch.int32)
    out = varlen_attn_kv(q, k, v, cu_q, cu_k, 8, 0.3)
    w = torch.randn_like(out)
    dq, dk, dv = torch.autograd.grad((out * w).sum(), (q, k, v))
    ref = []
    for qs, ks, vs in zip(q.split(lengths_q), k.split(lengths_k), v.split(lengths_k)):
        ks, vs = (t.repeat_interleave(hq // hkv, dim=1) for t in (ks, vs))
        s = torch.einsum("qhd,khd->hqk", qs, ks) * 0.3
        p = s.masked_fill(~bottom_right_causal(qs.shape[0], ks.shape[0], q.device), float("-inf")).softmax(-1)
        ref.append(torch.einsum("hqk,khd->qhd", p, vs))
    ref = torch.cat(ref)
    rq, rk, rv = torch.autograd.grad((ref * w).sum(), (q, k, v))
    for got, want, what in ((out, ref, "out"), (dq, rq, "dq"), (dk, rk, "dk"), (dv, rv, "dv")):
        _assert_same(got, want, what)
    torch.library.opcheck(torch.ops.fastgrpo.varlen_attn_kv.default, (q, k, v, cu_q, cu_k, 8, 0.3))


# ----------------------------------------------------------------------------------------------------------------
# The packed forward on each backend that can attend a shared prefix


def tiny_model(family: str, attn: str, seed: int = 0) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    from fastgrpo.models.attention import register_with_transformers

    register_with_transformers()
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=72, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=32, max_position_embeddings=128, attn_implementation=attn)
    cfg = (Qwen2Config(tie_word_embeddings=True, **common) if family == "qwen2" else
           LlamaConfig(tie_word_embeddings=False, **common))
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg).float().train()


def _logprobs(model: torch.nn.Module, mbs: list[MicroBatch], n: int) -> torch.Tensor:
    """[F] the log-probs of every completion token through the packed forward; gradients flow to the model."""
    out = torch.zeros(n, device=mbs[0].targets.device)
    for mb in mbs:
        lp = packed_head_forward(model, mb, lambda h, w: torch.log_softmax(h @ w.T, -1))  # [N, V]
        out = out.index_put((mb.flat_index,), lp.gather(1, mb.targets[:, None])[:, 0])
    return out


def _packed(prompts, completions, budget, *, shared: bool, buckets=(), max_seqlen=None) -> list[MicroBatch]:
    lengths = [len(p) + len(c) for p, c in zip(prompts, completions)]
    groups = prefix_groups(prompts, min_saved_tokens=1) if shared else None
    bins = plan_shared_microbatches(lengths, groups, budget) if shared else plan_microbatches(lengths, budget)
    return pack(prompts, completions, bins, "cpu", groups=groups, buckets=buckets, max_seqlen=max_seqlen)


def _shared_vs_unshared(model, prompts, completions, budget, **kw) -> tuple:
    """(shared log-probs, unshared log-probs, unshared gradients); the model's .grad holds the shared ones."""
    n = sum(map(len, completions))
    w = torch.randn(n, generator=torch.Generator().manual_seed(9))  # [F] weights: every position gets gradient
    ref = _logprobs(model, _packed(prompts, completions, budget, shared=False, **kw), n)
    (w * ref).sum().backward()
    want = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    mbs = _packed(prompts, completions, budget, shared=True, **kw)
    assert any(mb.shares_prefix for mb in mbs)
    got = _logprobs(model, mbs, n)
    (w * got).sum().backward()
    return got, ref.detach(), want


@pytest.mark.parametrize("family,attn", [("qwen2", "sdpa"), ("llama", "sdpa"), ("qwen2", "sdpa_varlen"),
                                         ("llama", "sdpa_varlen"), ("qwen2", "varlen_op")])
def test_shared_rows_give_the_unshared_logprobs_and_gradients(family, attn):
    """Groups of different prompt lengths in one row, and a budget that sends a group over two rows."""
    model = tiny_model(family, attn)
    prompts, completions = grouped_batch(seed=11)
    got, want, grads = _shared_vs_unshared(model, prompts, completions, budget=60)
    _assert_same(got, want, "log-probs")
    _assert_same_grads(model, grads)


def test_padded_shared_rows_give_the_unshared_logprobs_and_gradients():
    model = tiny_model("qwen2", "sdpa_varlen")
    prompts, completions = grouped_batch(seed=12)
    got, want, grads = _shared_vs_unshared(model, prompts, completions, budget=64, buckets=[32, 64, 128],
                                           max_seqlen=32)
    _assert_same(got, want, "log-probs")
    _assert_same_grads(model, grads)


def _leak_sibling(mb: MicroBatch) -> MicroBatch:
    """A planted fault: the second sequence of the row's first group also sees the first one's own tokens."""
    first, second = 1, 2  # segments: 0 the prefix, 1 and 2 its first two sequences
    context = mb.context_ids.clone()
    context[mb.segment_ids == second] = first  # the mask: segment 2 sees segment 1 in full (and not the prefix)
    bounds = torch.tensor(mb.key_segment_lengths).cumsum(0).tolist()
    kv = mb.kv_index.tolist()
    prefix = mb.segment_lengths[0]
    start = sum(mb.segment_lengths[:first])
    own_first = list(range(start, start + mb.segment_lengths[first]))
    # the keys: segment 2 attends [prefix ; segment 1 ; own] instead of [prefix ; own]
    kv = kv[:bounds[first] + prefix] + own_first + kv[bounds[first] + prefix:]
    keys = list(mb.key_segment_lengths)
    keys[second] += len(own_first)
    cu_k = torch.tensor([0, *torch.tensor(keys).cumsum(0).tolist()], dtype=torch.int32)
    return dataclasses.replace(mb, context_ids=context, kv_index=torch.tensor(kv), cu_seqlens_k=cu_k,
                               key_lengths=keys[:len(mb.row_segments)])


def _restart_positions(mb: MicroBatch) -> MicroBatch:
    """A planted fault: every own segment's positions restart at 0 instead of continuing its prefix's."""
    pos = torch.cat([torch.arange(n) for n in mb.segment_lengths])[None]
    return dataclasses.replace(mb, position_ids=pos)


@pytest.mark.parametrize("fault", [_leak_sibling, _restart_positions])
@pytest.mark.parametrize("attn", ["sdpa", "sdpa_varlen", "varlen_op"])
def test_a_planted_fault_fails_the_comparison(attn, fault):
    """The comparison the exactness tests make catches a completion that sees a sibling's tokens, or shifted
    positions (and passes on the same row without the fault)."""
    model = tiny_model("qwen2", attn)
    prompts, completions = grouped_batch(seed=13, groups=1, size=3)
    n = sum(map(len, completions))
    mbs = _packed(prompts, completions, 1000, shared=True)
    assert len(mbs) == 1 and mbs[0].shares_prefix
    with torch.no_grad():
        want = _logprobs(model, _packed(prompts, completions, 1000, shared=False), n)
        _assert_same(_logprobs(model, mbs, n), want, "log-probs")
        with pytest.raises(AssertionError, match="log-probs: differs"):
            _assert_same(_logprobs(model, [fault(mbs[0])], n), want, "log-probs")


@pytest.mark.parametrize("attn", ["eager", "flex_attention"])
def test_backends_that_cannot_attend_a_shared_prefix_refuse_it(attn):
    prompts, completions = grouped_batch(seed=14, groups=1, size=3, prompt=(20, 20))
    mb = _packed(prompts, completions, 1000, shared=True)[0]
    config = transformers.Qwen2Config(attn_implementation="sdpa")
    config._attn_implementation = attn
    with pytest.raises(ValueError, match=f"{attn} cannot attend a shared prefix"):
        packed_attention_inputs(config, mb)
    assert not ATTN_BACKENDS[attn].shared_prefix
    assert not use_shared_prefix("auto", impl=attn)
    with pytest.raises(ValueError, match=rf"grpo.shared_prefix=true, but model.attn_implementation={attn}: "):
        use_shared_prefix("true", impl=attn)


def test_shared_prefix_true_with_an_attention_that_cannot_is_one_line_before_the_model_loads(tmp_path, capsys,
                                                                                              monkeypatch):
    from fastgrpo import train
    from fastgrpo.config import load_config
    from fastgrpo.trainers import loop

    monkeypatch.setattr(loop, "load_model", lambda *a, **k: pytest.fail("the check must come before the load"))
    base = ["data.source=toy", "rewards.funcs=[toy_digit]", "device=cpu", "model.name_or_path=tiny", "max_steps=1",
            f"output_dir={tmp_path}", "name=run"]
    for extra, needle in ((["model.attn_implementation=eager"], "model.attn_implementation=eager: "),
                          (["parallel.compile=true"], "parallel.compile")):
        assert train.main([*base, *extra, "grpo.shared_prefix=true"]) == 2
        err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert len(err) == 1 and "grpo.shared_prefix=true, but" in err[0] and needle in err[0], err
    assert load_config(None, [*base, "model.attn_implementation=eager"]).grpo.shared_prefix == "auto"
    assert load_config(None, [*base, "grpo.shared_prefix=true"]).grpo.shared_prefix == "true"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch_varlen runs on CUDA only")
def test_torch_varlen_shared_rows_equal_unshared_on_gpu():
    model = tiny_model("qwen2", "torch_varlen").cuda().to(torch.bfloat16)
    prompts, completions = grouped_batch(seed=15)
    n = sum(map(len, completions))

    def on_gpu(mbs):
        return [dataclasses.replace(mb, **{f.name: getattr(mb, f.name).cuda() for f in dataclasses.fields(mb)
                                           if isinstance(getattr(mb, f.name), torch.Tensor)}) for mb in mbs]

    with torch.no_grad():
        got = _logprobs(model, on_gpu(_packed(prompts, completions, 60, shared=True)), n)
        want = _logprobs(model, on_gpu(_packed(prompts, completions, 60, shared=False)), n)
    torch.testing.assert_close(got.cpu(), want.cpu(), rtol=0, atol=5e-2)  # bf16: FlashAttention's own rounding


# ----------------------------------------------------------------------------------------------------------------
# The trainer's update functions: GRPO (every loss type, beta, mu, GSPO), LoRA, PPO with its critic, buckets


def _grpo_batch(seed: int):
    from fastgrpo.algorithms.grpo import GRPOBatch

    prompts, completions = grouped_batch(seed)
    prompts[6] = prompts[6][:-1] + [(prompts[6][-1] + 1) % VOCAB]  # an environment rewrote one sample's prompt
    advantages = torch.randn(len(prompts), generator=torch.Generator().manual_seed(seed))
    return GRPOBatch(prompt_ids=prompts, completion_ids=completions, advantages=advantages)


def _grpo_run(model, batch, *, shared: bool, budget: int, ref=None, rollout: dict | None = None,
              **grpo) -> tuple[dict, dict, list]:
    """The trainer's GRPO update with lr 0 (the weights stay, .grad holds the last update's gradients); returns
    (gradients, metrics, micro-batches)."""
    from fastgrpo.algorithms.grpo import grpo_update

    metrics = StepMetrics()
    module = getattr(model, "module", model)  # a runner's module
    params = [p for p in module.parameters() if p.requires_grad]
    mbs = grpo_update(model, batch, grpo=GRPOConfig(head_backend="torch", max_tokens_per_microbatch=budget,
                                                    shared_prefix="true" if shared else "false", **grpo),
                      rollout=RolloutConfig(max_completion_length=16, **(rollout or {})),
                      optimizer=torch.optim.SGD(params, lr=0.0),
                      max_grad_norm=0.0, metrics=metrics, device="cpu", ref_model=ref)
    grads = {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
    module.zero_grad(set_to_none=True)
    return grads, metrics.reduce(), mbs


def _assert_update_matches(model, batch, *, budget: int, ref=None, rollout: dict | None = None,
                           **grpo) -> list[MicroBatch]:
    want, want_metrics, _ = _grpo_run(model, batch, shared=False, budget=budget, ref=ref, rollout=rollout, **grpo)
    got, got_metrics, mbs = _grpo_run(model, batch, shared=True, budget=budget, ref=ref, rollout=rollout, **grpo)
    assert any(mb.shares_prefix for mb in mbs)
    assert got.keys() == want.keys() and want
    for name in want:
        _assert_same(got[name], want[name], f"grad {name}")
    for key in ("loss", "policy/grad_norm", "policy/kl_mean"):
        if key in want_metrics:
            _assert_same(torch.tensor(got_metrics[key]), torch.tensor(want_metrics[key]), key)
    # the same sequences' tokens, fewer forwarded
    assert got_metrics["perf/update_tokens"] == want_metrics["perf/update_tokens"] == sum(
        len(p) + len(c) for p, c in zip(batch.prompt_ids, batch.completion_ids))
    assert got_metrics["perf/update_tokens_forwarded"] < want_metrics["perf/update_tokens_forwarded"]
    return mbs


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo", "luspo", "cispo", "sapo"])
def test_grpo_update_shared_equals_unshared_for_every_loss_type(loss_type):
    """A budget of 30 tokens sends groups over two micro-batches (each part repeats the prefix)."""
    mbs = _assert_update_matches(tiny_model("qwen2", "sdpa_varlen"), _grpo_batch(21), budget=30, loss_type=loss_type)
    spread = [{i // 4 for i in mb.seq_indices} for mb in mbs]
    assert any(sum(g in s for s in spread) > 1 for g in range(3))  # a group split across micro-batches


@pytest.mark.parametrize("grpo", [dict(loss_type="grpo", beta=0.1, num_iterations=2),
                                  dict(loss_type="dapo", beta=0.1, importance_sampling_level="sequence"),
                                  dict(loss_type="dr_grpo", top_entropy_quantile=0.5)])
def test_grpo_update_with_reference_old_logprobs_and_sequence_ratios_shared_equals_unshared(grpo):
    ref = tiny_model("qwen2", "sdpa_varlen", seed=5).requires_grad_(False)
    _assert_update_matches(tiny_model("qwen2", "sdpa_varlen"), _grpo_batch(22), budget=200, ref=ref, **grpo)


@pytest.mark.parametrize("fault", [_leak_sibling, _restart_positions])
def test_a_planted_fault_fails_the_update_comparison(fault, monkeypatch):
    """The update-level comparison fails when the shared rows carry a fault (the step's packing patched)."""
    import fastgrpo.update.step as step

    pack_rows = step.pack

    def faulty(*args, **kwargs):
        return [fault(mb) if mb.shares_prefix else mb for mb in pack_rows(*args, **kwargs)]

    monkeypatch.setattr(step, "pack", faulty)
    with pytest.raises(AssertionError, match="differs"):
        _assert_update_matches(tiny_model("qwen2", "sdpa_varlen"), _grpo_batch(26), budget=200, loss_type="dapo")


def test_update_with_sampler_logprobs_shared_equals_unshared():
    """Truncated importance sampling against the sampler's log-probs (the old log-prob pass and its kept mass)."""
    batch = _grpo_batch(28)
    batch.sampler_logprobs = -torch.rand(sum(map(len, batch.completion_ids)),
                                         generator=torch.Generator().manual_seed(4)) * 6  # [N]
    _assert_update_matches(tiny_model("qwen2", "sdpa_varlen"), batch, budget=60, loss_type="grpo", num_iterations=2,
                           rollout=dict(importance_sampling_cap=2.0, top_p=0.9))


def test_multi_turn_update_with_environment_tokens_shared_equals_unshared():
    """A multi-turn batch: environment tokens inside the completions (model_mask False: attended, weight 0)."""
    batch = _grpo_batch(27)
    g = torch.Generator().manual_seed(3)
    batch.model_mask = torch.rand(sum(map(len, batch.completion_ids)), generator=g) > 0.3  # [N]
    _assert_update_matches(tiny_model("qwen2", "sdpa_varlen"), batch, budget=60, loss_type="dapo")


def test_the_trainer_step_shares_by_default_and_logs_both_counts(tmp_path):
    """The trainer's own step (the golden test's run, G = 4 samples of 3 prompts, sdpa_varlen on a CPU): 'auto'
    shares, the record counts the sequences' tokens and, fewer, the tokens forwarded, and so the FLOPs and the MFU
    (a peak stood in for the CUDA device's); with sharing off the two agree and the loss is the same."""
    from test_golden import ScriptedEngine

    from fastgrpo.config import load_config
    from fastgrpo.models.loading import load_tokenizer
    from fastgrpo.trainers.grpo import Trainer

    records = {}
    for setting in ("auto", "false"):
        cfg = load_config(None, [
            "data.source=toy", "rewards.funcs=[toy_digit]", "model.name_or_path=tiny", "device=cpu", "seed=3",
            "rollout.max_completion_length=5", "grpo.prompts_per_step=3", "grpo.num_generations=4",
            "grpo.max_tokens_per_microbatch=1024", "eval.every=-1", "log.progress=false", "checkpoint.resume=never",
            f"grpo.shared_prefix={setting}", f"output_dir={tmp_path / setting}"])
        torch.manual_seed(0)
        trainer = Trainer(cfg, engine=ScriptedEngine(load_tokenizer(cfg.model, seed=cfg.seed)))
        assert trainer.peak_flops is None  # a CPU: no MFU of its own
        trainer.peak_flops = 1e12
        records[setting], _ = trainer.train_step()
    on, off = records["auto"], records["false"]
    assert on["perf/update_tokens"] == off["perf/update_tokens"] == off["perf/update_tokens_forwarded"]
    assert on["perf/update_tokens_forwarded"] < on["perf/update_tokens"]
    assert on["perf/update_tokens_forwarded_per_s"] < on["perf/update_tokens_per_s"]
    assert on["perf/update_flops"] == off["perf/update_flops"] == off["perf/update_flops_forwarded"]
    assert on["perf/update_flops_forwarded"] < on["perf/update_flops"]
    assert on["perf/mfu"] / on["perf/mfu_sequences"] == pytest.approx(
        on["perf/update_flops_forwarded"] / on["perf/update_flops"])
    assert off["perf/mfu"] == off["perf/mfu_sequences"] > 0
    _assert_same(torch.tensor(on["loss"]), torch.tensor(off["loss"]), "loss")


def test_lora_update_with_the_base_as_reference_shared_equals_unshared():
    pytest.importorskip("peft")
    from dist_helpers import tiny_lora

    from fastgrpo.distributed.runner import AdapterDisabled

    model = tiny_lora()
    _assert_update_matches(model, _grpo_batch(23), budget=60, ref=AdapterDisabled(model), loss_type="grpo", beta=0.1)


def test_static_buckets_shared_equals_unshared():
    from fastgrpo.distributed.runner import prepare_model

    runner = prepare_model(tiny_model("llama", "sdpa_varlen"), ParallelConfig(token_buckets=[64, 128]),
                           device="cpu", world_size=1)
    want, _, _ = _grpo_run(runner, _grpo_batch(24), shared=False, budget=128, loss_type="dapo")
    got, _, mbs = _grpo_run(runner, _grpo_batch(24), shared=True, budget=128, loss_type="dapo")
    assert all(mb.num_tokens in (64, 128) for mb in mbs) and any(mb.shares_prefix for mb in mbs)
    for name in want:
        _assert_same(got[name], want[name], f"grad {name}")


def test_ppo_update_and_critic_values_shared_equal_unshared():
    """PPO (two epochs, a KL penalty from a reference): the critic's values, and after the update both models'
    weights (lr 0.5: any difference in gradients shows)."""
    from dist_helpers import tiny_qwen2

    from fastgrpo.algorithms.critic import attach_value_head, packed_values
    from fastgrpo.algorithms.ppo import PPOBatch, ppo_update

    batch = _grpo_batch(25)
    batch = PPOBatch(prompt_ids=batch.prompt_ids, completion_ids=batch.completion_ids,
                     rewards=torch.randn(len(batch.prompt_ids), generator=torch.Generator().manual_seed(1)))
    n = sum(map(len, batch.completion_ids))
    results = {}
    for shared in (False, True):
        policy, ref = tiny_qwen2(0), tiny_qwen2(2).requires_grad_(False)
        critic = attach_value_head(tiny_qwen2(1), seed=3)
        mbs = _packed(batch.prompt_ids, batch.completion_ids, 40, shared=shared)
        values = packed_values(critic, mbs, n)  # [N]
        metrics = StepMetrics()
        ppo_update(policy, critic, batch, grpo=GRPOConfig(loss_type="grpo", max_tokens_per_microbatch=40,
                                                          head_backend="torch", shared_prefix=str(shared).lower()),
                   ppo=PPOConfig(gamma=0.95, lam=0.9, kl_coef=0.05, num_ppo_epochs=2, vf_coef=0.5),
                   rollout=RolloutConfig(max_completion_length=16),
                   optimizer=torch.optim.SGD(policy.parameters(), lr=0.5),
                   critic_optimizer=torch.optim.SGD(critic.parameters(), lr=0.5), max_grad_norm=0.0,
                   metrics=metrics, device="cpu", ref_model=ref, seed=7)
        results[shared] = values, dict(policy.named_parameters()), dict(critic.named_parameters()), metrics.reduce()
    (v0, p0, c0, m0), (v1, p1, c1, m1) = results[False], results[True]
    _assert_same(v1, v0, "values")
    for name in p0:
        _assert_same(p1[name].detach(), p0[name].detach(), f"policy {name}")
    for name in c0:
        _assert_same(c1[name].detach(), c0[name].detach(), f"critic {name}")
    for key in ("loss", "critic/loss", "critic/explained_variance"):
        _assert_same(torch.tensor(m1[key]), torch.tensor(m0[key]), key)
    assert m1["perf/update_tokens_forwarded"] < m0["perf/update_tokens_forwarded"]


def _fake_flash_attn(monkeypatch) -> list:
    """A stand-in ``flash_attn`` package whose varlen kernel is fastgrpo's CPU op with flash-attn's conventions
    (``causal=True`` aligned bottom-right): the plumbing of the flash_attention_2 path runs on a CPU. Returns the
    calls it saw."""
    import sys
    import types

    calls = []

    def flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=0.0, softmax_scale=None, causal=False):
        calls.append((q.shape, k.shape, causal))
        assert causal and dropout_p == 0.0 and max_q >= 1 and max_k >= 1
        return varlen_attn_kv(q.float(), k.float(), v.float(), cu_q, cu_k, max_k, softmax_scale).to(q.dtype)

    monkeypatch.setitem(sys.modules, "flash_attn", types.SimpleNamespace(flash_attn_varlen_func=flash_attn_varlen_func))
    return calls


def test_flash_attention_2_runs_a_shared_row_through_the_varlen_kernel_on_gathered_keys(monkeypatch):
    """flash_attention_2: a shared row goes to flash-attn's varlen kernel with each segment's keys gathered (a
    stand-in kernel here: no flash-attn on a CPU), and gives the unshared log-probs and gradients; a row without a
    shared prefix still goes to transformers' own function."""
    from transformers.integrations import flash_attention

    calls = _fake_flash_attn(monkeypatch)
    model = tiny_model("qwen2", "sdpa")
    prompts, completions = grouped_batch(seed=16)
    got_plain = []
    monkeypatch.setattr(flash_attention, "flash_attention_forward",
                        lambda *a, **k: got_plain.append(k) or (_ for _ in ()).throw(RuntimeError("transformers'")))
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(RuntimeError, match="transformers'"):  # unshared rows: transformers' function, as before
        _logprobs(model, _packed(prompts, completions, 60, shared=False), 1)
    assert got_plain and "kv_index" not in got_plain[0] and not calls
    n = sum(map(len, completions))
    got = _logprobs(model, _packed(prompts, completions, 60, shared=True), n)
    assert calls and all(k[0] > q[0] for q, k, _ in calls)  # the gathered keys: each prefix once per sequence
    model.config._attn_implementation = "sdpa"
    want = _logprobs(model, _packed(prompts, completions, 60, shared=False), n)
    _assert_same(got, want, "log-probs")


def test_fsdp_two_ranks_with_shared_prefixes_equal_one_process_without(tmp_path):
    """FSDP2 on 2 gloo ranks, each sharing its groups' prefixes (a group split over micro-batches, one rank padded
    with dummy micro-batches) gives the gradients of one process without sharing."""
    import sys
    from pathlib import Path

    import shared_prefix_ranks as spr
    from _launch import run_ranks
    from dist_helpers import tiny_qwen2

    out = tmp_path / "rank0.pt"
    run_ranks([sys.executable, str(Path(__file__).with_name("shared_prefix_ranks.py")), "--out", str(out)],
              what="FSDP workers", timeout=120)
    got = torch.load(out)
    model = tiny_qwen2()
    want_metrics = spr.update(model, list(range(16)), shared=False)
    _assert_same_grads(model, got["grads"])
    assert got["metrics"]["perf/update_tokens"] == want_metrics["perf/update_tokens"]
    assert got["metrics"]["perf/update_tokens_forwarded"] < want_metrics["perf/update_tokens_forwarded"]


def test_smollm2_shared_rows_give_the_unshared_logprobs_and_gradients(smollm2):
    """The real model (SmolLM2-135M-Instruct, float32, sdpa_varlen as the trainer loads it on a CPU): two prompts of
    different lengths, 3 samples each, in one row. Gradients at 1e-4: over its 30 layers float32 rounding alone
    moves them more than 1e-5 (measured against float64: 8.7e-5 for the unshared rows, 8.6e-5 for the shared ones,
    1.5e-5 between the two); a structural fault moves them by orders more."""
    model, tok = smollm2
    prompts = [tok(text)["input_ids"] for text in ("Using the numbers 3, 7 and 12, make 25. Think step by step.",
                                                   "What is 17 + 25? Answer with the number only.")]
    g = torch.Generator().manual_seed(0)
    prompts = [list(p) for p in prompts for _ in range(3)]
    completions = [torch.randint(0, 1000, (int(torch.randint(2, 9, (1,), generator=g)),), generator=g).tolist()
                   for _ in prompts]
    try:
        got, want, grads = _shared_vs_unshared(model, prompts, completions, budget=1000)
        _assert_same(got, want, "log-probs")
        _assert_same_grads(model, grads, rtol=1e-4)
    finally:
        model.zero_grad(set_to_none=True)  # the session's shared model: no gradients left behind


def test_the_packed_forward_of_a_shared_row_reads_nothing_back():
    """No host sync in sdpa_varlen's shared path: the key boundaries come as host ints from the plan."""
    from benchmarks.op_counter import OpCounter

    model = tiny_model("qwen2", "sdpa_varlen")
    prompts, completions = grouped_batch(seed=17)
    mbs = _packed(prompts, completions, 1000, shared=True)
    counter = OpCounter()
    with counter.active():
        packed_head_forward(model, mbs[0], lambda h, w: (h @ w.T).sum())
    assert counter.total(kind="syncs") == 0, dict(counter.by_name(kind="syncs"))
    assert counter.total() > 50  # it counted the forward
