"""Rewards: countdown (rules, adversarial inputs, speed), format, toy_digit, plugins and combining."""

from __future__ import annotations

import math
import random
from fractions import Fraction

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from _timing import timed
from fastgrpo.runtime.errors import RewardError
from fastgrpo.rewards import (
    REWARDS,
    combine_rewards,
    countdown_reward,
    format_reward,
    last_answer,
    load_reward_funcs,
    toy_digit_reward,
)

BUDGET_S = 0.010  # the contract: any completion up to 64 KB is scored within 10 ms


def cd(answer_text: str, nums: list[int], target: int) -> float:
    """Score one completion whose whole text is given."""
    return countdown_reward([answer_text], nums=[nums], target=[target])[0]


def ans(expr: str) -> str:
    return f"<think>working</think>\n<answer>{expr}</answer>"


# ---------------------------------------------------------------------------------------------------------
# countdown: the rules


def test_countdown_correct_equation_scores_one():
    assert cd(ans("(25 * 4) - 7"), [25, 4, 7], 93) == 1.0
    assert cd(ans("7 - 4 * 25"), [25, 4, 7], -93) == 1.0  # value exact, order of literals free


def test_countdown_wrong_value_scores_zero():
    assert cd(ans("25 * 4 + 7"), [25, 4, 7], 93) == 0.0


def test_countdown_uses_exact_fractions_not_floats():
    # In floats 8 / (3 - 8 / 3) is 24.000000000000004; the rule is exact arithmetic.
    assert 8 / (3 - 8 / 3) != 24
    assert cd(ans("8 / (3 - 8 / 3)"), [3, 3, 8, 8], 24) == 1.0


def test_countdown_rejects_reused_number():
    assert cd(ans("1 + 2 + 3 + 3"), [1, 2, 3], 9) == 0.0


def test_countdown_rejects_missing_number():
    assert cd(ans("4 * 5"), [4, 5, 1], 20) == 0.0


def test_countdown_repeated_numbers_need_each_copy():
    assert cd(ans("5 * 5 - 3"), [5, 5, 3], 22) == 1.0
    assert cd(ans("5 * 3 + 7"), [5, 5, 3], 22) == 0.0


def test_countdown_last_answer_block_wins():
    right, wrong = "<answer>1 + 2 + 3</answer>", "<answer>1 * 2 * 4</answer>"
    assert cd(f"{wrong} thinking again {right}", [1, 2, 3], 6) == 1.0
    assert cd(f"{right} thinking again {wrong}", [1, 2, 3], 6) == 0.0
    assert last_answer("<answer>a</answer><answer>b</answer> <answer>unclosed") == "b"


def test_countdown_equals_suffix_must_match_target():
    assert cd(ans("(1 + 2) * 3 = 9"), [1, 2, 3], 9) == 1.0
    assert cd(ans("(1 + 2) * 3 = 10"), [1, 2, 3], 9) == 0.0
    assert cd(ans("1 + 2 + 3 = 9"), [1, 2, 3], 9) == 0.0  # claims the target, computes 6
    assert cd(ans("(1 + 2) * 3 = 9 = 9"), [1, 2, 3], 9) == 0.0


@pytest.mark.parametrize("expr", ["-1 + 2 + 3", "1 + -2 + 7", "+1 + 2 + 3", "1 ** 2 + 3", "1.0 + 2 + 3",
                                  "0x1 + 2 + 3", "1_0 + 2 + 3", "abs(1) + 2 + 3", "(1)(2) + 3", "1 // 2 + 3",
                                  "1 % 2 + 3", "[1] + 2 + 3", "x + 2 + 3", "1 + 2 + 3;", "", "   "])
def test_countdown_rejects_anything_but_int_literals_binary_ops_and_parens(expr):
    assert cd(ans(expr), [1, 2, 3], 6) == 0.0


def test_countdown_without_answer_block_scores_zero():
    assert cd("1 + 2 + 3", [1, 2, 3], 6) == 0.0
    assert cd("<answer>1 + 2 + 3", [1, 2, 3], 6) == 0.0


def test_countdown_accepts_conversational_completions():
    msgs = [{"role": "assistant", "content": ans("1 + 2 + 3")}]
    assert countdown_reward([msgs], nums=[[1, 2, 3]], target=[6]) == [1.0]


def test_countdown_missing_columns_raise_naming_them():
    with pytest.raises(ValueError, match="target"):
        countdown_reward([ans("1")], nums=[[1]])


# ---------------------------------------------------------------------------------------------------------
# countdown: adversarial completions score 0.0, never raise, and take < 10 ms

