"""The gsm8k and math rewards: answer extraction and precedence, number normalisation, adversarial inputs
(speed and no exceptions), the registry, conversational completions and math-verify's optional path."""

from __future__ import annotations

import logging
import random
import sys
from fractions import Fraction

import pytest

from _timing import timed
from fastgrpo.rewards import REWARDS, load_reward_funcs
from fastgrpo.rewards import math_answer
from fastgrpo.rewards.math_answer import (
    MAX_DIGITS,
    final_answer,
    gsm8k_reward,
    math_verify_reward,
    parse_number,
    reference_answer,
)

BUDGET_S = 0.010  # the contract: any completion up to 64 KB is scored within 10 ms
GSM8K_REF = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nAltogether she sold 48+24 = <<48+24=72>>72 clips.\n#### 72"


def g(completion, reference) -> float:
    return gsm8k_reward([completion], answer=[reference])[0]


# ---------------------------------------------------------------------------------------------------------
# correctness and the reference


def test_correct_and_incorrect_answers():
    assert g("<think>48 + 24</think>\n<answer>72</answer>", GSM8K_REF) == 1.0
    assert g("<think>48 + 24</think>\n<answer>71</answer>", GSM8K_REF) == 0.0


def test_random_integers_match_only_themselves():
    rng = random.Random()
    for _ in range(50):
        ref, other = rng.randrange(-10**6, 10**6), rng.randrange(-10**6, 10**6)
        completion = f"<think>the sum is {rng.randrange(10**4)}</think><answer>{ref:,}</answer>"
        assert g(completion, f"steps\n#### {ref}") == 1.0
        assert g(completion, f"#### {other}") == float(other == ref)


def test_reference_takes_what_follows_the_last_hashes():
    assert reference_answer("a #### 3\nb #### 5") == " 5"
    assert g("<answer>5</answer>", "a #### 3\nb #### 5") == 1.0
    assert g("<answer>3</answer>", "a #### 3\nb #### 5") == 0.0
    assert reference_answer("18") == "18"  # no ####: the whole string is the reference
    assert g("<answer>18</answer>", "18") == 1.0
    assert g("<answer>18</answer>", 18) == 1.0  # a numeric column read from json


def test_non_numeric_reference_compares_normalised_text():
    assert g("<answer> yes </answer>", "#### yes") == 1.0
    assert g("<answer>no</answer>", "#### yes") == 0.0
    assert g("<answer></answer>", "####   ") == 0.0  # an empty reference matches nothing


# ---------------------------------------------------------------------------------------------------------
# precedence: <answer> block, then \boxed{}, then the last number


def test_answer_block_beats_boxed_and_numbers():
    text = "so \\boxed{5} and then 7 <answer>9</answer> trailing 11"
    assert final_answer(text) == "9"
    assert g(text, "#### 9") == 1.0 and g(text, "#### 5") == 0.0 and g(text, "#### 11") == 0.0


def test_last_answer_block_wins():
    assert g("<answer>3</answer> wait, no: <answer>4</answer>", "#### 4") == 1.0
    assert g("<answer>3</answer> wait, no: <answer>4</answer>", "#### 3") == 0.0


def test_boxed_inside_answer_block_is_unwrapped():
    assert g("<answer>\\boxed{42}</answer>", "#### 42") == 1.0


def test_boxed_beats_last_number_and_matches_braces():
    assert final_answer("first \\boxed{1} then \\boxed{\\frac{3}{4}} and finally 10") == "\\frac{3}{4}"
    assert g("\\boxed{\\frac{36}{2}} then 5", "#### 18") == 1.0
    assert g("\\boxed{18} then 5", "#### 5") == 0.0


def test_last_number_is_the_fallback():
    assert g("I think it is 12, no, it is 1,250.50 dollars.", "#### 1250.5") == 1.0
    assert final_answer("numbers 1, 2, 3") == "3"  # a comma without three digits after it separates numbers
    assert final_answer("7-5") == "5"  # a minus after a digit is subtraction, not a sign
    assert final_answer("no digits here") is None


def test_declared_but_malformed_answer_does_not_fall_back_to_numbers():
    # The model committed to an answer; a stray number elsewhere must not rescue it.
    assert g("the answer is 72 <answer>seventy-two</answer>", "#### 72") == 0.0
    assert g("the answer is 72 \\boxed{72", "#### 72") == 0.0  # unclosed box


# ---------------------------------------------------------------------------------------------------------
# normalisation


@pytest.mark.parametrize("text", ["18", "18.0", "18.00", "$18", "\\$18", "18.", " 1 8 ", "36/2", "\\frac{36}{2}",
                                  "\\dfrac{54}{3}", "+18", "0018", "$18.00."])
def test_equal_forms_of_eighteen(text):
    assert parse_number(text) == 18
    assert g(f"<answer>{text}</answer>", "#### 18") == 1.0


def test_commas_fractions_and_decimals_are_exact():
    assert parse_number("1,000,000") == 10**6
    assert parse_number("0.1") == Fraction(1, 10)  # not the float 0.1
    assert parse_number("2/3") == Fraction(2, 3)
    assert parse_number(".5") == Fraction(1, 2)
    assert g("<answer>0.5</answer>", "#### 1/2") == 1.0
    assert g("<answer>0.3333</answer>", "#### 1/3") == 0.0


def test_negative_numbers():
    assert parse_number("-7") == -7 and parse_number("-\\frac{1}{2}") == Fraction(-1, 2)
    assert g("<answer>-7</answer>", "#### -7") == 1.0
    assert g("<answer>7</answer>", "#### -7") == 0.0
    assert g("the temperature fell to -7", "#### -7") == 1.0


