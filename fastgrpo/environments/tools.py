"""The tools environment: the model calls typed Python functions; their results come back as tool messages.

A tool is a plain function with type hints and a Google-style docstring (TRL's convention); its JSON schema comes
from ``transformers.utils.get_json_schema`` and is passed to the chat template's ``tools=``. After each model turn
the tool calls in its text are parsed (``rollout.env.tool_call_format``; Qwen2.5/Qwen3/Hermes write
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``) and run in worker processes
(:class:`ToolPool`, the worker sandbox of :mod:`fastgrpo.runtime.sandbox`) with ``rollout.env.timeout_s`` each. A turn
without a tool call is the model's answer: the trajectory ends.

Nothing a tool does stops the run. A call that raises, hangs (its worker is killed and replaced), crashes its
worker, prints or returns megabytes (cut to ``rollout.env.max_output_chars``) or returns something with no text,
a call of an unknown tool, and a call that is not valid JSON each become a tool message that says what went wrong
(``Error: ...``), and are counted (``env/tool_calls``, ``env/tool_failure_rate``, ``env/tool_failures/<kind>``).
"""

from __future__ import annotations

import ast
import json
import operator
import re
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Callable

from fastgrpo.config import EnvConfig
from fastgrpo.config.loader import check, section_check
from fastgrpo.environments.base import ENVIRONMENTS, Environment, EnvironmentFactory
from fastgrpo.runtime import plugins
from fastgrpo.runtime.sandbox import CallFailure, WorkerPool

__all__ = ["TOOLS", "TOOL_CALL_FORMATS", "ToolCall", "ToolEnvironment", "ToolPool", "ToolsFactory", "calculator",
           "parse_qwen_tool_calls", "register_tool", "tool_schemas"]


