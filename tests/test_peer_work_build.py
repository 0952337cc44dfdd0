"""benchmarks/peer_work.py's model builds: every cached no-EOS model has finite weights and logits over the work's
prompts and never gives EOS a chance; a build that fails the check is refused with one line and not cached."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import peer_work

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=151936, tie_word_embeddings=True)
"""Qwen2.5's vocabulary (the sampler's and the EOS check's size) on a trunk small enough to build in a second."""


@pytest.fixture
def small_shape(monkeypatch):
    monkeypatch.setitem(peer_work.SHAPES, "small", SMALL)
    monkeypatch.setattr(peer_work, "CHECK_PROMPTS", 2)  # the benchmarks' 4 take twice as long
    return "small"


def test_builds_have_finite_logits_and_no_eos_over_several_seeds(small_shape, tmp_path, monkeypatch):
    for seed in range(3):
        folder = peer_work.build_model_folder(small_shape, tmp_path / f"seed{seed}", seed=seed)
        report = json.loads((folder / "peer_work_checked.json").read_text())  # what the build's check saw
        assert report == {"seed": seed, "prompts": peer_work.CHECK_PROMPTS,
                          "max_eos_probability": report["max_eos_probability"]}
        assert 0 <= report["max_eos_probability"] <= peer_work.MAX_EOS_PROBABILITY
    with monkeypatch.context() as m:  # a checked folder is reused as it is
        m.setattr(peer_work, "check_built_model", lambda *a, **k: pytest.fail("a cached folder was rebuilt"))
        assert peer_work.build_model_folder(small_shape, folder, seed=seed) == folder


def _overflowing_norm(suppress):
    def edit(model, eos_ids, **kw):
        suppress(model, eos_ids, **kw)
        with torch.no_grad():
            model.model.norm.weight.fill_(3e38)  # finite weights, logits past float32's range
    return edit


@pytest.mark.parametrize("edit,needle", [(_overflowing_norm, "the logits of prompt 0 are not finite"),
                                         (lambda suppress: lambda model, eos_ids, **kw: None,
                                          "an EOS id keeps probability")])
def test_a_build_that_fails_the_check_is_refused_and_not_cached(small_shape, tmp_path, monkeypatch, edit, needle):
    monkeypatch.setattr(peer_work, "suppress_eos", edit(peer_work.suppress_eos))
    dest = tmp_path / "model"
    with pytest.raises(ValueError) as err:
        peer_work.build_model_folder(small_shape, dest, seed=0)
    message = str(err.value)
    assert "\n" not in message and needle in message and "small (seed 0)" in message and str(dest) in message
    assert not dest.exists() and not list(tmp_path.iterdir())  # no folder, no build left behind


def test_two_builds_of_the_same_folder_at_once_leave_one_checked_model(small_shape, tmp_path):
    """bench_trl and count_ops on one cache may build the same model at the same time: each builds in a folder of
    its own, the first to finish is kept, and the other returns it."""
    from concurrent.futures import ThreadPoolExecutor

    dest = tmp_path / "model"
    with ThreadPoolExecutor(2) as pool:
        built = list(pool.map(lambda _: peer_work.build_model_folder(small_shape, dest, seed=1), range(2)))
    assert built == [dest, dest] and (dest / "peer_work_checked.json").is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["model"]  # no build folder left behind
