"""The arithmetic data source (fastgrpo.data.arithmetic): generation, held-out split, config, prompts, its reward."""

from __future__ import annotations

import pytest

from fastgrpo.config import ConfigError, DataConfig, check_section, load_config
from fastgrpo.data import build_datasets, render_prompt
from fastgrpo.data.arithmetic import OPERATORS, arithmetic_splits, generate_problems, problem_key
from fastgrpo.rewards import REWARDS


def _cfg(**kw) -> DataConfig:
    return check_section(DataConfig(source="arithmetic", **kw), "data")


def test_same_seed_same_rows_and_another_seed_other_rows(rng):
    seed = rng.randrange(2**31)
    kw = dict(ops=["+", "-", "*"], digits=[2, 2], num_train=200, num_eval=50)
    train, eval_rows, info = build_datasets(_cfg(seed=seed, **kw))
    assert build_datasets(_cfg(seed=seed, **kw))[:2] == (train, eval_rows)
    other_train, other_eval, _ = build_datasets(_cfg(seed=seed + 1, **kw))
    assert other_train != train and other_eval != eval_rows
    assert info["task"] == "arithmetic" and (info["num_train"], info["num_eval"]) == (200, 50)


def test_rows_follow_digits_and_ops_and_carry_the_exact_answer(rng):
    train, eval_rows, _ = build_datasets(_cfg(ops=["+", "-", "*"], digits=[2, 1], num_train=300, num_eval=60,
                                              seed=rng.randrange(2**31)))
    for row in train + eval_rows:
        assert set(row) == {"a", "op", "b", "answer", "task"} and row["task"] == "arithmetic"
        a, b = row["a"], row["b"]
        if row["op"] == "-":  # the larger operand first: a non-negative result, digits possibly swapped
            assert a >= b and sorted([len(str(a)), len(str(b))]) == [1, 2]
        else:
            assert 10 <= a <= 99 and 1 <= b <= 9
        assert row["answer"] == str(OPERATORS[row["op"]][0](a, b)) and int(row["answer"]) >= 0
    assert {r["op"] for r in train} == {"+", "-", "*"}  # every operator is drawn


def test_held_out_problems_never_reach_training_even_with_operands_swapped(rng):
    # One-digit sums: 45 distinct problems, so the training stream keeps drawing held-out ones (and swapped copies).
    train, eval_rows = arithmetic_splits(num_train=30, num_eval=15, seed=rng.randrange(2**31), ops=["+"],
                                         digits=[1, 1])
    train_keys = [problem_key(r) for r in train]
    assert len(set(train_keys)) == len(train_keys)
    assert not set(train_keys) & {problem_key(r) for r in eval_rows}
    assert problem_key({"a": 3, "op": "+", "b": 7}) == problem_key({"a": 7, "op": "+", "b": 3})
    assert problem_key({"a": 3, "op": "*", "b": 7}) == problem_key({"a": 7, "op": "*", "b": 3})
    assert problem_key({"a": 7, "op": "-", "b": 3}) != problem_key({"a": 3, "op": "-", "b": 7})


def test_held_out_split_does_not_depend_on_num_train():
    kw = dict(num_eval=20, seed=5, ops=["*"], digits=[2, 1])
    assert arithmetic_splits(num_train=10, **kw)[1] == arithmetic_splits(num_train=400, **kw)[1]


def test_too_few_distinct_problems_raise_naming_the_settings():
    with pytest.raises(ValueError, match=r"found only 45 distinct problems.*digits \[1, 1\]"):
        generate_problems(60, seed=0, ops=["+"], digits=[1, 1])


def test_bad_ops_and_digits_are_config_errors():
    with pytest.raises(ConfigError, match=r"data\.ops: unknown '/'"):
        _cfg(ops=["/"])
    with pytest.raises(ConfigError, match=r"data\.ops"):
        _cfg(ops=[])
    for digits in ([2], [0, 1], [2, 10]):
        with pytest.raises(ConfigError, match=r"data\.digits"):
            _cfg(digits=digits)


def test_prompt_asks_for_the_bare_number_in_every_template():
    row = {"a": 29, "op": "*", "b": 8, "answer": "232", "task": "arithmetic"}
    assert render_prompt(row, template="compact") == "29 * 8 ="
    base = render_prompt(row, template="base")
    assert "What is 29 * 8? Answer with just the number." in base


def test_gsm8k_reward_scores_the_last_number_against_the_answer_column():
    reward = REWARDS["gsm8k"]
    completions = ["232", "29 * 8 = 232", "29 * 8 = 232.", "29 * 8 = 216",  # right, right, right, wrong product
                   "232\n\nI added the number 29 to it",  # a ramble past the product ends on another number
                   "To solve this, we need to", "<answer>232</answer> and 5"]  # no number; a declared answer wins
    assert reward(completions, answer=["232"] * len(completions)) == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0]


def test_shipped_config_is_the_arithmetic_task_with_gsm8k_as_its_evaluation():
    cfg = load_config("configs/smollm2.yaml")
    assert cfg.data.source == "arithmetic" and cfg.rewards.funcs[-1] == "gsm8k"
    train, eval_rows, _ = build_datasets(cfg.data)
    assert len(eval_rows) == cfg.eval.num_prompts  # the evaluation covers the whole held-out split
    assert not {problem_key(r) for r in train} & {problem_key(r) for r in eval_rows}
