"""The environments package: tool-call parsing, the calculator, tool schemas, the tool workers' failure handling,
environment plugins and their config checks (fastgrpo.environments)."""

from pathlib import Path

import pytest

from fastgrpo.config import ConfigError, EnvConfig, ModelConfig, load_config
from fastgrpo.environments import (Environment, ToolCall, ToolsFactory, build_environment, calculator,
                                   parse_qwen_tool_calls, step_result, tool_schemas)
from fastgrpo.environments.trajectory import ObservationRenderer, ToolsTemplate, turn_seed
from fastgrpo.models.loading import load_tokenizer

ROOT = Path(__file__).resolve().parents[1]


def test_qwen_tool_calls_are_parsed_and_malformed_ones_say_why():
    text = ('I will compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "3 + 4"}}\n</tool_call>'
            '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>'
            '<tool_call>{"name": "g", oops}</tool_call><tool_call>[1]</tool_call><tool_call>{"name": "h"')
    calls = parse_qwen_tool_calls(text)
    assert calls[0] == ToolCall(name="calculator", arguments={"expression": "3 + 4"})
    assert calls[1] == ToolCall(name="f", arguments={"x": 1})  # arguments as a JSON string (some templates)
    assert "not valid JSON" in calls[2].error and "a tool call is" in calls[3].error
    assert "not closed" in calls[4].error
    assert parse_qwen_tool_calls("<answer>7</answer>") == []


@pytest.mark.parametrize("expression,value", [("(7 - 3) * 2", "8"), ("9 / 6", "3/2"), ("-2 + 1.5", "-1/2")])
def test_calculator_is_exact(expression, value):
    assert calculator(expression) == value


@pytest.mark.parametrize("expression", ["__import__('os')", "2 ** 99999", "1 / (2 - 2)", "x + 1", "1" * 300])
def test_calculator_refuses_anything_but_arithmetic(expression):
    with pytest.raises((ValueError, SyntaxError)):
        calculator(expression)


def test_tool_schema_from_type_hints_and_docstring():
    (schema,) = tool_schemas([calculator])
    assert schema["function"]["name"] == "calculator"
    assert schema["function"]["parameters"]["required"] == ["expression"]

    def undocumented(x: int) -> int:
        return x

    with pytest.raises(ValueError, match="no schema for 'undocumented'"):
        tool_schemas([undocumented])


def test_tools_factory_answers_unknown_tools_and_bad_calls_with_an_error_message():
    factory = build_environment(EnvConfig(name="tools", tools=["calculator"], timeout_s=5, num_workers=1))
    try:
        assert isinstance(factory, ToolsFactory)
        texts = factory.run([ToolCall(name="calculator", arguments={"expression": "2 * 21"}),
                             ToolCall(name="calculator", arguments={"expr": "1"}),
                             ToolCall(name="search", arguments={}), ToolCall(error="the tool call is not valid JSON")])
        assert texts[0] == "42"
        assert texts[1].startswith("Error: TypeError") and "expr" in texts[1]
        assert texts[2] == "Error: unknown tool 'search'; the tools are ['calculator']"
        assert texts[3] == "Error: the tool call is not valid JSON"
        counters = factory.take_counters()
        assert sum(counters["tool_calls"]) == 4 and counters["tool_failure_rate"] == [0.0, 1.0, 1.0, 1.0]
        assert factory.take_counters() == {}
        env = factory.new()
        assert env.step("no call: the answer is 7") == (None, None, True)
        (messages, reward, done), = env.step_many([env], ['<tool_call>{"name": "calculator", "arguments": '
                                                          '{"expression": "6 * 7"}}</tool_call>'])
        assert messages == [{"role": "tool", "name": "calculator", "content": "42"}] and not done
    finally:
        factory.close()


