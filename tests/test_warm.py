"""fastgrpo.trainers.warm: the embedded warm model is built by its SFT recipe (here with a stand-in budget), cached by its
hash, the same whatever the caller's thread count, and the demo evaluates on problems its SFT never saw."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from fastgrpo.trainers import warm
from fastgrpo.config import load_config
from fastgrpo.data import build_datasets, problem_key


def test_warm_model_is_built_once_by_its_recipe_and_keyed_by_its_hash(tmp_path, monkeypatch):
    # A stand-in budget (2 steps of 8) in a private cache: the full recipe takes minutes.
    stale = tmp_path / f".{warm.warm_folder('countdown', tmp_path).name}.killed"  # a build killed mid-way
    (stale / "build").mkdir(parents=True)
    path = warm.build_warm("countdown", cache_dir=tmp_path, overrides=["max_steps=2", "sft.batch_size=8",
                                                                        "data.num_train=32", "checkpoint.every=0"])
    assert path == warm.warm_folder("countdown", tmp_path) and (path / "model.safetensors").is_file()
    assert not stale.exists()  # cleaned by the next build, under the lock
    assert warm.build_warm("countdown", cache_dir=tmp_path) == path  # cached: no second build
    monkeypatch.setitem(warm.WARM_RECIPES, "countdown", warm.WARM_RECIPES["countdown"] + ["optim.lr=1e-4"])
    assert warm.warm_folder("countdown", tmp_path) != path  # a changed recipe is another folder
    with pytest.raises(ValueError, match="tiny:countdown"):
        warm.recipe_config("nope")


def test_keys_added_later_leave_the_cache_key_while_they_keep_the_old_behaviour(monkeypatch):
    """optim.implementation is 'auto', foreach on the build's CPU, as the builds ran before the option existed:
    the folder stays the one already cached; another value is another folder."""
    recipe = warm.WARM_RECIPES["countdown"]
    before = warm.warm_folder("countdown")
    # the key every cache holds at _WARM_VERSION w2: a change here rebuilds every user's warm
    # models and moves the demo's starting point, so it is made on purpose (a new recipe or version), not by a new key
    assert before.name == "tiny-countdown-fa3ddf570a72"
    monkeypatch.setitem(warm.WARM_RECIPES, "countdown", recipe + ["optim.implementation=auto"])
    assert warm.warm_folder("countdown") == before
    monkeypatch.setitem(warm.WARM_RECIPES, "countdown", recipe + ["optim.implementation=fused"])
    assert warm.warm_folder("countdown") != before


def test_warm_model_weights_do_not_depend_on_the_callers_thread_count(tmp_path, monkeypatch):
    # 3 steps of 64 rows: enough for 1 and 2 torch threads to round differently when the build is not pinned.
    stand_in = ["max_steps=3", "data.num_train=192", "checkpoint.every=0"]
    digests = []
    for threads in ("1", "2"):
        monkeypatch.setenv("OMP_NUM_THREADS", threads)
        path = warm.build_warm("countdown", cache_dir=tmp_path / threads, overrides=stand_in)
        digests.append(hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest())
    assert digests[0] == digests[1]


def test_the_demo_evaluates_on_problems_the_warm_models_sft_never_saw():
    demo = load_config(Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml")
    assert demo.model.name_or_path == "tiny:countdown"
    sft_train, _, _ = build_datasets(warm.recipe_config("countdown").data)  # the problems the SFT recipe trains on
    grpo_train, held_out, _ = build_datasets(demo.data)
    assert len(held_out) >= 64
    held_out_keys = {problem_key(r) for r in held_out}
    assert held_out_keys.isdisjoint(problem_key(r) for r in sft_train + grpo_train)


def test_a_recipe_from_another_warm_model_builds_that_first_and_follows_its_key(tmp_path, monkeypatch):
    """tiny:countdown-tools starts from tiny:countdown: the base is built first in the same cache, the child starts
    from its folder, and a changed base is another folder for what starts from it."""
    assert warm.warm_base("countdown-tools") == "countdown" and warm.warm_base("countdown") is None
    tools_before = warm.warm_folder("countdown-tools")
    small = ["max_steps=2", "sft.batch_size=8", "data.num_train=32", "checkpoint.every=0"]
    monkeypatch.setitem(warm.WARM_RECIPES, "countdown", warm.WARM_RECIPES["countdown"] + small)
    assert warm.warm_folder("countdown-tools") != tools_before  # the base's key reaches it
    monkeypatch.setitem(warm.WARM_RECIPES, "countdown-tools", warm.WARM_RECIPES["countdown-tools"] + small)
    commands, run = [], warm.subprocess.run
    monkeypatch.setattr(warm.subprocess, "run", lambda cmd, **kw: commands.append(cmd) or run(cmd, **kw))
    path = warm.build_warm("countdown-tools", cache_dir=tmp_path)
    base = warm.warm_folder("countdown", tmp_path)
    assert (base / "model.safetensors").is_file() and (path / "model.safetensors").is_file()
    assert path.parent == base.parent == warm.tiny_cache_root(tmp_path)
    # two builds, the base first; the second starts from the base's folder (not from the default cache's)
    assert len(commands) == 2 and "sft.trace=answer" in commands[0] and "sft.trace=tool" in commands[1]
    assert f"model.name_or_path={base}" in commands[1]
    monkeypatch.setitem(warm.WARM_RECIPES, "loop", ["model.name_or_path=tiny:loop"])
    with pytest.raises(ValueError, match="starts from itself"):
        warm.warm_folder("loop")
