"""HFEngine: shapes, EOS and finish reasons, seeding, padding invariance, sampler log-probs."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from fastgrpo.rollout.base import SamplingParams
from fastgrpo.rollout.hf import HFEngine, sample_rows
from fastgrpo.models.tiny import EOS_TOKEN, build_tiny
from sampler_reference import kept_set_logprobs


@pytest.fixture(scope="session")
def tiny_cache(tmp_path_factory):
    """Shared with the other test modules (same folder): each tiny preset/seed is built once per session."""
    return tmp_path_factory.getbasetemp() / "fastgrpo-cache"


def _load(cache, preset, seed=0):
    path = build_tiny(cache_dir=cache, preset=preset, seed=seed)
    return AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path, padding_side="left")


@pytest.fixture(scope="module")
def qwen(tiny_cache):
    """Tied embeddings: a random tied model mostly repeats its last input token (used by the EOS test)."""
    return _load(tiny_cache, "default")


@pytest.fixture(scope="module")
def llama(tiny_cache):
    """Untied head: greedy output depends on the whole prompt, so padding mistakes would show."""
    return _load(tiny_cache, "llama")


def _prompts(tok, count, rng, lo=2, hi=24):
    """Random ASCII prompts of different lengths, as token ids."""
    chars = [chr(c) for c in range(32, 127)]
    return [tok.encode("".join(rng.choices(chars, k=rng.randint(lo, hi))), add_special_tokens=False)
            for _ in range(count)]


def _fresh_logprobs(model, prompt, completion, temperature):
    """log_softmax(logits / T) of each completion token under one unpadded forward: [L] float32."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:-1].float()  # [L, V] predicting completion tokens
    logp = torch.log_softmax(logits / temperature, dim=-1)
    return logp.gather(-1, torch.tensor(completion)[:, None]).squeeze(-1), logits


def test_generate_returns_n_completions_per_prompt(qwen, rng):
    model, tok = qwen
    prompts = _prompts(tok, 3, rng)
    out = HFEngine(model, tok, batch_size=4).generate(prompts, 5, SamplingParams(max_tokens=6, seed=0))
    assert [len(row) for row in out] == [5, 5, 5]
    for c in (c for row in out for c in row):
        assert 1 <= len(c.token_ids) <= 6 and c.logprobs is None
        assert c.text == tok.decode(c.token_ids, skip_special_tokens=True)


def test_eos_is_kept_padding_stripped_and_finish_reasons_set(qwen, rng):
    model, tok = qwen
    engine = HFEngine(model, tok)
    eos = tok.convert_tokens_to_ids(EOS_TOKEN)
    assert eos in engine.eos_ids and tok.pad_token_id in engine.eos_ids  # <|endoftext|> also ends a completion
    rng = rng
    # A random tied model greedily repeats its last token: a prompt ending in EOS stops at once, the others
    # run to max_tokens, in the same batch.
    prompts = _prompts(tok, 4, rng)
    ends = [rng.random() < 0.5 for _ in prompts]
    ends[0], ends[1] = True, False
    prompts = [p + [eos] if e else p for p, e in zip(prompts, ends)]
    out = engine.generate(prompts, 1, SamplingParams(max_tokens=7, temperature=0, logprobs=True))
    for (c,), stops in zip(out, ends):
        if stops:
            assert c.token_ids == [eos] and c.finish_reason == "stop" and c.text == ""
        else:
            assert len(c.token_ids) == 7 and c.finish_reason == "length" and eos not in c.token_ids
        assert len(c.logprobs) == len(c.token_ids)


def test_sampled_completions_end_exactly_at_their_first_eos(qwen, rng):
    model, tok = qwen
    engine = HFEngine(model, tok, batch_size=32)
    out = engine.generate(_prompts(tok, 8, rng), 8, SamplingParams(max_tokens=24, seed=3))
    reasons = set()
    for c in (c for row in out for c in row):
        is_eos = [t in engine.eos_ids for t in c.token_ids]
        assert not any(is_eos[:-1])
        assert c.finish_reason == ("stop" if is_eos[-1] else "length")
        assert c.finish_reason == "stop" or len(c.token_ids) == 24
        reasons.add(c.finish_reason)
    assert reasons == {"stop", "length"}  # ~2/263 EOS chance per token: 64 x 24 tokens see both


def test_same_seed_same_completions_other_seed_other_and_global_rng_untouched(qwen, rng):
    model, tok = qwen
    engine = HFEngine(model, tok)
    prompts = _prompts(tok, 3, rng)

    def run(seed):
        out = engine.generate(prompts, 4, SamplingParams(max_tokens=10, seed=seed, logprobs=True))
        return [(c.token_ids, c.logprobs) for row in out for c in row]

    torch.manual_seed(0)
    first = run(11)
    after = torch.rand(3)
    torch.manual_seed(0)
    assert run(11) == first
    assert torch.equal(torch.rand(3), after)  # generation drew nothing from the global RNG
    assert run(12) != first


