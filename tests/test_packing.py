"""Sequence packing: planning properties, tensor layout, and exactness against unpadded forwards."""

from __future__ import annotations


import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fastgrpo.models.attention import ATTN_BACKENDS
from fastgrpo.models.loading import packed_head_forward
from fastgrpo.models.packing import completion_offsets, pack, partition_balanced, plan_microbatches, split_to_count

transformers = pytest.importorskip("transformers")

VOCAB = 257  # odd on purpose


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny matmuls gain nothing from threads, and OpenMP spin-waits stall when the 2 cores are shared."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# ----------------------------------------------------------------------------------------------------------------
# Planning

lengths_st = st.lists(st.integers(1, 60), min_size=0, max_size=40)


@settings(max_examples=60, deadline=None)
@given(lengths=lengths_st, budget=st.integers(1, 80))
def test_plan_microbatches_covers_each_sequence_once_within_budget(lengths, budget):
    bins = plan_microbatches(lengths, budget)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    for b in bins:
        assert b and b == sorted(b)
        # Over budget only for a lone sequence that is itself longer than the budget.
        assert sum(lengths[i] for i in b) <= budget or (len(b) == 1 and lengths[b[0]] > budget)
    # First-fit property: no two bins could be merged (so at most one bin is half empty or less).
    loads = [sum(lengths[i] for i in b) for b in bins]
    for a in range(len(loads)):
        for c in range(a + 1, len(loads)):
            assert loads[a] + loads[c] > budget


def test_plan_microbatches_rejects_bad_input():
    with pytest.raises(ValueError, match="max_tokens"):
        plan_microbatches([3], 0)
    with pytest.raises(ValueError, match=r"lengths\[1\]"):
        plan_microbatches([3, 0], 10)


@settings(max_examples=60, deadline=None)
@given(lengths=lengths_st, k=st.integers(1, 8))
def test_partition_balanced_spread_at_most_longest_item(lengths, k):
    parts = partition_balanced(lengths, k)
    assert len(parts) == k
    assert sorted(i for p in parts for i in p) == list(range(len(lengths)))
    sums = [sum(lengths[i] for i in p) for p in parts]
    assert sums == sorted(sums, reverse=True)
    assert max(sums) - min(sums) <= max(lengths, default=0)


def test_partition_balanced_beats_round_robin_on_skewed_lengths():
    torch.manual_seed(0)
    lengths = (torch.distributions.LogNormal(5.5, 0.6).sample((64,)).clamp(max=1024).int() + 1).tolist()
    parts = partition_balanced(lengths, 4)
    sums = [sum(lengths[i] for i in p) for p in parts]
    rr = [sum(lengths[i::4]) for i in range(4)]
    assert max(sums) - min(sums) <= max(rr) - min(rr)
    assert max(sums) - min(sums) <= max(lengths) // 4 + 1, sums


@settings(max_examples=60, deadline=None)
@given(lengths=lengths_st, budget=st.integers(1, 80), extra=st.integers(0, 6))
def test_split_to_count_gives_exact_count_and_keeps_budget(lengths, budget, extra):
    bins = plan_microbatches(lengths, budget)
    n = len(bins) + extra
    out = split_to_count(bins, lengths, n)
    assert len(out) == n
    assert sorted(i for b in out for i in b) == list(range(len(lengths)))
    for b in out:
        assert sum(lengths[i] for i in b) <= budget or len(b) == 1
    # Empty (dummy) bins appear only when there are fewer sequences than bins.
    assert sum(1 for b in out if not b) == max(0, n - len(lengths))


def test_split_to_count_refuses_to_merge():
    with pytest.raises(ValueError, match="never merged"):
        split_to_count([[0], [1]], [5, 5], 1)


# ----------------------------------------------------------------------------------------------------------------
# Layout


