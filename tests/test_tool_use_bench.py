"""benchmarks/tool_use.py: the counts of how trajectories use the calculator, on hand-written conversations."""

from __future__ import annotations

import pytest

from benchmarks.tool_use import tool_use_counts


def _call(expr: str) -> str:
    return '<tool_call>{"name": "calculator", "arguments": {"expression": "' + expr + '"}}</tool_call>'


def _conv(*turns: tuple[str, str]) -> list[dict]:
    """(assistant text, tool result or '') pairs -> messages; an empty result means no tool message follows."""
    msgs = []
    for text, result in turns:
        msgs.append({"role": "assistant", "content": text})
        if result:
            msgs.append({"role": "tool", "content": result})
    return msgs


ROW = {"nums": [3, 3, 2], "target": 4}


def test_counts_confirmed_answers_misses_and_copy_failures():
    convs = [
        # a miss, then a confirmed call, then its equation as the answer
        _conv((_call("3*3-2"), "7"), (_call("(3+3)-2"), "4"), ("<think></think><answer>(3+3)-2</answer>", "")),
        # a confirmed call whose equation is not copied: the answer is wrong
        _conv((_call("(3+3)-2"), "4"), ("<think></think><answer>(2+2)/3</answer>", "")),
        # a miss, then a right answer without a second call
        _conv((_call("3+3+2"), "8"), ("<answer>3+3-2</answer>", "")),
        # a malformed call (its error message), then a wrong answer
        _conv(('<tool_call>{"name": "calculator"', "Error: a <tool_call> block was not closed"),
              ("<answer>3</answer>", "")),
        # no call at all, right
        _conv(("<answer>3-(2-3)</answer>", "")),
    ]
    c = tool_use_counts([ROW] * len(convs), convs)
    assert c == {"problems": 5, "correct": 3, "with_call": 4, "calls": 5, "malformed": 1, "with_second_call": 1,
                 "correct_confirmed": 1, "correct_after_miss": 2, "confirmed_not_answered": 1}


def test_a_malformed_call_keeps_later_results_with_their_calls():
    # the malformed first call has its own error message: the second call's result is its own, not the first's
    conv = _conv(('<tool_call>not json</tool_call>', "Error: the tool call is not valid JSON"),
                 (_call("(3+3)-2"), "4"), ("<answer>(3+3)-2</answer>", ""))
    c = tool_use_counts([ROW], [conv])
    assert c["correct_confirmed"] == 1 and c["malformed"] == 1 and c["correct_after_miss"] == 1


def test_rows_and_conversations_must_pair_up():
    with pytest.raises(ValueError, match="2 rows for 1 conversations"):
        tool_use_counts([ROW, ROW], [_conv(("<answer>1</answer>", ""))])