def test_padded_batch_greedy_equals_each_prompt_alone(llama, rng):
    model, tok = llama
    engine = HFEngine(model, tok, batch_size=64)
    prompts = _prompts(tok, 5, rng, lo=1, hi=30)
    params = SamplingParams(max_tokens=12, temperature=0)
    batched = [row[0].token_ids for row in engine.generate(prompts, 1, params)]
    assert len({tuple(b) for b in batched}) > 1  # the untied model does not just echo: the check has teeth
    for prompt, got in zip(prompts, batched):
        alone = engine.generate([prompt], 1, params)[0][0].token_ids
        if got != alone:  # allowed only where float noise breaks an exact tie of the top two logits
            step = next(i for i, (a, b) in enumerate(zip(got, alone)) if a != b)
            _, logits = _fresh_logprobs(model, prompt, alone, 1.0)
            top2 = logits[step].topk(2).values
            assert (top2[0] - top2[1]).abs() < 1e-5, f"padding changed greedy step {step}"


def test_chunking_does_not_change_greedy_output(llama, rng):
    model, tok = llama
    prompts = _prompts(tok, 5, rng)
    params = SamplingParams(max_tokens=8, temperature=0)
    one_chunk = HFEngine(model, tok, batch_size=64).generate(prompts, 2, params)
    small_chunks = HFEngine(model, tok, batch_size=3).generate(prompts, 2, params)
    assert [[c.token_ids for c in row] for row in one_chunk] == [[c.token_ids for c in row] for row in small_chunks]


@pytest.mark.parametrize("decode", ["lean", "transformers"])
@pytest.mark.parametrize("temperature,top_p,top_k", [(1.0, 1.0, 0), (0.7, 0.9, 0), (1.3, 0.5, 0), (1.0, 0.8, 0),
                                                     (1.0, 1.0, 5), (0.8, 0.8, 40), (0.0, 1.0, 0)])
def test_sampler_logprobs_are_the_kept_set_renormalised(llama, temperature, top_p, top_k, decode, rng):
    """The reported log-prob is the token's under the distribution it was drawn from: softmax(logits / T) over the
    top_k / top_p kept set, renormalised (vLLM's processed_logprobs); greedy reports log_softmax(logits)."""
    model, tok = llama
    prompts = _prompts(tok, 3, rng)
    params = SamplingParams(max_tokens=10, temperature=temperature, top_p=top_p, top_k=top_k, seed=5, logprobs=True)
    out = HFEngine(model, tok, batch_size=4, decode=decode).generate(prompts, 2, params)
    for prompt, row in zip(prompts, out):
        for c in row:
            _, logits = _fresh_logprobs(model, prompt, c.token_ids, 1.0)
            expected = kept_set_logprobs(logits, torch.tensor(c.token_ids), temperature=temperature or 1.0,
                                         top_p=top_p, top_k=top_k)
            torch.testing.assert_close(torch.tensor(c.logprobs), expected, atol=2e-5, rtol=1e-5)


def test_top_k_samples_only_from_the_k_most_likely(llama, rng):
    model, tok = llama
    prompts = _prompts(tok, 4, rng)
    out = HFEngine(model, tok).generate(prompts, 4, SamplingParams(max_tokens=8, top_k=3, seed=2))
    for prompt, row in zip(prompts, out):
        for c in row:
            _, logits = _fresh_logprobs(model, prompt, c.token_ids, 1.0)
            chosen = logits.gather(-1, torch.tensor(c.token_ids)[:, None])  # [L, 1]
            assert ((logits > chosen).sum(-1) < 3).all()  # fewer than 3 tokens more likely than the drawn one


def test_top_p_samples_only_from_the_nucleus(llama, rng):
    model, tok = llama
    prompts = _prompts(tok, 4, rng)
    top_p = 0.3
    out = HFEngine(model, tok).generate(prompts, 4, SamplingParams(max_tokens=8, top_p=top_p, seed=1))
    for prompt, row in zip(prompts, out):
        for c in row:
            _, logits = _fresh_logprobs(model, prompt, c.token_ids, 1.0)
            probs = logits.softmax(-1)  # [L, V]
            chosen = probs.gather(-1, torch.tensor(c.token_ids)[:, None])  # [L, 1]
            mass_above = (probs * (probs > chosen)).sum(-1)  # mass of strictly more likely tokens
            assert (mass_above < top_p + 1e-6).all()


