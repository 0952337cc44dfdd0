"""The lean decode step (fastgrpo.rollout.lean_decode): logits equal transformers' forward, generation equals the
transformers-stepped engine token for token, and every model it does not reproduce falls back."""

from __future__ import annotations

import pytest
import torch
from test_rollout_hf import _load, _prompts, tiny_cache  # noqa: F401  (tiny_cache: the shared fixture)
from transformers import AutoModelForCausalLM, Qwen2Config

from fastgrpo.rollout.kv_cache import preallocated_kv_cache
from fastgrpo.rollout.base import SamplingParams
from fastgrpo.rollout.hf import HFEngine
from fastgrpo.rollout.lean_decode import LeanDecoder, lean_unsupported_reason


@pytest.fixture(scope="module")
def models(tiny_cache):  # noqa: F811
    """preset -> (model, tokenizer): Qwen2 (tied, q/k/v biases) and Llama (untied, no biases)."""
    return {preset: _load(tiny_cache, preset) for preset in ("default", "llama")}


def _random_qwen2(**overrides) -> torch.nn.Module:
    """A random Qwen2 beside the presets, for shapes and configs they lack (several KV heads, RoPE scaling)."""
    torch.manual_seed(0)
    cfg = dict(vocab_size=263, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, max_position_embeddings=512)
    return AutoModelForCausalLM.from_config(Qwen2Config(**{**cfg, **overrides}), dtype=torch.float32).eval()


def _lean_logits_vs_alone(model, prompts, steps, rng):
    """Prefill the left-padded batch with transformers, then ``steps`` lean steps on random tokens; returns, per
    step, (lean logits [N, V], transformers' logits of each sequence run alone and unpadded [N, V])."""
    N, P = len(prompts), max(len(p) for p in prompts)
    ids = torch.zeros(N, P, dtype=torch.long)
    mask = torch.ones(N, P + steps, dtype=torch.long)  # [N, M]
    for i, p in enumerate(prompts):
        ids[i, P - len(p):] = torch.tensor(p)
        mask[i, :P - len(p)] = 0
    pos = (mask[:, :P].cumsum(-1) - 1).clamp(min=0)  # [N, P]
    fed = torch.tensor([[rng.randrange(3, 256) for _ in range(steps)] for _ in prompts])  # [N, steps]
    lean = LeanDecoder(model)
    out = []
    with torch.no_grad():
        cache = preallocated_kv_cache(model, P + steps)
        model(input_ids=ids, attention_mask=mask[:, :P], position_ids=pos, past_key_values=cache, use_cache=True)
        lean.start(cache, mask, max_position=P + steps)
        for t in range(steps):
            got = lean.step(fed[:, t], pos[:, -1] + 1 + t, slot=P + t)  # [N, V]
            alone = torch.stack([model(torch.tensor([p + fed[i, :t + 1].tolist()])).logits[0, -1]
                                 for i, p in enumerate(prompts)])  # [N, V]
            out.append((got, alone))
    return out


@pytest.mark.parametrize("preset", ["default", "llama"])
def test_lean_step_logits_equal_transformers_with_left_padding(models, preset, rng):
    model, tok = models[preset]
    assert lean_unsupported_reason(model) is None
    prompts = _prompts(tok, 5, rng, lo=1, hi=30)  # different lengths: most rows are left-padded
    for got, alone in _lean_logits_vs_alone(model, prompts, steps=4, rng=rng):
        torch.testing.assert_close(got, alone, rtol=1e-5, atol=1e-5 * alone.abs().max().item())


@pytest.mark.parametrize("overrides", [{}, {"rope_parameters": {"rope_type": "linear", "factor": 2.0,
                                                                 "rope_theta": 500.0}}],
                         ids=["two-kv-heads", "linear-rope-scaling"])
def test_lean_step_logits_equal_transformers_for_grouped_kv_heads_and_scaled_rope(overrides, rng):
    model = _random_qwen2(**overrides)
    assert lean_unsupported_reason(model) is None
    prompts = [[rng.randrange(3, 256) for _ in range(rng.randint(1, 20))] for _ in range(4)]
    for got, alone in _lean_logits_vs_alone(model, prompts, steps=3, rng=rng):
        torch.testing.assert_close(got, alone, rtol=1e-5, atol=1e-5 * alone.abs().max().item())


@pytest.mark.parametrize("preset", ["default", "llama"])
@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.8, 0.9)])
def test_seeded_generation_is_the_same_with_the_lean_step(models, preset, temperature, top_p, rng):
    model, tok = models[preset]
    prompts = _prompts(tok, 6, rng, lo=1, hi=30)
    params = SamplingParams(max_tokens=16, temperature=temperature, top_p=top_p, seed=rng.randrange(1 << 30),
                            logprobs=True)
    engines = {d: HFEngine(model, tok, batch_size=8, decode=d) for d in ("transformers", "lean")}
    assert engines["lean"].lean_decoder() is not None and engines["transformers"].lean_decoder() is None
    out = {d: e.generate(prompts, 3, params) for d, e in engines.items()}
    # the same tokens and log-probs up to an exact tie flipped by rounding (seen with top_p 0.9, seed 3105697101:
    # tokens 189 and 249 both at log-prob -5.69997883, sorted the other way round by the two paths)
    _assert_same_samples(out["lean"], out["transformers"])