_PAD = "x" * 30_000
ADVERSARIAL = {
    "power_tower": (ans("9**9**9**9"), [9, 9, 9, 9], 1),
    "nested_parens_10k": (ans("(" * 10_000 + "1" + ")" * 10_000), [1], 1),
    "unbalanced_parens_64k": (ans("(" * 64_000), [1], 1),
    # The nums entry is built without int(str): Python refuses str->int past 4300 digits.
    "literal_5000_digits": (ans("1" * 5000), [(10**5000 - 1) // 9], 1),
    "literal_5000_digits_times": (ans("9" * 5000 + " * 9"), [9, 9], 81),
    "division_by_zero": (ans("(1 + 2) / (3 - 3)"), [1, 2, 3, 3], 1),
    "fullwidth_digits": (ans("１２ + 3"), [12, 3], 15),
    "arabic_indic_digits": (ans("\u0661\u0662 + 3"), [12, 3], 15),
    "deep_parens_within_length": (ans("(" * 100 + "1" + ")" * 100), [1], 1),
    "unary_chain": (ans("-" * 200 + "1"), [1], 1),
    "many_answer_tags": ("<answer>" * 8000 + "</answer>", [1], 1),
    "many_close_tags": ("</answer>" * 7000, [1], 1),
    "open_tags_then_close": ("<answer>(" * 7000 + "</answer>", [1], 1),
    "long_answer": (ans("1 + " * 16_000 + "1"), [1] * 16_001, 16_001),
    "dunder_import": (ans("__import__('os').system('true')"), [1], 1),
    "huge_padding_then_garbage": (_PAD + "<answer>" + _PAD + "</answer>", [1], 1),
}


@pytest.mark.parametrize("name", list(ADVERSARIAL))
def test_countdown_adversarial_input_scores_zero_fast(name):
    text, nums, target = ADVERSARIAL[name]
    assert len(text.encode()) <= 64 * 1024 + 64
    score, seconds = timed(cd, text, nums, target)
    assert score == 0.0
    assert seconds < BUDGET_S, f"{name}: {seconds * 1e3:.2f} ms"


def test_countdown_large_correct_product_is_fine():
    # Nine-digit literals are allowed: big but legal equations are scored, not rejected.
    nums = [999_999_999, 999_999_999, 2]
    assert cd(ans("999999999 * 999999999 * 2"), nums, 999_999_999 ** 2 * 2) == 1.0


# ---------------------------------------------------------------------------------------------------------
# countdown: property tests


@st.composite
def expressions(draw):
    """(expression text, nums, exact value) for a random binary tree over a random multiset of numbers."""
    nums = draw(st.lists(st.integers(1, 99), min_size=1, max_size=6))
    rng = random.Random(draw(st.integers(0, 2**32)))
    items = [(Fraction(n), str(n)) for n in nums]
    rng.shuffle(items)
    while len(items) > 1:
        (a, ea), (b, eb) = items.pop(rng.randrange(len(items))), items.pop(rng.randrange(len(items)))
        op = rng.choice("+-*/" if b != 0 else "+-*")
        value = {"+": a + b, "-": a - b, "*": a * b, "/": a / b if b else None}[op]
        space = rng.choice(["", " "])
        items.append((value, f"({ea}{space}{op}{space}{eb})"))
    value, text = items[0]
    return text, nums, value


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(expressions())
def test_countdown_random_correct_expressions_score_one(case):
    text, nums, value = case
    if value.denominator != 1:
        # A non-integer value can never equal an integer target.
        assert cd(ans(text), nums, math.floor(value)) == 0.0
        return
    target = int(value)
    assert cd(ans(text), nums, target) == 1.0
    assert cd(ans(f"{text} = {target}"), nums, target) == 1.0
    assert cd(ans(text), nums, target + 1) == 0.0
    assert cd(ans(text), nums + [1], target) == 0.0  # a number left unused


_TOKENS = ["<answer>", "</answer>", "<think>", "</think>", "(", ")", "+", "-", "*", "/", "**", "=", " ", "\n",
           "1", "2", "99", "0", "9" * 40, "\u0663", "x", "."]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(st.text(max_size=3000), st.lists(st.sampled_from(_TOKENS), max_size=600).map("".join)),
       st.lists(st.integers(1, 99), min_size=1, max_size=4), st.integers(-5, 200))
def test_countdown_random_text_never_raises_and_is_fast(text, nums, target):
    score, seconds = timed(cd, text, nums, target)
    assert score in (0.0, 1.0)
    assert seconds < BUDGET_S


# ---------------------------------------------------------------------------------------------------------
# format


@pytest.mark.parametrize("text", [
    "<think>a</think><answer>b</answer>",
    " \n<think>\nlet me see\n</think>\n\n<answer> 1 + 2 </answer>\n",
    "<think></think><answer>b</answer>",
])
def test_format_accepts_think_then_answer(text):
    assert format_reward([text]) == [1.0]


@pytest.mark.parametrize("text", [
    "<answer>b</answer>",
    "<think>a</think>",
    "<think>a</think> hi <answer>b</answer>",
    "hi <think>a</think><answer>b</answer>",
    "<think>a</think><answer>b</answer> bye",
    "<think>a</think><answer>b</answer><answer>c</answer>",
    "<think>a<think>b</think><answer>c</answer>",
    "<think>a</think></think><answer>c</answer>",
    "<think>a</think><answer> </answer>",
    "<think>a</think><answer>b<think></answer>",
    "<answer>b</answer><think>a</think>",
    "<think>a</think><answer></answer>",
])
def test_format_rejects_other_shapes(text):
    assert format_reward([text]) == [0.0]


def test_format_knows_the_prompt_opened_think():
    completion = "reasoning here</think>\n<answer>1 + 2</answer>"
    assert format_reward([completion], prompts=["...Assistant: Let me think.\n<think>\n"]) == [1.0]
    assert format_reward([completion], prompts=["User: hi\nAssistant:"]) == [0.0]
    # The prompt opened <think>; opening it again is a second, nested block.
    assert format_reward(["<think>" + completion], prompts=["x <think>"]) == [0.0]
    conv_prompt = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "<think>"}]
    assert format_reward([[{"role": "assistant", "content": completion}]], prompts=[conv_prompt]) == [1.0]