def test_tiny_top_p_is_greedy(llama, rng):
    model, tok = llama
    prompts = _prompts(tok, 3, rng)
    engine = HFEngine(model, tok)
    greedy = engine.generate(prompts, 1, SamplingParams(max_tokens=8, temperature=0))
    nucleus = engine.generate(prompts, 1, SamplingParams(max_tokens=8, temperature=1.0, top_p=1e-6, seed=9))
    assert [r[0].token_ids for r in greedy] == [r[0].token_ids for r in nucleus]


def test_generation_runs_in_eval_mode_without_grad_and_restores_mode(llama, rng):
    model, tok = llama
    seen = []
    hook = model.model.layers[0].register_forward_hook(
        lambda mod, args, out: seen.append((mod.training, torch.is_grad_enabled())))
    model.train()
    try:
        HFEngine(model, tok).generate(_prompts(tok, 2, rng), 1, SamplingParams(max_tokens=3, seed=0))
        assert model.training
        model.eval()
        HFEngine(model, tok).generate(_prompts(tok, 1, rng), 1, SamplingParams(max_tokens=2, seed=0))
        assert not model.training
    finally:
        hook.remove()
    assert seen and all(s == (False, False) for s in seen)


def test_update_weights_loads_another_models_tensors(tiny_cache, rng):
    model, tok = _load(tiny_cache, "llama", seed=0)
    other, _ = _load(tiny_cache, "llama", seed=1)
    engine = HFEngine(model, tok)
    params = SamplingParams(max_tokens=8, temperature=0)
    prompts = _prompts(tok, 3, rng)
    engine.update_weights(model.named_parameters())  # the live weights themselves: a no-op
    engine.update_weights(other.named_parameters())
    for (name, a), b in zip(model.named_parameters(), other.parameters()):
        assert torch.equal(a, b) and a.data_ptr() != b.data_ptr(), name
    expected = HFEngine(other, tok).generate(prompts, 1, params)
    assert [r[0].token_ids for r in engine.generate(prompts, 1, params)] == [r[0].token_ids for r in expected]


def test_update_weights_rejects_unknown_names_and_wrong_shapes(llama):
    model, tok = llama
    engine = HFEngine(model, tok)
    with pytest.raises(KeyError, match="model.not_a_weight"):
        engine.update_weights([("model.not_a_weight", torch.zeros(3))])
    with pytest.raises(ValueError, match="model.norm.weight"):
        engine.update_weights([("model.norm.weight", torch.zeros(3))])


def test_invalid_arguments_are_rejected(llama):
    model, tok = llama
    engine = HFEngine(model, tok)
    with pytest.raises(ValueError, match="n must"):
        engine.generate([[1, 2]], 0, SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="at least one token"):
        engine.generate([[]], 1, SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="batch_size"):
        HFEngine(model, tok, batch_size=0)


# -- FSDP2: the engine generates with the sharded policy --------------------------------------------------------
# Two gloo ranks on CPU. Rank 0's prompts end in EOS (the tied tiny model echoes it: done at step 1), rank 1's
# run to max_tokens: without the engine's cross-rank "all finished" check, rank 0 would leave the decode loop
# while rank 1 waits in an FSDP all-gather forever. The worker is this file run as a script.


def _fsdp_worker(out_dir: str) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from fastgrpo.distributed.groups import destroy_distributed

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    cache = Path(out_dir) / "cache"
    model, tok = _load(cache, "default")
    fully_shard(model.model.layers[0])
    fully_shard(model.model.layers[1])
    fully_shard(model)
    engine = HFEngine(model, tok, batch_size=2)  # 2 chunks per rank: both ranks loop chunk by chunk
    eos = tok.convert_tokens_to_ids(EOS_TOKEN)
    prompts = _prompts(tok, 3, random.Random(rank))
    if rank == 0:
        prompts = [p + [eos] for p in prompts]
    params = SamplingParams(max_tokens=6, temperature=0, logprobs=True)
    first = engine.generate(prompts, 1, params)
    other, _ = _load(cache, "default", seed=1)
    engine.update_weights(other.named_parameters())
    loaded = all(torch.equal(p.full_tensor(), q) for p, q in zip(model.parameters(), other.parameters()))
    second = engine.generate(prompts, 1, params)
    torch.save({"prompts": prompts, "loaded": loaded,
                "first": [(r[0].token_ids, r[0].logprobs) for r in first],
                "second": [(r[0].token_ids, r[0].logprobs) for r in second]}, Path(out_dir) / f"rank{rank}.pt")
    destroy_distributed()  # a barrier first: a rank that left early once died at exit in gloo's teardown (CI)