def _random_batch(seed: int, s: int, max_prompt: int = 9, max_completion: int = 9):
    g = torch.Generator().manual_seed(seed)

    def seq(n_max: int) -> list[int]:
        n = int(torch.randint(1, n_max + 1, (1,), generator=g))
        return torch.randint(0, VOCAB, (n,), generator=g).tolist()

    return [seq(max_prompt) for _ in range(s)], [seq(max_completion) for _ in range(s)]


def test_pack_layout_shifts_per_sequence_and_indexes_flat_layout():
    prompts, completions = _random_batch(seed=1, s=11)
    lengths = [len(p) + len(c) for p, c in zip(prompts, completions)]
    bins = plan_microbatches(lengths, 23)
    mbs = pack(prompts, completions, bins, "cpu")
    flat = torch.tensor([t for c in completions for t in c])  # [F]
    seen = torch.zeros_like(flat, dtype=torch.long)
    for mb, b in zip(mbs, bins):
        T, N = mb.num_tokens, mb.num_completion_tokens
        assert mb.input_ids.shape == mb.position_ids.shape == (1, T)
        assert mb.hidden_index.shape == mb.targets.shape == mb.flat_index.shape == (N,)
        # The next token after each selected position is its target, and it is the flat-layout token.
        assert torch.equal(mb.input_ids[0, mb.hidden_index + 1], mb.targets)
        assert torch.equal(flat[mb.flat_index], mb.targets)
        # position_ids restart at every sequence start, nowhere else.
        starts = mb.cu_seqlens[:-1].long()
        assert torch.equal((mb.position_ids[0] == 0).nonzero()[:, 0], starts)
        assert mb.cu_seqlens[-1] == T and mb.max_seqlen == max(lengths[i] for i in b)
        seen[mb.flat_index] += 1
    assert torch.all(seen == 1)
    assert completion_offsets([3, 1, 2]) == [0, 3, 4]


def test_pack_empty_bin_is_a_one_token_dummy():
    prompts, completions = _random_batch(seed=2, s=2)
    mb = pack(prompts, completions, [[]], "cpu")[0]
    assert mb.is_dummy and mb.num_tokens == 1 and mb.num_completion_tokens == 0
    assert mb.input_ids.shape == (1, 1) and mb.hidden_index.numel() == 0


def test_pack_rejects_empty_prompt_or_completion():
    with pytest.raises(ValueError, match=r"prompt_ids\[0\]"):
        pack([[]], [[1]], [[0]], "cpu")
    with pytest.raises(ValueError, match=r"completion_ids\[1\]"):
        pack([[1], [2]], [[1], []], [[0, 1]], "cpu")


@pytest.mark.parametrize("attn", ["flash_attention_2", "torch_varlen", "sdpa_varlen"])
def test_varlen_backends_receive_boundaries(attn):
    prompts, completions = _random_batch(seed=3, s=4)
    mb = pack(prompts, completions, [[0, 1, 2, 3]], "cpu")[0]
    kw = ATTN_BACKENDS[attn].packed_inputs(mb)
    mask = kw.get("attention_mask")  # no [T, T] mask is built; fastgrpo's own backends get the no-padding marker
    assert mask is None if attn == "flash_attention_2" else (mask.shape == (1, mb.num_tokens) and mask.stride() == (0, 0))
    assert kw["cu_seq_lens_q"].dtype == torch.int32
    assert kw["cu_seq_lens_q"].tolist() == [0, *torch.tensor(mb.seq_lengths).cumsum(0).tolist()]
    assert kw["max_length_q"] == max(mb.seq_lengths) and isinstance(kw["max_length_q"], int)
    if attn != "flash_attention_2":  # the same boundaries as host ints: no device-to-host copy in every layer
        assert kw["sequence_bounds"] == kw["cu_seq_lens_q"].tolist()


