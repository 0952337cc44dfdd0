"""The seeds' shaping rewards (ms-swift's cosine, repetition, soft_overlong) against values computed by hand."""

import math

import pytest

from fastgrpo.rewards import REWARDS, configure_rewards, load_reward_funcs


def _ids(n):
    return [7] * n


def test_cosine_by_hand():
    # max_len 10, ms-swift defaults: correct 1.0 at length 0 -> 0.5 at 10; wrong -0.5 at 0 -> 0.0 at 10.
    # At length 5 the cosine is halfway: correct 1 - 0.5 * (1 - cos(pi/2)) / 2 = 0.75, wrong -0.25.
    comps = ["<answer>4</answer>", "<answer>4</answer>", "<answer>4</answer>", "<answer>5</answer>",
             "<answer>5</answer>", "<answer>5</answer>"]
    ids = [_ids(0), _ids(5), _ids(10), _ids(0), _ids(5), _ids(10)]
    got = REWARDS["cosine"](comps, ids, accuracy="gsm8k", max_len=10, answer=["4"] * 6)
    assert got == pytest.approx([1.0, 0.75, 0.5, -0.5, -0.25, 0.0])
    # length 2 of 10: correct = 1 - 0.5 * (1 - cos(pi/5)) / 2
    one = REWARDS["cosine"](["<answer>4</answer>"], [_ids(2)], accuracy="gsm8k", max_len=10, answer=["4"])
    assert one[0] == pytest.approx(1 - 0.5 * (1 - math.cos(math.pi / 5)) / 2)


def test_cosine_takes_its_limit_from_the_config_and_its_values_from_kwargs():
    fn = dict(configure_rewards(load_reward_funcs(["cosine"]),
                                {"cosine": {"accuracy": "gsm8k", "min_len_value_correct": 2.0,
                                            "max_len_value_correct": 1.0}}, max_completion_length=4))["cosine"]
    got = fn(completions=["<answer>1</answer>"] * 2, completion_ids=[_ids(2), _ids(4)], answer=["1", "1"])
    assert got == pytest.approx([1.5, 1.0])
    with pytest.raises(ValueError, match="max_len"):
        REWARDS["cosine"](["x"], [_ids(1)], accuracy="gsm8k", answer=["1"])


def test_repetition_by_hand():
    fn = REWARDS["repetition"]
    # 3-grams of "a b c a b c": (a b c), (b c a), (c a b), (a b c): 3 distinct of 4 -> (1 - 3/4) * -1
    assert fn(["a b c a b c", "A b C a B c", "x y z w", "a b", ""]) == pytest.approx([-0.25, -0.25, 0.0, 0.0, 0.0])
    # bigrams of "go go go go": 1 distinct of 3 -> (1 - 1/3) * -0.5
    assert fn(["go go go go"], n_grams=2, max_penalty=-0.5) == pytest.approx([-(2 / 3) * 0.5])
    with pytest.raises(ValueError, match="max_penalty"):
        fn(["a"], max_penalty=1.0)


def test_soft_overlong_by_hand():
    fn = REWARDS["soft_overlong"]
    # limit 20, buffer 4: free up to 16 tokens, then linearly to -1 at 20
    got = fn(["x"] * 5, [_ids(10), _ids(16), _ids(18), _ids(20), _ids(25)], soft_cache_length=4,
             max_completion_length=20)
    assert got == pytest.approx([0.0, 0.0, -0.5, -1.0, -1.0])
    assert fn(["x"], [_ids(19)], soft_cache_length=4, soft_max_length=20) == pytest.approx([-0.75])
    with pytest.raises(ValueError, match="soft_cache_length"):
        fn(["x"], [_ids(1)], max_completion_length=20)
    with pytest.raises(ValueError, match="0 < soft_cache_length < soft_max_length"):
        fn(["x"], [_ids(1)], soft_cache_length=30, max_completion_length=20)
