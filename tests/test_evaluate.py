"""Evaluation metrics: the unbiased pass@k for every k up to n and maj@n, against values computed by hand."""

from itertools import combinations

import pytest

from fastgrpo.trainers.evaluate import evaluate, majority_correct, pass_at_k, sample_metrics
from fastgrpo.rewards import REWARDS
from fastgrpo.rewards.math_answer import answer_key
from fastgrpo.rollout.base import Completion


def test_pass_at_k_by_hand_and_by_enumeration():
    # n = 4 samples, 1 correct: pass@2 = 1 - C(3,2)/C(4,2) = 1/2, pass@3 = 1 - C(3,3)/C(4,3) = 3/4
    assert [pass_at_k(4, 1, k) for k in (1, 2, 3, 4)] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    for n in range(1, 7):  # the estimator is the share of k-subsets holding a correct sample
        for c in range(n + 1):
            for k in range(1, n + 1):
                subsets = list(combinations([True] * c + [False] * (n - c), k))
                assert pass_at_k(n, c, k) == pytest.approx(sum(any(s) for s in subsets) / len(subsets))


def test_sample_metrics_every_k_and_pass1_equals_mean():
    correct = [[True, False, False, False], [True, True, False, False], [False] * 4]
    out = sample_metrics(correct)
    assert out["pass@1"] == pytest.approx(out["mean@4"]) == pytest.approx((0.25 + 0.5 + 0) / 3)
    # prompt 2 (c = 2): pass@2 = 1 - C(2,2)/C(4,2) = 5/6; pass@3 = 1
    assert out["pass@2"] == pytest.approx((0.5 + 5 / 6 + 0) / 3)
    assert out["pass@3"] == pytest.approx((0.75 + 1 + 0) / 3)
    assert out["pass@4"] == out["best_of_4"] == pytest.approx(2 / 3)
    assert "maj@4" not in out


def test_majority_vote_by_hand():
    assert majority_correct([5, 3, 5, None], [False, True, False, False]) is False  # 5 wins twice, and is wrong
    assert majority_correct([3, 5, 5, 3], [True, False, False, True]) is True  # tie: 3 was stated first
    assert majority_correct([None, None], [False, False]) is False
    assert majority_correct([None, 7], [False, True]) is True


def test_math_answer_keys_compare_values():
    assert answer_key("<answer>12</answer>") == answer_key("<answer> 12.0 </answer>") == answer_key("so $12")
    assert answer_key("<answer>\\frac{1}{2}</answer>") == answer_key("<answer>0.5</answer>")
    assert answer_key("no number at all") is None


class _Scripted:
    """Greedy: the first scripted text; sampling: the n scripted texts."""

    def __init__(self, texts):
        self.texts = texts

    def generate(self, prompt_ids, n, params):
        pick = self.texts if n > 1 else [t[:1] for t in self.texts]
        return [[Completion(token_ids=[1], text=t, finish_reason="stop") for t in ts] for ts in pick]


def test_evaluate_reports_pass_at_every_k_and_maj_for_gsm8k():
    texts = [["<answer>4</answer>", "<answer>5</answer>", "<answer>5</answer>", "<answer>4.0</answer>"],
             ["<answer>1</answer>", "<answer>2</answer>", "<answer>2</answer>", "x"]]
    rows = [{"question": "2+2", "answer": "#### 4"}, {"question": "1+0", "answer": "1"}]
    out = evaluate(_Scripted(texts), rows, ["p0", "p1"], [[1], [2]], reward_fn=REWARDS["gsm8k"], best_of_n=4,
                   temperature=1.0, max_tokens=4, seed=0)
    assert out["greedy_acc"] == 1.0
    assert out["pass@1"] == pytest.approx((0.5 + 0.25) / 2)
    assert out["pass@2"] == pytest.approx((5 / 6 + 0.5) / 2)
    # prompt 0: 4 and 5 tie at two each, 4 stated first -> correct; prompt 1: 2 wins -> wrong
    assert out["maj@4"] == 0.5
    countdown = evaluate(_Scripted(texts), [{"nums": [1, 3], "target": 4}] * 2, ["p0", "p1"], [[1], [2]],
                         reward_fn=REWARDS["countdown"], best_of_n=4, temperature=1.0, max_tokens=4, seed=0)
    assert "maj@4" not in countdown and "pass@4" in countdown  # countdown answers are not compared