@pytest.mark.parametrize("attn", ["sdpa_varlen", "torch_varlen"])
def test_the_packed_forward_of_fastgrpos_varlen_backends_reads_nothing_back(attn, monkeypatch):
    """No host sync in the packed forward: the boundaries come as host ints and the no-padding marker keeps
    transformers from reading the packing out of position_ids (``.item()``: counted by the op counter)."""
    from benchmarks.op_counter import OpCounter

    model = tiny_model("qwen2", attn if attn == "sdpa_varlen" else "sdpa_varlen")  # torch_varlen: CUDA only
    prompts, completions = _random_batch(seed=3, s=4)
    mb = pack(prompts, completions, [list(range(4))], "cpu")[0]
    if attn == "torch_varlen":  # its inputs, through the sdpa_varlen attention function (CPU)
        monkeypatch.setitem(ATTN_BACKENDS, "sdpa_varlen", ATTN_BACKENDS["torch_varlen"])
    head = lambda h, w: (h @ w.T).sum()  # noqa: E731
    counter = OpCounter()
    with counter.active():
        packed_head_forward(model, mb, head)
    assert counter.total(kind="syncs") == 0, dict(counter.by_name(kind="syncs"))
    assert counter.total() > 50  # it counted the forward


# ----------------------------------------------------------------------------------------------------------------
# Exactness on tiny models (fp32, CPU)


def tiny_model(family: str, attn: str, seed: int = 0) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    from fastgrpo.models.attention import register_with_transformers

    register_with_transformers()

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=256,
                  attn_implementation=attn)
    # Qwen2 tied (like Qwen2.5-0.5B/1.5B, and it has q/k/v biases); Llama untied.
    cfg = Qwen2Config(tie_word_embeddings=True, **common) if family == "qwen2" else \
        LlamaConfig(tie_word_embeddings=False, **common)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg).float().train()