# ---------------------------------------------------------------------------------------------------- built-ins

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def _evaluate(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return Fraction(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Div) and right == 0:
            raise ValueError("division by zero")
        return _OPS[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _evaluate(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    raise ValueError("only numbers, + - * / and parentheses are allowed")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly.

    Args:
        expression: Numbers with + - * / and parentheses, e.g. "(7 - 3) * 2".
    """
    if len(expression) > 200:
        raise ValueError("expression longer than 200 characters")
    value = _evaluate(ast.parse(expression.strip(), mode="eval"))
    return str(value.numerator) if value.denominator == 1 else f"{value.numerator}/{value.denominator}"


TOOLS: dict[str, Callable[..., Any]] = {"calculator": calculator}
"""Built-in tools by name (the choices of rollout.env.tools besides plugin files)."""


def register_tool(name: str) -> Callable:
    """Decorator: make ``name`` a valid ``rollout.env.tools`` entry (a module-level function: workers import it)."""

    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        TOOLS[name] = fn
        return fn

    return deco


def tool_schemas(funcs: list[Callable[..., Any]]) -> list[dict[str, Any]]:
    """The JSON schema of each tool, as the chat template's ``tools=`` takes them; ValueError naming a function
    whose type hints or docstring do not give one."""
    try:
        from transformers.utils import get_json_schema
    except ImportError:
        raise ImportError("tool schemas need transformers: pip install transformers") from None
    out = []
    for fn in funcs:
        try:
            out.append(get_json_schema(fn))
        except Exception as e:  # transformers raises its own error types for missing hints / docstrings
            raise ValueError(f"rollout.env.tools: no schema for {getattr(fn, '__name__', fn)!r}: {e} (a tool needs "
                             "type hints and a docstring with an Args: section)") from None
    return out


# ---------------------------------------------------------------------------------------------------- parsing


@dataclass
class ToolCall:
    """One tool call parsed from a model turn: a name and arguments, or why it could not be read."""

    name: str = ""
    arguments: dict[str, Any] | None = None
    error: str | None = None


_QWEN_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def parse_qwen_tool_calls(text: str) -> list[ToolCall]:
    """Every ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` block of ``text`` (Qwen2.5, Qwen3 and
    Hermes chat templates); ``arguments`` may also be a JSON string of the object. A block that is not such JSON,
    or an opened block never closed, is a call with an ``error``."""
    calls = []
    for body in _QWEN_CALL.findall(text):
        try:
            obj = _loads(body)
        except ValueError as e:
            calls.append(ToolCall(error=str(e)))
            continue
        args = obj.get("arguments", {}) if isinstance(obj, dict) else None
        if isinstance(args, str):
            try:
                args = _loads(args)
            except ValueError:
                args = None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not isinstance(args, dict):
            calls.append(ToolCall(error='a tool call is {"name": <tool name>, "arguments": {<name>: <value>}}'))
            continue
        calls.append(ToolCall(name=obj["name"], arguments=args))
    if text.count("<tool_call>") > text.count("</tool_call>"):
        calls.append(ToolCall(error="a <tool_call> block was not closed with </tool_call>"))
    return calls


def _loads(text: str) -> Any:
    """A model's JSON -> the value; ValueError with the tool message's text for anything Python's ``json`` cannot
    read, including what it raises besides JSONDecodeError: nesting past the recursion limit (RecursionError) and
    integers of more than 4,300 digits (int's string conversion limit)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"the tool call is not valid JSON ({e.msg} at character {e.pos})") from None
    except RecursionError:
        raise ValueError("the tool call is nested too deeply to read") from None
    except ValueError as e:  # "Exceeds the limit (4300 digits) for integer string conversion"
        raise ValueError(f"the tool call cannot be read: {str(e)[:120]}") from None


TOOL_CALL_FORMATS: dict[str, Callable[[str], list[ToolCall]]] = {"qwen": parse_qwen_tool_calls}
"""rollout.env.tool_call_format -> parser of a model turn's text into tool calls."""


# ---------------------------------------------------------------------------------------------------- running


def cut(text: str, max_chars: int, total: int | None = None) -> str:
    """``text`` cut to ``max_chars`` characters, saying so and how long the whole was (``total``: the length of
    the text ``text`` begins, when only its beginning was kept)."""
    total = len(text) if total is None else total
    if total <= max_chars:
        return text
    note = f"... [cut: {total} characters in all]"
    return text[:max(0, max_chars - len(note))] + note


IMPORT_TIMEOUT_S = 60.0
"""Least seconds a tool worker gets to import the tools (rollout.env.timeout_s when longer)."""


class ToolPool(WorkerPool):
    """The worker sandbox running :mod:`fastgrpo.environments._tool_worker`: each call has a deadline, a worker past
    it is killed and replaced, a worker that dies is replaced."""

    worker_module = "fastgrpo.environments._tool_worker"
    what, noun = "rollout.env.tools", "tool"
    timeout_key = f"rollout.env.timeout_s; an import gets at least {IMPORT_TIMEOUT_S:g} s"


class ToolsFactory(EnvironmentFactory):
    """``rollout.env.name: tools``: the worker pool and schemas that every trajectory's ToolEnvironment shares."""

    def __init__(self, cfg: Any) -> None:
        specs = [name if ":" in name else _worker_spec(name) for name in cfg.tools]
        self.timeout_s, self.max_output_chars = cfg.timeout_s, cfg.max_output_chars
        self.parse = TOOL_CALL_FORMATS[cfg.tool_call_format]
        self.pool = ToolPool(specs, size=cfg.num_workers, timeout_s=cfg.timeout_s)
        # a tool file that fails, exits or hangs at import is an error now (an import may take longer than a call)
        self.pool.wait_ready(max(cfg.timeout_s, IMPORT_TIMEOUT_S))
        # in this process too, for the schemas (imported safely above)
        funcs = [plugins.resolve(s, what=f"rollout.env.tools: tool {s!r}") for s in specs]
        self.names = [getattr(f, "__name__", s.rpartition(":")[2]) for f, s in zip(funcs, specs)]
        for k, name in enumerate(self.names):  # the model calls a tool by name: two of one name, one never runs
            if name in self.names[:k]:
                raise ValueError(f"rollout.env.tools: {specs[self.names.index(name)]!r} and {specs[k]!r} are both "
                                 f"named {name!r}; the model calls tools by name, so one of them could never be "
                                 "called: rename one")
        self._schemas = tool_schemas(funcs)
        self._counters: dict[str, list[float]] = {}

    @property
    def tool_schemas(self) -> list[dict[str, Any]]:
        return self._schemas

    def new(self) -> "ToolEnvironment":
        return ToolEnvironment(self)

    def run(self, calls: list[ToolCall]) -> list[str]:
        """The text of each call's tool message, all calls at once on the pool (``Error: ...`` for a failure)."""
        texts: list[str | None] = [None] * len(calls)
        kinds: list[str | None] = [None] * len(calls)
        jobs, where = [], []
        for k, c in enumerate(calls):
            if c.error is not None:
                texts[k], kinds[k] = f"Error: {c.error}", "parse"
            elif c.name not in self.names:
                texts[k], kinds[k] = f"Error: unknown tool {c.name[:80]!r}; the tools are {self.names}", "unknown_tool"
            else:
                jobs.append([(self.names.index(c.name), c.arguments, self.max_output_chars)])
                where.append(k)
        for k, (result,) in zip(where, self.pool.run(jobs) if jobs else []):
            if isinstance(result, CallFailure):
                kinds[k] = result.kind
                message = result.message
                if result.kind == "timeout":
                    message = f"did not finish within {self.timeout_s:g} s and was stopped"
                elif result.kind == "crash":
                    message = "the tool's process died"
                texts[k] = cut(f"Error: {message}", self.max_output_chars)
            else:
                texts[k] = result[0]
        for kind in kinds:
            self.count("tool_calls", 1.0)
            self.count("tool_failure_rate", float(kind is not None))
            if kind is not None:
                self.count(f"tool_failures/{kind}", 1.0)
        return texts  # type: ignore[return-value]

    def close(self) -> None:
        self.pool.close()


def _worker_spec(name: str) -> str:
    """How a tool worker imports the registered tool ``name`` (``module:qualname``)."""
    if name not in TOOLS:
        raise ValueError(f"rollout.env.tools: unknown tool {name!r}; built-in tools are {sorted(TOOLS)}; for your "
                         "own write 'path/to/file.py:function'")
    spec = plugins.importable_name(TOOLS[name])
    if spec is None:
        raise ValueError(f"rollout.env.tools: tool {name!r} ({TOOLS[name]!r}) cannot be imported by a tool worker "
                         "process; register a module-level function, or name it as 'path/to/file.py:function'")
    return spec


class ToolEnvironment(Environment):
    """One trajectory with tools: a turn with tool calls gets their results (one ``tool`` message per call); a
    turn without one ends the trajectory."""

    observation_role = "tool"

    def __init__(self, factory: ToolsFactory) -> None:
        self.factory = factory

    def step(self, text: str) -> tuple[list[dict[str, Any]] | None, None, bool]:
        return self.step_many([self], [text])[0]

    @classmethod
    def step_many(cls, envs: list["ToolEnvironment"], texts: list[str]) -> list[tuple[Any, None, bool]]:
        factory = envs[0].factory
        calls = [factory.parse(t) for t in texts]  # [K][calls of trajectory k]
        results = iter(factory.run([c for cs in calls for c in cs]))
        out = []
        for cs in calls:
            if not cs:
                out.append((None, None, True))  # no tool call: the model answered
                continue
            out.append(([{"role": "tool", "name": c.name or "invalid", "content": next(results)} for c in cs],
                        None, False))
        return out


ENVIRONMENTS["tools"] = ToolsFactory


@section_check(EnvConfig)
def check_tools_settings(env: EnvConfig, p: str) -> None:
    """The tool pool's settings, and tools only with the tools environment (which needs at least one)."""
    check(env.timeout_s > 0, f"{p}.timeout_s", f"must be > 0, got {env.timeout_s}")
    check(env.num_workers >= 1, f"{p}.num_workers", f"must be >= 1, got {env.num_workers}")
    check(env.max_output_chars >= 16, f"{p}.max_output_chars", f"must be >= 16, got {env.max_output_chars}")
    check(env.name != "tools" or bool(env.tools), f"{p}.tools", "the 'tools' environment needs at least one tool")
    check(not env.tools or env.name == "tools", f"{p}.tools",
          f"tools are called by the 'tools' environment only; set {p}.name=tools")