@pytest.mark.parametrize("text", [
    "<think>" * 9000, "</think>" * 7000 + "</answer>", "<think>" + "<answer>" * 8000 + "</answer>",
    "<think>a</think>" + " " * 60_000 + "<answer>" + "x" * 4000, "<think>" + "x" * 65_000 + "</answer>",
])
def test_format_adversarial_is_zero_and_fast(text):
    score, seconds = timed(format_reward, [text])
    assert score == [0.0]
    assert seconds < BUDGET_S


# ---------------------------------------------------------------------------------------------------------
# toy_digit


def test_toy_digit_first_nonspace_ascii_digit():
    texts = ["  7 apples", "42", "\n\t0", "seven", "", "   ", "\u0663", "-1", "a1"]
    assert toy_digit_reward(texts) == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert toy_digit_reward([[{"role": "assistant", "content": "5"}]]) == [1.0]


# ---------------------------------------------------------------------------------------------------------
# loading and combining

PLUGIN = '''
def length_reward(completions, prompts=None, **kwargs):
    """A TRL-style reward: reads a dataset column through kwargs."""
    return [len(c) * w for c, w in zip(completions, kwargs["weight_col"])]

def maybe_reward(completions, **kwargs):
    return [None if c.startswith("skip") else 1.0 for c in completions]

def short_reward(completions, **kwargs):
    return [1.0]

class SwiftORM:
    def __call__(self, completions, solution, **kwargs):
        return [float(c == s) for c, s in zip(completions, solution)]

NOT_CALLABLE = 3
'''


@pytest.fixture(scope="module")
def plugin_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("plugin") / "my_rewards.py"
    path.write_text(PLUGIN)
    return path


def test_registry_holds_builtin_rewards():
    assert {"countdown", "format", "toy_digit"} <= set(REWARDS)
    names = [n for n, _ in load_reward_funcs(["format", "countdown", "toy_digit"])]
    assert names == ["format", "countdown", "toy_digit"]


def test_unknown_reward_names_closest_and_lists_registry():
    with pytest.raises(ValueError, match=r"'formatt'.*did you mean 'format'.*countdown"):
        load_reward_funcs(["formatt"])