def test_fsdp2_ranks_finishing_at_different_steps_do_not_hang(tiny_cache, tmp_path):
    from _launch import run_ranks

    build_tiny(cache_dir=tmp_path / "cache")
    build_tiny(cache_dir=tmp_path / "cache", seed=1)
    # a hang here means ranks left the decode loop at different steps
    run_ranks([sys.executable, __file__, "--fsdp-worker", str(tmp_path)], what="FSDP generation", timeout=180)

    # Sharded generation (before and after loading the seed-1 weights) equals the unsharded models', log-probs
    # included: those differ between seeds even where the echoed tokens do not.
    models = {seed: _load(tmp_path / "cache", "default", seed=seed) for seed in (0, 1)}
    params = SamplingParams(max_tokens=6, temperature=0, logprobs=True)
    for rank in range(2):
        res = torch.load(tmp_path / f"rank{rank}.pt")
        assert res["loaded"]
        for key, seed in (("first", 0), ("second", 1)):
            model, tok = models[seed]
            expected = HFEngine(model, tok).generate(res["prompts"], 1, params)
            for (ids, logps), (c,) in zip(res[key], expected):
                assert ids == c.token_ids, (rank, key)
                torch.testing.assert_close(torch.tensor(logps), torch.tensor(c.logprobs), atol=1e-5, rtol=1e-5)
        assert {len(ids) for ids, _ in res["first"]} == ({1} if rank == 0 else {6})


if __name__ == "__main__" and sys.argv[1:2] == ["--fsdp-worker"]:
    _fsdp_worker(sys.argv[2])


def test_flex_attention_model_decodes_with_sdpa_and_keeps_flex_for_training(tiny_cache):
    from transformers import AutoModelForCausalLM

    path = build_tiny(cache_dir=tiny_cache)
    flex = AutoModelForCausalLM.from_pretrained(path, attn_implementation="flex_attention")
    sdpa = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa")
    tok = AutoTokenizer.from_pretrained(path)
    prompts = [tok("Pick a number:")["input_ids"], tok("Hi")["input_ids"]]
    sp = SamplingParams(max_tokens=5, temperature=0.0, logprobs=True)
    calls, real = [], flex.set_attn_implementation
    flex.set_attn_implementation = lambda impl: (calls.append(impl), real(impl))[1]
    a = HFEngine(flex, tok).generate(prompts, 1, sp)
    assert calls == ["sdpa", "flex_attention"]
    b = HFEngine(sdpa, tok).generate(prompts, 1, sp)
    assert [g[0].token_ids for g in a] == [g[0].token_ids for g in b]
    assert flex.config._attn_implementation == "flex_attention"  # restored for the packed update


def test_greedy_decode_equals_transformers_generate(llama, rng):
    # The decode loop (preallocated KV cache, one mask buffer) against transformers' own greedy generate with its
    # default cache, prompt by prompt (unpadded).
    model, tok = llama
    engine = HFEngine(model, tok, batch_size=8)
    prompts = _prompts(tok, 4, rng, lo=3, hi=20)
    ours = engine.generate(prompts, 1, SamplingParams(max_tokens=10, temperature=0))
    for prompt, row in zip(prompts, ours):
        with torch.no_grad():
            ref = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                 do_sample=False, max_new_tokens=10, pad_token_id=tok.pad_token_id)
        ref = ref[0, len(prompt):].tolist()
        got = row[0].token_ids
        assert got == ref[:len(got)] and (len(got) == len(ref) or got[-1] in engine.eos_ids)


@pytest.mark.parametrize("v", [7, 512, 1500])  # inside one block, exactly one block, several with a ragged tail
def test_sample_rows_draws_from_the_weights(v):
    gen = torch.Generator().manual_seed(v)
    w = torch.rand(v, generator=gen) ** 4  # unnormalised, uneven
    w[torch.randperm(v, generator=gen)[: v // 3]] = 0.0  # zero weights are never drawn
    n = 200_000 if v < 1000 else 400_000
    idx = sample_rows(w.expand(n, v).contiguous(), torch.rand(n, 1, generator=gen))
    counts = torch.bincount(idx, minlength=v).double()
    assert counts[w == 0].sum() == 0
    p = (w / w.sum()).double()
    # every frequency within 5 standard deviations of its expectation
    assert ((counts / n - p).abs() <= 5 * (p * (1 - p) / n).sqrt() + 1e-9).all()


def test_sample_rows_stays_on_positive_weight_at_the_ends_of_the_unit_interval():
    w = torch.zeros(3, 1100)
    w[0, 5], w[1, 700] = 1.0, 2.0  # one token only; its block is not the last
    w[2, 1099], w[2, 3] = 1e-30, 1.0  # a last token of negligible weight
    one = torch.tensor(1.0).nextafter(torch.tensor(0.0))
    for u in (torch.zeros(3, 1), torch.full((3, 1), float(one))):
        idx = sample_rows(w, u)
        assert idx[:2].tolist() == [5, 700] and w[2, idx[2]] > 0