def test_a_tool_file_that_fails_at_import_is_an_error_before_any_model_loads(tmp_path):
    bad = tmp_path / "bad_tools.py"
    bad.write_text("raise SystemExit(3)\n")
    with pytest.raises(ValueError, match="rollout.env.tools"):
        build_environment(EnvConfig(name="tools", tools=[f"{bad}:f"], timeout_s=5, num_workers=1))


class Guess(Environment):
    def step(self, text):
        return "higher", 0.0, False


def test_environment_plugin_file_is_loaded_and_its_output_checked(tmp_path):
    plugin = tmp_path / "my_env.py"
    plugin.write_text("from fastgrpo.environments import Environment\n"
                      "class Echo(Environment):\n"
                      "    def __init__(self, prefix):\n        self.prefix = prefix\n"
                      "    def step(self, text):\n        return self.prefix + text, 1, True\n")
    factory = build_environment(EnvConfig(name=f"{plugin}:Echo", kwargs={"prefix": "> "}))
    env = factory.new()
    assert step_result(env.step("hi"), env) == ([{"role": "user", "content": "> hi"}], 1.0, True)
    with pytest.raises(ValueError, match="not a fastgrpo.environments.Environment subclass"):
        build_environment(EnvConfig(name=f"{plugin}:Environment2"))
    for out, match in [("text", "expected \\(observation, reward, done\\)"), ((3, None, False), "observation 3"),
                       (("x", "high", False), "reward 'high'"), (("x", float("nan"), False), "must be finite")]:
        with pytest.raises(ValueError, match=match):
            step_result(out, Guess())


@pytest.mark.parametrize("overrides,field", [
    (["rollout.max_turns=3"], "rollout.max_turns"),  # no environment to answer
    (["rollout.env.name=tools"], "rollout.env.tools"),  # no tools
    (["rollout.env.name=tool", "rollout.env.tools=[calculator]"], "rollout.env.name"),
    (["rollout.env.name=tools", "rollout.env.tools=[calc]"], "rollout.env.tools"),
    (["rollout.env.tools=[calculator]"], "rollout.env.tools"),  # tools without the tools environment
    (["rollout.env.name=tools", "rollout.env.tools=[calculator]", "rollout.env.timeout_s=0"], "rollout.env.timeout_s"),
])
def test_bad_environment_config_names_the_field(overrides, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_config(None, overrides)


def test_environment_tokens_follow_the_chat_template_and_tools_reach_it():
    tok = load_tokenizer(ModelConfig(name_or_path="tiny"))
    render = ObservationRenderer(tok)
    ids = render([{"role": "tool", "name": "calculator", "content": "42"}])
    assert tok.decode(ids) == "\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n"
    seen = {}
    proxy = ToolsTemplate(tok, [{"type": "function"}])

    class Spy:  # records what a chat template is given
        def apply_chat_template(self, messages, **kwargs):
            seen.update(kwargs)
            return ""

    proxy._tokenizer = Spy()
    proxy.apply_chat_template([], tokenize=False)
    assert seen["tools"] == [{"type": "function"}]


def test_turn_seeds_are_fixed_by_the_step_seed_and_differ_between_turns():
    assert turn_seed(5, 0) == 5 and turn_seed(None, 3) is None
    assert turn_seed(5, 1) == turn_seed(5, 1) != turn_seed(5, 2) != turn_seed(6, 1)


def test_the_guess_number_example_runs(tmp_path, monkeypatch):
    from fastgrpo.trainers.grpo import Trainer

    monkeypatch.chdir(ROOT)  # the example's paths are relative to the repository root
    cfg = load_config("examples/guess_number/config.yaml", [
        f"output_dir={tmp_path}", "max_steps=1", "grpo.prompts_per_step=2", "grpo.num_generations=2",
        "rollout.max_completion_length=48", "checkpoint.export_hf=false", "log.progress=false"])
    trainer = Trainer(cfg)
    try:
        record = trainer.run()
    finally:
        trainer.close()
    assert record["env/turns_mean"] >= 1.0 and "reward/solved/mean" in record
