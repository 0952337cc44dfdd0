"""One plugin loader and one worker sandbox (fastgrpo.runtime.plugins, .sandbox, .worker) serve rewards, tools and
environments: a plugin file is one module whatever loads it, and each caller's errors name its own config key."""

from __future__ import annotations

import pytest

from fastgrpo.config import EnvConfig
from fastgrpo.environments import build_environment
from fastgrpo.rewards import load_reward_funcs
from fastgrpo.runtime import plugins
from tests.test_layering import PACKAGES, import_graph

BOTH = '''
open({counter!r}, "a").write("imported\\n")
from fastgrpo.environments import Environment

def score(completions, **kwargs):
    return [1.0] * len(completions)

class Game(Environment):
    def step(self, text):
        return None, 1.0, True
'''


def test_a_file_holding_a_reward_and_an_environment_runs_once(tmp_path):
    counter = tmp_path / "imports.txt"
    plugin = tmp_path / "both.py"
    plugin.write_text(BOTH.format(counter=str(counter)))
    (name, score), = load_reward_funcs([f"{plugin}:score"])
    factory = build_environment(EnvConfig(name=f"{plugin}:Game"))
    load_reward_funcs([f"{plugin}:score"])
    assert counter.read_text() == "imported\n"  # one execution for the reward, the environment and a second load
    assert name == "score" and type(factory.new()).__module__ == score.__module__


def test_an_environment_spec_without_a_class_name_says_what_to_write(tmp_path):
    plugin = tmp_path / "env.py"
    plugin.write_text("")
    with pytest.raises(ValueError, match=r"rollout.env.name=.*: write 'path/to/file.py:ClassName'"):
        build_environment(EnvConfig(name=f"{plugin}:"))


def test_a_tool_file_that_fails_at_import_is_named_as_a_tool(tmp_path):
    plugin = tmp_path / "tools_file.py"
    plugin.write_text("raise RuntimeError('no network here')\n")
    with pytest.raises(ValueError) as info:
        build_environment(EnvConfig(name="tools", tools=[f"{plugin}:lookup"], num_workers=1))
    message = str(info.value)
    assert message.startswith(f"rollout.env.tools: tool '{plugin}:lookup': importing") and "no network here" in message
    assert "reward" not in message


def test_importable_name_refuses_what_another_process_cannot_import():
    assert plugins.importable_name(plugins.resolve) == "fastgrpo.runtime.plugins:resolve"
    assert plugins.importable_name(lambda: 0) is None

    def inner():
        pass

    assert plugins.importable_name(inner) is None


def test_tools_and_environments_use_the_runtime_sandbox_not_the_rewards_package():
    graph = import_graph(PACKAGES)
    for module in ("fastgrpo.environments.base", "fastgrpo.environments.tools", "fastgrpo.environments._tool_worker"):
        assert not {m for m in graph[module] if m.startswith("fastgrpo.rewards")}, module
    assert {"fastgrpo.runtime.sandbox", "fastgrpo.runtime.plugins"} <= graph["fastgrpo.environments.tools"]
    assert "fastgrpo.runtime.worker" in graph["fastgrpo.rewards._worker"]
    assert "fastgrpo.runtime.worker" in graph["fastgrpo.environments._tool_worker"]