def test_plugin_errors_are_clear(plugin_path, tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_reward_funcs([f"{tmp_path}/nope.py:f"])
    with pytest.raises(ValueError, match="defines no 'missing'.*length_reward"):
        load_reward_funcs([f"{plugin_path}:missing"])
    with pytest.raises(ValueError, match="not callable"):
        load_reward_funcs([f"{plugin_path}:NOT_CALLABLE"])
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('boom')\n")
    with pytest.raises(ValueError, match="boom"):
        load_reward_funcs([f"{broken}:f"])


def test_plugin_trl_function_and_swift_class_combine_with_builtins(plugin_path):
    funcs = load_reward_funcs([f"{plugin_path}:length_reward", f"{plugin_path}:SwiftORM", "toy_digit"])
    assert [n for n, _ in funcs] == ["length_reward", "SwiftORM", "toy_digit"]
    gen = torch.Generator().manual_seed(0)
    completions = ["1" * int(n) for n in torch.randint(1, 9, (6,), generator=gen)] + ["abc"]
    weight_col = torch.rand(7, generator=gen).tolist()
    columns = {"prompts": ["p"] * 7, "completion_ids": [[1]] * 7, "weight_col": weight_col,
               "solution": ["abc"] * 7}
    weights = [0.5, 2.0, -1.0]
    R, r = combine_rewards(funcs, weights, completions, columns)
    assert R.dtype == torch.float32 and R.shape == (7, 3) and r.dtype == torch.float64  # summed in float64
    expected_R = torch.tensor([[len(c) * w, float(c == "abc"), float(c[0].isdigit())]
                               for c, w in zip(completions, weight_col)])
    torch.testing.assert_close(R, expected_R)
    torch.testing.assert_close(r.float(), expected_R @ torch.tensor(weights))


def test_combine_none_is_nan_and_counts_zero(plugin_path):
    funcs = load_reward_funcs([f"{plugin_path}:maybe_reward", "toy_digit"])
    R, r = combine_rewards(funcs, [3.0, 1.0], ["skip 1", "1 ok", "skip"], {})
    assert torch.isnan(R[0, 0]) and torch.isnan(R[2, 0]) and R[1, 0] == 1.0
    assert r.tolist() == [0.0, 4.0, 0.0]
    with pytest.warns(UserWarning, match="every reward function returned None"):
        combine_rewards(funcs[:1], None, ["skip"], {})


def test_combine_wrong_output_count_names_function(plugin_path):
    funcs = load_reward_funcs([f"{plugin_path}:short_reward"])
    with pytest.raises(RewardError, match="'short_reward' returned 1 values for 2 completions"):
        combine_rewards(funcs, None, ["a", "b"], {})
    with pytest.raises(ValueError, match="2 reward weights for 1"):
        combine_rewards(funcs, [1.0, 1.0], ["a"], {})
    with pytest.raises(ValueError, match="column 'nums' has 1 entries for 2"):
        combine_rewards(load_reward_funcs(["countdown"]), None, ["a", "b"], {"nums": [[1]], "target": [1, 1]})


def test_combine_passes_columns_to_builtin_rewards():
    funcs = load_reward_funcs(["format", "countdown"])
    completions = ["<think>t</think><answer>2 * 3 + 1</answer>", "<think>t</think><answer>2 + 3</answer>",
                   "no tags"]
    columns = {"prompts": ["q"] * 3, "nums": [[1, 2, 3]] * 3, "target": [7, 5, 5]}
    R, r = combine_rewards(funcs, None, completions, columns)
    assert R.tolist() == [[1.0, 1.0], [1.0, 0.0], [0.0, 0.0]]
    assert r.tolist() == [2.0, 1.0, 0.0]


def test_countdown_claim_may_be_wider_than_any_literal():
    # found by the hypothesis test: a correct equation whose target has 10 digits
    from fastgrpo.rewards import REWARDS

    text = "<think>x</think><answer>((44*((99*37)*85))*73) = 1000072260</answer>"
    assert REWARDS["countdown"]([text], nums=[[44, 99, 37, 85, 73]], target=[1000072260]) == [1.0]
    wide = "<answer>" + "1" * 10 + " = 1111111111</answer>"  # a literal still may not be that wide
    assert REWARDS["countdown"]([wide], nums=[[1111111111]], target=[1111111111]) == [0.0]


def test_built_ins_scored_in_process_only_read_their_arguments():
    """The runner gives these built-ins the step's own lists, uncopied: a change would reach the next
    reward and the trainer's data."""
    import copy

    from fastgrpo.rewards.loader import IN_PROCESS

    completions = [ans("3 + 4 - 1"), "<think>x</think><answer>6</answer>", "7 apples",
                   [{"role": "assistant", "content": ans("(1 + 2) * 2")}]]
    kwargs = {"completions": completions, "prompts": ["p"] * 4, "completion_ids": [[1, 2], [3], [4, 5], [6]],
              "nums": [[3, 4, 1], [1, 2, 3], [7], [1, 2]], "target": [6, 6, 7, 6],
              "answer": ["6", "#### 6", "7", "6"], "task": ["countdown"] * 4}
    for fn in IN_PROCESS:
        before = copy.deepcopy(kwargs)
        fn(**kwargs)
        assert kwargs == before, fn.__name__