def logprob_head(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(hidden @ weight.T, dim=-1)  # [N, V]; fine for tests, never for real vocabularies


def packed_logprobs(model, prompts, completions, budget) -> torch.Tensor:
    """[F] log-probs of every completion token, from packed micro-batches; grads accumulate on model."""
    lengths = [len(p) + len(c) for p, c in zip(prompts, completions)]
    out = torch.zeros(sum(map(len, completions)))
    for mb in pack(prompts, completions, plan_microbatches(lengths, budget), "cpu"):
        lp = packed_head_forward(model, mb, logprob_head).gather(1, mb.targets[:, None])[:, 0]  # [N]
        out = out.index_put((mb.flat_index,), lp)
    return out


def unpadded_logprobs(model, prompts, completions) -> torch.Tensor:
    """[F] the oracle: one plain forward per sequence, no packing, no padding."""
    out = []
    for p, c in zip(prompts, completions):
        logits = model(input_ids=torch.tensor([p + c]), use_cache=False).logits[0]  # [P + L, V]
        lp = torch.log_softmax(logits[len(p) - 1:-1], -1)  # [L, V]
        out.append(lp.gather(1, torch.tensor(c)[:, None])[:, 0])
    return torch.cat(out)


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", ["qwen2", "llama"])
@pytest.mark.parametrize("attn", ["sdpa", "eager", "sdpa_varlen"])
def test_packed_logprobs_and_grads_equal_unpadded(family, attn):
    model = tiny_model(family, attn)
    seed = 3 * ["qwen2", "llama"].index(family) + ["sdpa", "eager", "sdpa_varlen"].index(attn)
    prompts, completions = _random_batch(seed=seed, s=7, max_prompt=12, max_completion=10)
    w = torch.randn(sum(map(len, completions)))  # [F] arbitrary token weights: exercises every position

    ref = unpadded_logprobs(model, prompts, completions)
    (w * ref).sum().backward()
    g_ref = grads(model)
    model.zero_grad(set_to_none=True)

    got = packed_logprobs(model, prompts, completions, budget=30)
    (w * got).sum().backward()
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)
    g = grads(model)
    assert g.keys() == g_ref.keys()
    for name in g_ref:
        torch.testing.assert_close(g[name], g_ref[name], rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("attn", ["sdpa", "sdpa_varlen"])
def test_boundary_leak_would_be_detected(attn):
    """Control: packing without restarting positions (one long sequence) must disagree with the oracle."""
    model = tiny_model("qwen2", attn)
    prompts, completions = _random_batch(seed=5, s=4)
    mb = pack(prompts, completions, [[0, 1, 2, 3]], "cpu")[0]
    mb.position_ids = torch.arange(mb.num_tokens)[None]
    mb.seq_lengths, mb.max_seqlen = [mb.num_tokens], mb.num_tokens
    mb.segment_ids = torch.zeros(mb.num_tokens, dtype=torch.long)
    mb.cu_seqlens = torch.tensor([0, mb.num_tokens], dtype=torch.int32)
    with torch.no_grad():
        leak = packed_head_forward(model, mb, logprob_head).gather(1, mb.targets[:, None])[:, 0]
        ref = unpadded_logprobs(model, prompts, completions)
    assert (leak - ref[mb.flat_index]).abs().max() > 1e-3


@pytest.mark.parametrize("attn", ["sdpa", "sdpa_varlen"])
def test_dummy_microbatch_contributes_zero_gradient(attn):
    model = tiny_model("llama", attn)
    mb = pack([[1]], [[2]], [[]], "cpu")[0]
    loss = packed_head_forward(model, mb, logprob_head).sum()  # sum over N = 0 rows
    loss.backward()
    assert loss.item() == 0.0
    assert all(p.grad is None or torch.all(p.grad == 0) for p in model.parameters())


def _weights_dapo(lengths):  # 1 / sum_i L_i
    return torch.full((sum(lengths),), 1.0 / sum(lengths))


def _weights_grpo(lengths):  # 1 / (S * L_i)
    return torch.cat([torch.full((n,), 1.0 / (len(lengths) * n)) for n in lengths])


@pytest.mark.parametrize("weights", [_weights_dapo, _weights_grpo], ids=["dapo", "grpo"])
def test_gradient_does_not_depend_on_token_budget(weights):
    """Weighted-sum loss accumulated over micro-batches: a budget of one sequence vs one big row."""
    model = tiny_model("qwen2", "sdpa", seed=3)
    prompts, completions = _random_batch(seed=7, s=9, max_prompt=10, max_completion=14)
    w = weights([len(c) for c in completions])  # [F]
    adv = torch.randn(len(w))  # [F] a per-token policy-gradient-like objective
    results = []
    for budget in (1, 10_000):
        model.zero_grad(set_to_none=True)
        lengths = [len(p) + len(c) for p, c in zip(prompts, completions)]
        bins = plan_microbatches(lengths, budget)
        assert len(bins) == (len(prompts) if budget == 1 else 1)
        for mb in pack(prompts, completions, bins, "cpu"):
            lp = packed_head_forward(model, mb, logprob_head).gather(1, mb.targets[:, None])[:, 0]  # [N]
            (-(w[mb.flat_index] * adv[mb.flat_index] * lp).sum()).backward()
        results.append(grads(model))
    for name in results[0]:
        torch.testing.assert_close(results[0][name], results[1][name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("attn", ["flash_attention_2", "torch_varlen", "flex_attention", "sdpa"])
def test_packed_logprobs_equal_unpadded_on_gpu(attn):
    if attn == "flash_attention_2":
        pytest.importorskip("flash_attn")
    if attn == "torch_varlen":
        pytest.importorskip("torch.nn.attention.varlen")
    model = tiny_model("qwen2", attn).cuda().to(torch.bfloat16)
    prompts, completions = _random_batch(seed=11, s=6, max_prompt=40, max_completion=40)
    lengths = [len(p) + len(c) for p, c in zip(prompts, completions)]
    with torch.no_grad():
        got = torch.zeros(sum(map(len, completions)), device="cuda")
        for mb in pack(prompts, completions, plan_microbatches(lengths, 200), "cuda"):
            lp = packed_head_forward(model, mb, lambda h, w: torch.log_softmax((h @ w.T).float(), -1))
            got[mb.flat_index] = lp.gather(1, mb.targets[:, None])[:, 0]
        ref = []
        for p, c in zip(prompts, completions):
            logits = model(input_ids=torch.tensor([p + c], device="cuda"), use_cache=False).logits[0].float()
            target = torch.tensor(c, device="cuda")[:, None]
            ref.append(torch.log_softmax(logits[len(p) - 1:-1], -1).gather(1, target)[:, 0])
    torch.testing.assert_close(got, torch.cat(ref), rtol=0, atol=5e-2)  # bf16: kernels differ by tiling


def test_bench_learner_quick_mode_packed_matches_padded(tmp_path):
    """The benchmark's CPU smoke mode runs, and its packed and padded updates compute the same thing."""
    from benchmarks import bench_learner as bench

    rows = bench.main(["--quick", "--out", str(tmp_path / "bench")])
    packed, padded = (next(r for r in rows if r.mode == m) for m in ("packed", "padded"))
    assert packed.slots == packed.real_tokens < padded.slots  # no padding in the packed rows
    assert packed.tokens_per_s > 0 and padded.tokens_per_s > 0
    assert packed.check_logp == pytest.approx(padded.check_logp, rel=1e-5)
    assert packed.grad_norm == pytest.approx(padded.grad_norm, rel=1e-4)
    assert (tmp_path / "bench.csv").read_text().count("\n") == 3 and (tmp_path / "bench.md").exists()


def test_flex_attention_packed_logprobs_equal_unpadded():
    """flex_attention gets position_ids only and transformers derives the block mask from them; forward only,
    because FlexAttention has no backward on CPU (its gradients run on CUDA). One family: compiling flex on CPU
    takes ~30 s."""
    model = tiny_model("qwen2", "flex_attention")
    prompts, completions = _random_batch(seed=11, s=6, max_prompt=12, max_completion=10)
    with torch.no_grad():
        ref = unpadded_logprobs(model, prompts, completions)
        got = packed_logprobs(model, prompts, completions, budget=30)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)


def test_sdpa_varlen_refuses_what_it_cannot_attend_correctly():
    model = tiny_model("qwen2", "sdpa_varlen").eval()
    ids = torch.tensor([[5, 6, 7, 8], [0, 0, 7, 8]])
    with torch.no_grad(), pytest.raises(ValueError, match="sdpa_varlen.*unpadded"):
        model(input_ids=ids, attention_mask=(ids != 0).long(), use_cache=False)  # a padded batch
    pos = torch.tensor([[0, 1, 2, 3], [0, 1, 0, 1]])
    with torch.no_grad(), pytest.raises(ValueError, match="sdpa_varlen.*different"):
        model(input_ids=ids, position_ids=pos, use_cache=False)


def test_sdpa_varlen_plain_forward_equals_sdpa():
    # Without the packed forward's boundaries, sequences start where position_ids restart, as sdpa's mask has it.
    model = tiny_model("qwen2", "sdpa_varlen").eval()
    ids = torch.randint(0, VOCAB, (2, 9))
    pos = torch.cat([torch.arange(4), torch.arange(5)]).expand(2, -1)
    def logits():  # one sequence; two packed ones; with a KV cache (which transformers reads as one sequence)
        return [model(input_ids=ids, use_cache=False).logits,
                model(input_ids=ids, position_ids=pos, use_cache=False).logits,
                model(input_ids=ids, position_ids=pos, use_cache=True).logits]

    with torch.no_grad():
        got = logits()
        model.set_attn_implementation("sdpa")
        want = logits()
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    assert not torch.allclose(got[1][:, 4:], got[2][:, 4:])  # the restart mattered
