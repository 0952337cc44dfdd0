"""The Environment interface of multi-turn rollouts, the ENVIRONMENTS registry and loading of users' environments.

An environment answers the model between its turns. One instance serves one trajectory:

    env = factory.new()
    first = env.reset(row)                 # the first user message, or None: the dataset's prompt as rendered
    observation, reward, done = env.step(model_text)   # after every model turn

``observation`` is a string (one message of role ``env.observation_role``), a list of chat messages (e.g. tool
results), or None; ``reward`` a number or None (per-turn rewards reach the reward functions as the ``env_rewards``
column); ``done`` ends the trajectory. The tools environment (:mod:`fastgrpo.environments.tools`) is one such
environment. A user's environment is a subclass in a file, named in the config as ``path/to/file.py:ClassName``
(instantiated with ``rollout.env.kwargs``), or registered with :func:`register_environment`.

Environments run in the trainer process; randomness they need should come from the row (resume is bit-exact only
when a step's environments behave the same when the step is run again). Tools run in worker processes.
"""

from __future__ import annotations

import abc
import difflib
import inspect
import math
from typing import Any, Callable, NamedTuple

from fastgrpo.config import EnvConfig
from fastgrpo.config.loader import check, section_check
from fastgrpo.runtime import plugins
from fastgrpo.runtime.errors import PluginError, RunError

__all__ = ["ENV_REWARDS_COLUMN", "ENVIRONMENTS", "Environment", "EnvironmentFactory", "StepResult", "build_environment",
           "call_plugin", "clean_text", "register_environment", "show", "step_result"]

Observation = str | list[dict[str, Any]] | None

ENV_REWARDS_COLUMN = "env_rewards"
"""The reward keyword argument holding each trajectory's per-turn environment rewards (a list of floats)."""


class StepResult(NamedTuple):
    """A step's output once :func:`step_result` checked it."""

    messages: list[dict[str, Any]]
    """Chat messages to append (possibly none)."""
    reward: float | None
    """The turn's reward, if the environment gives one."""
    done: bool
    """The trajectory ended."""


class Environment(abc.ABC):
    """One trajectory's environment (see the module docstring)."""

    observation_role: str = "user"
    """The role of a string observation's message."""
    tool_schemas: list[dict[str, Any]] = []
    """JSON schemas of the tools the model may call, passed to the chat template's ``tools=``."""

    def reset(self, row: dict[str, Any]) -> str | None:
        """Start a trajectory on dataset ``row``: the first user message, or None (the dataset's prompt). Every
        trajectory of one row must return the same (its G samples share the prompt)."""
        return None

    @abc.abstractmethod
    def step(self, text: str) -> tuple[Observation, float | None, bool]:
        """The environment's answer to the model's turn ``text``: ``(observation, reward, done)``."""

    @classmethod
    def step_many(cls, envs: list["Environment"], texts: list[str]) -> list[tuple[Observation, float | None, bool]]:
        """Step several trajectories of this class at once (default: one by one). Override to batch the work
        (the tools environment runs all the turn's tool calls in its worker pool together)."""
        return [env.step(text) for env, text in zip(envs, texts)]


def show(value: Any, limit: int = 80) -> str:
    """``repr(value)`` cut to ``limit`` characters, for an error message about a plugin's value: never raises (an
    int of 5,000 digits has no repr, a class's ``__repr__`` may raise) and has no lone surrogates."""
    try:
        text = repr(value)
    except BaseException:  # noqa: BLE001 (user code: whatever its __repr__ raises)
        text = f"<a {type(value).__name__} with no repr>"
    text = clean_text(text)
    return text if len(text) <= limit else text[:limit] + "..."


def clean_text(text: str) -> str:
    """``text`` with each lone surrogate (half of a UTF-16 pair, which JSON's ``\\ud800`` escapes and Python strings
    allow, but UTF-8 and so every tokenizer refuses) replaced by U+FFFD; a valid pair becomes its character."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


def call_plugin(what: str, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, where ``fn`` is an environment's code (``what``: e.g. ``'GuessNumber.step'``): the one error
    boundary around it. Whatever it raises, a SystemExit included (a plugin never ends the run, silently or not),
    becomes a :class:`~fastgrpo.runtime.errors.PluginError` naming ``what``: one line, not a traceback from inside
    the trainer. Ctrl-C and fastgrpo's own run errors (e.g. a tool worker's) go through unchanged."""
    try:
        return fn(*args)
    except (KeyboardInterrupt, RunError):
        raise
    except BaseException as e:  # noqa: BLE001
        raise PluginError(f"environment {what} raised {type(e).__name__}: {clean_text(str(e))[:200]}") from None


def _done(value: Any, name: str) -> bool:
    """A step's ``done``: a bool, an int, or a one-value array / tensor (numpy's bool_, a 0-d tensor)."""
    if isinstance(value, (bool, int)) or tuple(getattr(value, "shape", (None,))) == ():
        try:
            return bool(value)
        except Exception:  # noqa: BLE001 (a 0-d object whose __bool__ raises)
            pass
    raise PluginError(f"environment {name}.step returned done={show(value, 60)}; expected True or False")