def test_auto_uses_the_lean_step_where_supported(models):
    model, tok = models["default"]
    assert isinstance(HFEngine(model, tok).lean_decoder(), LeanDecoder)  # decode="auto" is the default


def _sliding_window():
    return _random_qwen2(use_sliding_window=True, sliding_window=8, max_window_layers=0)


def _dynamic_rope():
    return _random_qwen2(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})


def _hooked():
    model = _random_qwen2()
    model.model.layers[1].mlp.register_forward_hook(lambda *args: None)
    return model


def _lora():
    from peft import LoraConfig, get_peft_model

    return get_peft_model(_random_qwen2(), LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))


@pytest.mark.parametrize("build,reason", [(_sliding_window, "sliding-window"), (_dynamic_rope, "rope_type"),
                                          (_hooked, "hooks"), (_lora, "PeftModel")],
                         ids=["sliding-window", "dynamic-rope", "forward-hook", "lora"])
def test_unsupported_models_fall_back_to_transformers(models, build, reason, rng):
    model = build()
    _, tok = models["default"]
    assert reason in lean_unsupported_reason(model)
    auto = HFEngine(model, tok, batch_size=4)
    assert auto.lean_decoder() is None
    prompts = [[rng.randrange(3, 256) for _ in range(rng.randint(1, 12))] for _ in range(3)]
    params = SamplingParams(max_tokens=5, seed=0)
    expected = HFEngine(model, tok, batch_size=4, decode="transformers").generate(prompts, 2, params)
    assert [[c.token_ids for c in row] for row in auto.generate(prompts, 2, params)] == \
        [[c.token_ids for c in row] for row in expected]
    with pytest.raises(ValueError, match="rollout.hf.decode=lean"):
        HFEngine(model, tok, decode="lean").generate(prompts, 1, params)


def test_unknown_decode_path_is_rejected(models):
    model, tok = models["llama"]
    with pytest.raises(ValueError, match="rollout.hf.decode"):
        HFEngine(model, tok, decode="fast")


def test_lean_step_reads_weights_changed_in_place(models, rng):
    # No copies of the parameters: an in-place optimizer-style update is seen by the next call.
    model, tok = models["llama"]
    engine = HFEngine(model, tok, decode="lean")
    prompts = _prompts(tok, 3, rng)
    params = SamplingParams(max_tokens=6, temperature=0, logprobs=True)
    before = [row[0].logprobs for row in engine.generate(prompts, 1, params)]
    saved = [p.detach().clone() for p in model.parameters()]
    try:
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1.5)
        after = engine.generate(prompts, 1, params)
        reference = HFEngine(model, tok, decode="transformers").generate(prompts, 1, params)
    finally:
        with torch.no_grad():
            for p, s in zip(model.parameters(), saved):
                p.copy_(s)
    assert [r[0].token_ids for r in after] == [r[0].token_ids for r in reference]
    assert [r[0].logprobs for r in after] != before


def test_activation_checkpointed_blocks_keep_the_lean_step(tiny_cache, rng):  # noqa: F811
    # parallel.activation_checkpointing wraps each block; the wrapper changes backward only, so the lean step
    # (which reads the wrapped block's modules) must still apply and give the same tokens.
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    model, tok = _load(tiny_cache, "llama")
    for i, block in enumerate(model.model.layers):
        model.model.layers[i] = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
    assert lean_unsupported_reason(model) is None
    prompts = _prompts(tok, 3, rng)
    params = SamplingParams(max_tokens=8, seed=rng.randrange(1 << 30))
    lean, plain = (HFEngine(model, tok, decode=d).generate(prompts, 2, params) for d in ("lean", "transformers"))
    assert [[c.token_ids for c in row] for row in lean] == [[c.token_ids for c in row] for row in plain]


@pytest.mark.parametrize("choice", ["auto", "lean", "transformers"])
def test_the_trainer_builds_the_engine_with_the_configured_decode_step(models, choice):
    from fastgrpo.config import HFRolloutConfig, RolloutConfig
    from fastgrpo.rollout.base import ENGINES, EngineSetup

    model, tok = models["llama"]
    setup = EngineSetup(cfg=RolloutConfig(hf=HFRolloutConfig(decode=choice)), model=model, tokenizer=tok,
                        model_path=str, prompt_token_bound=int, seed=0)
    engine = ENGINES["hf"].from_setup(setup)
    assert engine.decode == choice and (engine.lean_decoder() is None) == (choice == "transformers")


class _EagerStep:
    """What GraphedStep replays (LeanDecoder.step_static), run eagerly: CUDA graphs need a GPU."""

    def __init__(self, decoder, num_rows, device):
        self.decoder = decoder

    def __call__(self, tokens, positions, slot):
        return self.decoder.step_static(tokens, positions, slot)


