"""Multi-turn rollouts: environments (tools among them) that answer the model between its turns.

- :mod:`fastgrpo.environments.base`: the Environment interface (``reset(row)``, ``step(text) -> (observation,
  reward, done)``), the ENVIRONMENTS registry (``register_environment``) and loading ``path/to/file.py:ClassName``;
- :mod:`fastgrpo.environments.tools`: the tools environment (typed Python functions run in worker processes with a
  time bound; TOOLS registry, ``register_tool``; TOOL_CALL_FORMATS);
- :mod:`fastgrpo.environments.trajectory`: the engine-agnostic multi-turn driver and the episodes it gives the
  trainer (environment tokens attended, with token weight 0). Imported by name, not here: this package's top
  imports no torch, so a tool worker process starts in an interpreter's start-up time.
"""

from fastgrpo.environments.base import (ENV_REWARDS_COLUMN, ENVIRONMENTS, Environment, EnvironmentFactory, StepResult,
                                        build_environment, register_environment, step_result)
from fastgrpo.environments.tools import (TOOL_CALL_FORMATS, TOOLS, ToolCall, ToolEnvironment, ToolPool, ToolsFactory,
                                         calculator, parse_qwen_tool_calls, register_tool, tool_schemas)

__all__ = ["ENV_REWARDS_COLUMN", "ENVIRONMENTS", "Environment", "EnvironmentFactory", "StepResult", "TOOLS",
           "TOOL_CALL_FORMATS", "ToolCall", "ToolEnvironment", "ToolPool", "ToolsFactory", "build_environment",
           "calculator", "parse_qwen_tool_calls", "register_environment", "register_tool", "step_result",
           "tool_schemas"]