@pytest.mark.parametrize("text", ["", "1e5", "1/0", "18 apples", "x", "1..2", "--5", "\\frac{1}{0}", "\\frac{a}{b}",
                                  "1.2.3", "inf", "nan", "0x12", "1_000"])
def test_non_numbers_are_rejected(text):
    assert parse_number(text) is None


# ---------------------------------------------------------------------------------------------------------
# adversarial inputs: 0.0, fast, never raising

ADVERSARIAL = {
    "64KB of digits in answer": "<answer>" + "9" * 65536 + "</answer>",
    "64KB of digits bare": "9" * 65536,
    "64KB of digits, then a word": "1" * 65520 + " is my answer",
    "64KB digits with commas": ",".join(["999"] * 16384),
    "nested braces in boxed": "\\boxed{" + "{" * 10000 + "1" + "}" * 10000 + "}",
    "unclosed nested braces": "\\boxed{" + "{" * 65000,
    "many boxed": "\\boxed{1}" * 7000 + "\\boxed{",
    "unicode digits": "<answer>\u0661\u0668</answer>",
    "unicode digits bare": "the answer is \u0661\u0668 \uff11\uff18",
    "exponent-like": "<answer>1e999999999</answer>",
    "huge power": "<answer>9**9**9**9</answer>",
    "exponent bare": "so 1e99999999999",
    "long fraction": "<answer>" + "9" * 5000 + "/" + "1" * 5000 + "</answer>",
    "empty": "",
    "answer tags only": "<answer></answer>" * 3000,
    "64KB of minus signs": "-" * 65536,
    "64KB of dots and digits": "1." * 32768,
    "not a string": 12345,
    "None": None,
}


@pytest.mark.parametrize("name", list(ADVERSARIAL))
@pytest.mark.parametrize("reward", [gsm8k_reward, math_verify_reward])
def test_adversarial_completions_score_zero_fast(name, reward):
    completion = ADVERSARIAL[name]
    result, best = timed(lambda: reward([completion], answer=["#### 18"]))
    assert result == [0.0]
    assert best < BUDGET_S, f"{name}: {best * 1e3:.2f} ms"


def test_long_digit_run_is_rejected_not_converted():
    # Longer than MAX_DIGITS is refused before int() (which would hit Python's int-str limit at 4300 digits).
    assert parse_number("1" * (MAX_DIGITS + 1)) is None
    assert parse_number("1" * MAX_DIGITS) == int("1" * MAX_DIGITS)


def test_random_garbage_never_raises():
    rng = random.Random()
    alphabet = "0123456789.,-+/$\\{}boxed<answer>/#  \u0661\uff11e"
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(200)))
        out = gsm8k_reward([text], answer=[f"#### {rng.randrange(100)}"])
        assert out[0] in (0.0, 1.0)


def test_missing_answer_column_is_a_data_error():
    with pytest.raises(ValueError, match="answer"):
        gsm8k_reward(["<answer>1</answer>"])
    with pytest.raises(ValueError, match="answer"):
        gsm8k_reward(["<answer>1</answer>"], answer=[["not", "a", "string"]])


# ---------------------------------------------------------------------------------------------------------
# registry, conversational form, TRL calling convention


def test_registry_has_both_names():
    assert REWARDS["gsm8k"] is gsm8k_reward and REWARDS["math"] is math_verify_reward
    assert [n for n, _ in load_reward_funcs(["format", "gsm8k", "math"])] == ["format", "gsm8k", "math"]


def test_conversational_completion_scores_like_text():
    text = "<think>48 + 24 = 72</think><answer>72</answer>"
    conv = [{"role": "assistant", "content": text}]
    for reward in (gsm8k_reward, math_verify_reward):
        assert reward([conv, text], answer=[GSM8K_REF, GSM8K_REF]) == [1.0, 1.0]
        assert reward([[{"role": "assistant", "content": "<answer>1</answer>"}]], answer=[GSM8K_REF]) == [0.0]


def test_extra_trl_columns_are_ignored():
    out = gsm8k_reward(["<answer>3</answer>", "<answer>4</answer>"], answer=["#### 3", "#### 3"],
                       prompts=["p", "p"], completion_ids=[[1], [2]], question=["q", "q"])
    assert out == [1.0, 0.0]


# ---------------------------------------------------------------------------------------------------------
# the math reward: fallback without math-verify, real path with it


def test_math_fallback_compares_numbers_and_warns_once(monkeypatch, caplog):
    monkeypatch.setattr(math_answer, "_math_verify", None)  # forget any earlier lookup
    monkeypatch.setitem(sys.modules, "math_verify", None)  # makes `import math_verify` fail
    with caplog.at_level(logging.WARNING, logger=math_answer.__name__):
        first = math_verify_reward(["<answer>0.5</answer>", "<answer>x</answer>"], answer=["1/2", "\\frac{1}{3}"])
        second = math_verify_reward(["\\boxed{\\frac{2}{4}}", "<answer>3</answer>"], answer=["#### 0.5", "#### 4"])
    assert first == [1.0, 0.0] and second == [1.0, 0.0]
    warnings = [r for r in caplog.records if "fastgrpo[math]" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING


def test_math_verify_symbolic_path():
    pytest.importorskip("math_verify")
    assert math_verify_reward(["<answer>\\frac{1}{2}</answer>"], answer=["0.5"]) == [1.0]
    assert math_verify_reward(["\\boxed{x(x+2)}"], answer=["x^2 + 2x"]) == [1.0]
    assert math_verify_reward(["\\boxed{x(x+3)}"], answer=["x^2 + 2x"]) == [0.0]