def step_result(out: Any, env: Environment) -> StepResult:
    """Check what ``env.step`` returned; a PluginError (one line, naming the environment) for anything but
    ``(observation, reward, done)`` with a string / chat messages / None, a finite number / None and a bool."""
    name = type(env).__name__
    if not isinstance(out, (tuple, list)) or len(out) != 3:
        raise PluginError(f"environment {name}.step returned {show(out)}; expected (observation, reward, done)")
    observation, reward, done = out
    if observation is None:
        messages = []
    elif isinstance(observation, str):
        messages = [{"role": env.observation_role, "content": clean_text(observation)}]
    elif isinstance(observation, list) and all(isinstance(m, dict) and isinstance(m.get("content"), str)
                                               and isinstance(m.get("role"), str) for m in observation):
        messages = [{k: clean_text(v) if isinstance(v, str) else v for k, v in m.items()} for m in observation]
    else:
        raise PluginError(f"environment {name}.step returned the observation {show(observation)}; expected a "
                          "string, a list of chat messages ({'role': ..., 'content': str}) or None")
    if reward is not None:
        try:
            reward = float(reward)
        except (TypeError, ValueError, OverflowError):
            raise PluginError(f"environment {name}.step returned the reward {show(reward, 40)}; expected a number "
                              "(within float range) or None") from None
        if not math.isfinite(reward):
            raise PluginError(f"environment {name}.step returned the reward {reward}; rewards must be finite")
    return StepResult(messages, reward, _done(done, name))


class EnvironmentFactory:
    """Makes one environment per trajectory for a run; holds what the environments share (a tool worker pool)."""

    def __init__(self, cls: type[Environment], kwargs: dict[str, Any] | None = None) -> None:
        self.cls, self.kwargs = cls, dict(kwargs or {})
        check_kwargs(cls, self.kwargs)
        self._counters: dict[str, list[float]] = {}

    @property
    def tool_schemas(self) -> list[dict[str, Any]]:
        return list(self.cls.tool_schemas)

    def new(self) -> Environment:
        return call_plugin(f"{self.cls.__name__}(**rollout.env.kwargs)", lambda: self.cls(**self.kwargs))

    def count(self, name: str, value: float) -> None:
        """Record one event's value under metric ``env/<name>``: a step logs the mean over its events for a name
        that ends in ``_rate`` or ``_mean``, else their sum."""
        self._counters.setdefault(name, []).append(float(value))

    def take_counters(self) -> dict[str, list[float]]:
        """The values recorded since the last call, by metric name; emptied."""
        out, self._counters = self._counters, {}
        return out

    def close(self) -> None:
        """Release what the environments share."""


def check_kwargs(cls: type, kwargs: dict[str, Any]) -> None:
    """ValueError naming ``rollout.env.kwargs`` unless ``cls(**kwargs)`` binds to the constructor's signature (a
    misspelt key, a missing required one): checked when the run starts, not at the first rollout after the model
    has loaded."""
    try:
        sig = inspect.signature(cls)
    except (TypeError, ValueError):  # no signature to read (a C type): the constructor will say
        return
    try:
        sig.bind(**kwargs)
    except TypeError as e:
        params = [n for n, p in sig.parameters.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        unknown = [k for k in kwargs if k not in params]
        hint = difflib.get_close_matches(unknown[0], params, n=1) if unknown and params else []
        raise ValueError(f"rollout.env.kwargs: {cls.__name__}({', '.join(params)}) {e}"
                         f"{f' (did you mean {hint[0]!r}?)' if hint else ''}") from None


ENVIRONMENTS: dict[str, Callable[..., EnvironmentFactory]] = {}
"""Environment name (the choices of rollout.env.name besides plugin files) -> ``builder(cfg: EnvConfig)`` returning
an :class:`EnvironmentFactory`."""


@section_check(EnvConfig)
def check_env_kwargs(env: EnvConfig, p: str) -> None:
    """``rollout.env.kwargs`` go to an environment's constructor: where there is none to take them (no environment,
    or the tools environment, set by its own keys) they would be ignored, so they are an error."""
    check(isinstance(env.kwargs, dict), f"{p}.kwargs", f"must be a mapping, got {env.kwargs!r}")
    check(not env.kwargs or env.name not in ("none", "tools"), f"{p}.kwargs",
          f"{sorted(env.kwargs)} would be ignored: " + ("the tools environment is set by rollout.env.tools, "
                                                       "timeout_s, num_workers and max_output_chars"
                                                       if env.name == "tools" else
                                                       f"no environment is set ({p}.name=none)"))


def register_environment(name: str) -> Callable:
    """Class decorator: make ``name`` a valid ``rollout.env.name`` for an :class:`Environment` subclass (built with
    ``rollout.env.kwargs``)."""

    def deco(cls: type[Environment]) -> type[Environment]:
        ENVIRONMENTS[name] = lambda cfg: EnvironmentFactory(cls, cfg.kwargs)
        return cls

    return deco


def _load_class(spec: str) -> type[Environment]:
    """``path/to/file.py:ClassName`` -> the class (the file is imported in this process, once per path)."""
    what = f"rollout.env.name={spec!r}"
    path, attr = plugins.plugin_path(spec, what=what, example="path/to/file.py:ClassName")
    module = plugins.import_plugin_file(path, what=what)
    cls = getattr(module, attr, None)
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        found = sorted(n for n, v in vars(module).items() if isinstance(v, type) and issubclass(v, Environment)
                       and v is not Environment)
        raise ValueError(f"{what}: {attr!r} is not a fastgrpo.environments.Environment subclass "
                         f"in {str(path)!r}; its environments: {found}")
    return cls


def build_environment(cfg: Any) -> EnvironmentFactory:
    """The factory for ``rollout.env`` (an EnvConfig): a registered name or a plugin class."""
    if plugins.is_plugin_spec(cfg.name):
        return EnvironmentFactory(_load_class(cfg.name), cfg.kwargs)
    if cfg.name not in ENVIRONMENTS:
        close = difflib.get_close_matches(cfg.name, list(ENVIRONMENTS), n=1)
        raise ValueError(f"rollout.env.name: unknown environment {cfg.name!r}"
                         f"{f' (did you mean {close[0]!r}?)' if close else ''}; known: {sorted(ENVIRONMENTS)} or "
                         "'path/to/file.py:ClassName'")
    return ENVIRONMENTS[cfg.name](cfg)
