"""SFT data: Countdown traces the rewards accept, prompt/completion and chat rows, clear errors on bad rows."""

import json
import random

import pytest

from fastgrpo.config import DataConfig
from fastgrpo.data.countdown import generate_problems, iter_solutions
from fastgrpo.data.sft import SOLUTIONS, TRACES, build_sft_datasets, countdown_trace, rows_to_pairs
from fastgrpo.rewards.countdown import countdown_reward
from fastgrpo.rewards.format import format_reward


@pytest.fixture(scope="module")
def tiny_tokenizer(tmp_path_factory):
    from fastgrpo.config import ModelConfig
    from fastgrpo.models.loading import load_tokenizer
    from fastgrpo.models.tiny import build_tiny

    return load_tokenizer(ModelConfig(name_or_path=str(build_tiny(cache_dir=tmp_path_factory.mktemp("tiny")))))


@pytest.mark.parametrize("solution", SOLUTIONS)
@pytest.mark.parametrize("style", sorted(TRACES))
@pytest.mark.parametrize("dist", [dict(min_numbers=3, max_numbers=4, max_value=99),
                                  dict(min_numbers=3, max_numbers=3, max_value=9)])
def test_every_trace_is_a_solution_the_rewards_score_one(style, dist, solution):
    rows = generate_problems(150, seed=f"trace-{random.random()}", **dist)
    trace_rng = random.Random(0)
    completions = [countdown_trace(r, style, trace_rng, solution=solution) for r in rows]
    assert all(c is not None for c in completions)  # the generator only makes problems with integer solutions
    # a multi-turn trace ('tool'): the rewards read its last assistant turn
    completions = [c.rpartition("<|im_start|>assistant\n")[2] for c in completions]
    nums, target = [r["nums"] for r in rows], [r["target"] for r in rows]
    assert countdown_reward(completions, nums=nums, target=target) == [1.0] * len(rows)
    assert format_reward(completions) == [1.0] * len(rows)


def test_random_solution_draws_among_all_solutions_and_first_is_fixed():
    row = {"nums": [3, 5, 4], "target": 12}
    every = {f"<think></think><answer>{e}</answer>" for _, e in iter_solutions(row["nums"], row["target"])}
    assert len(every) > 2
    rng = random.Random(0)
    drawn = {countdown_trace(row, "answer", rng, solution="random") for _ in range(200)}
    assert drawn == every  # every solution shows up, nothing else does
    assert len({countdown_trace(row, "answer", rng) for _ in range(20)}) == 1
    with pytest.raises(ValueError, match="sft.solution"):
        countdown_trace(row, "answer", rng, solution="best")


def test_solutions_follow_countdown_rules_and_steps_add_up():
    for steps, expr in iter_solutions([3, 5, 4, 2], 24):
        assert len(steps) == 3
        for step in steps:
            lhs, value = step.split("=")
            assert int(value) > 0 and eval(lhs) == int(value)  # noqa: S307 (test-only, solver-made text)
        assert int(steps[-1].split("=")[1]) == 24
        assert countdown_reward([f"<answer>{expr}</answer>"], nums=[[3, 5, 4, 2]], target=[24]) == [1.0]
    assert list(iter_solutions([2, 3, 7], 100)) == []


def test_countdown_source_uses_the_grpo_split_and_template(tiny_tokenizer):
    cfg = DataConfig(source="countdown", template="compact", num_train=40, num_eval=8, min_numbers=3,
                     max_numbers=3, max_value=9)
    train, held_out, info = build_sft_datasets(cfg, trace="steps", tokenizer=tiny_tokenizer)
    from fastgrpo.data import build_datasets

    grpo_train, grpo_eval, _ = build_datasets(cfg)
    assert [(p["nums"], p["target"]) for p in held_out] == [(r["nums"], r["target"]) for r in grpo_eval]
    assert {(tuple(p["nums"]), p["target"]) for p in train}.isdisjoint(
        {(tuple(p["nums"]), p["target"]) for p in held_out})
    p = train[0]
    assert p["prompt"] == f"{' '.join(map(str, p['nums']))} -> {p['target']}\n"
    assert p["completion"].startswith("<think>") and p["completion"].endswith("</answer><|im_end|>")
    assert info["num_train"] == 40 and info["num_eval"] == 8


def test_prompt_completion_and_messages_rows(tiny_tokenizer):
    pairs, skipped = rows_to_pairs([{"prompt": "Q: 1+1?\n", "completion": "2", "extra": 5}], tokenizer=tiny_tokenizer)
    assert pairs == [{"prompt": "Q: 1+1?\n", "completion": "2", "extra": 5}] and skipped == 0
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    pairs, _ = rows_to_pairs([{"messages": msgs}], tokenizer=tiny_tokenizer)
    assert pairs[0]["prompt"] == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert pairs[0]["completion"] == "hello"


@pytest.mark.parametrize("rows,match", [
    ([{"prompt": "a", "completion": "b"}, {"prompt": "a"}], r"row 1: field 'completion' is missing"),
    ([{"prompt": "a", "completion": "b"}, {"prompt": 3, "completion": "b"}], r"row 1: field 'prompt' must be a string"),
    ([{"messages": [{"role": "user", "content": "x"}, {"role": "user", "content": "y"}]}],
     r"row 0: field 'messages' must end with an assistant message"),
    ([{"messages": [{"role": "user", "content": "x"}, {"role": "assistant"}]}], r"row 0: field 'messages\[1\]'"),
    ([{"question": "q"}], r"need 'prompt' and 'completion' columns or a 'messages' column"),
])
def test_a_bad_row_names_the_row_and_the_field(rows, match, tiny_tokenizer):
    with pytest.raises(ValueError, match=match):
        rows_to_pairs(rows, tokenizer=tiny_tokenizer)


def test_skip_invalid_rows_counts_them(tiny_tokenizer):
    rows = [{"prompt": "a", "completion": "b"}, {"prompt": "a", "completion": None}, {"prompt": "c", "completion": "d"}]
    pairs, skipped = rows_to_pairs(rows, tokenizer=tiny_tokenizer, skip_invalid_rows=True)
    assert [p["prompt"] for p in pairs] == ["a", "c"] and skipped == 1


def test_a_jsonl_file_gets_eos_and_a_disjoint_held_out_split(tmp_path, tiny_tokenizer):
    path = tmp_path / "sft.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"q{i}\n", "completion": f"a{i}"}) + "\n" for i in range(20)))
    train, held_out, info = build_sft_datasets(DataConfig(source=str(path), num_eval=5), trace="steps",
                                               tokenizer=tiny_tokenizer)
    assert len(train) == 15 and len(held_out) == 5
    assert {p["prompt"] for p in train}.isdisjoint(p["prompt"] for p in held_out)
    assert all(p["completion"].endswith("<|im_end|>") and p["completion"].count("<|im_end|>") == 1
               for p in train + held_out)