@pytest.mark.parametrize("family", ["llama", "default"])
def test_static_step_decodes_the_same_tokens_as_the_growing_step(models, rng, monkeypatch, family):
    """The CUDA-graph path's step (all cache slots, unwritten ones masked, the slot a device tensor) gives the
    growing step's tokens and log-probs, on several chunks with left padding and early stops."""
    from fastgrpo.rollout import hf as hf_mod

    model, tok = models[family]
    prompts = _prompts(tok, 5, rng)
    params = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=rng.randrange(1 << 30), logprobs=True)
    growing = HFEngine(model, tok, batch_size=4, decode="lean").generate(prompts, 2, params)
    monkeypatch.setattr(hf_mod, "_graphs_on", lambda device: True)
    monkeypatch.setattr(hf_mod, "GraphedStep", _EagerStep)
    static = HFEngine(model, tok, batch_size=4, decode="lean").generate(prompts, 2, params)
    _assert_same_samples(static, growing)


def _assert_same_samples(static, growing, *, tol: float = 1e-5) -> None:
    """The same tokens and log-probs, up to exact ties: two steps that differ only in float rounding (here: a masked
    full cache against a growing one) may order two tokens of equal probability the other way round (seen: p
    0.0035057915 vs 0.0035057922, one rounding step apart, at the edge of the top-p nucleus), and the seeded draw then
    picks the other one. A divergence passes only where both picks had the same log-prob (a tie), in at most one
    completion of the batch; the tokens before it must match, and so must their log-probs."""
    diverged = 0
    for row_s, row_g in zip(static, growing):
        for a, b in zip(row_s, row_g):
            n = next((k for k, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), None)
            if n is None:
                assert a.token_ids == b.token_ids
                n = len(a.token_ids)
            else:
                diverged += 1
                assert abs(a.logprobs[n] - b.logprobs[n]) <= tol, (n, a.token_ids, b.token_ids)
            torch.testing.assert_close(torch.tensor(a.logprobs[:n]), torch.tensor(b.logprobs[:n]), rtol=tol, atol=tol)
    assert diverged <= 1, f"{diverged} completions diverged: more than rounding ties explain"


@pytest.mark.parametrize("decode", ["lean", "transformers"])
@pytest.mark.parametrize("family", ["llama", "default"])
def test_each_prompt_is_prefilled_once_with_the_same_samples(models, rng, monkeypatch, decode, family):
    """n samples of a prompt share one prefill (its KV cache fanned out to them), and give the tokens and log-probs
    of a prefill per sample (the same prompt passed n times with n=1: the same rows, chunks and draws), with left
    padding and chunks that start and end inside a prompt's samples (n=3, batch_size=4)."""
    model, tok = models[family]
    prompts = _prompts(tok, 4, rng, lo=1, hi=30)
    params = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=rng.randrange(1 << 30), logprobs=True)
    prefills = []
    forward = HFEngine._forward_last

    def counted(self, ids, mask, pos, cache):
        if not cache.layers[0].is_initialized:  # a chunk's prefill: its rows
            prefills.append(ids.shape[0])
        return forward(self, ids, mask, pos, cache)

    monkeypatch.setattr(HFEngine, "_forward_last", counted)
    engine = HFEngine(model, tok, batch_size=4, decode=decode)
    shared = engine.generate(prompts, 3, params)
    assert prefills == [2, 2, 2]  # the chunks' prompts: rows 0-3 (prompts 0, 0, 0, 1), 4-7 (1, 1, 2, 2), 8-11 (2, 3, ...)
    prefills.clear()
    per_sample = engine.generate([p for p in prompts for _ in range(3)], 1, params)
    assert prefills == [4, 4, 4]
    _assert_same_samples([[c] for row in shared for c in row], [[c] for row in per_sample for c in row])


def test_a_chunks_draws_do_not_depend_on_the_chunks_before_it(models, rng):
    """Each chunk has its own seeded stream: the second chunk's samples are the same whether or not the first
    chunk ran to max_tokens (here: the first chunk's prompts differ, so it stops at another step)."""
    model, tok = models["llama"]
    prompts = _prompts(tok, 4, rng)
    params = SamplingParams(max_tokens=10, seed=3)
    a = HFEngine(model, tok, batch_size=2).generate(prompts, 1, params)
    b = HFEngine(model, tok, batch_size=2).generate(list(reversed(prompts[:2])) + prompts[2:], 1, params)
    assert [r[0].token_ids for r in a[2:]] == [r[0].token_ids for r in b[2:]]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_decode_equals_the_eager_lean_step(tiny_cache):  # noqa: F811
    model, tok = _load(tiny_cache, "llama")
    model = model.cuda()
    prompts = [tok("a b c", add_special_tokens=False)["input_ids"], tok("hello", add_special_tokens=False)["input_ids"]]
    params = SamplingParams(max_tokens=24, seed=7, logprobs=True)
    graphed = HFEngine(model, tok, decode="lean").generate(prompts, 4, params)
    eager = HFEngine(model, tok, decode="lean", cuda_graph=False).generate(prompts, 4, params)
    assert [[c.token_ids for c in row] for row in graphed] == [[c.token_ids for c in row] for row in eager]

