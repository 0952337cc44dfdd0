"""Finding users' code by name: one loader for reward functions, tools and environments.

A config names user code in one of two ways:

- ``path/to/file.py:name``, a *plugin spec*: the file is imported once per absolute path, as a module of its own
  (``fastgrpo_plugin_<hash of the path>``), so two plugin files that are both called ``rewards.py`` do not clash, and
  a file holding a reward, a tool and an environment runs once however many of them a run loads;
- ``module:qualname``, how a worker process finds a function registered at run time (:func:`importable_name`).

Every error is a ValueError of one line that starts with ``what`` (the caller's name for the entry, e.g.
``reward 'r.py:f'`` or ``rollout.env.name='env.py:Game'``) and says what to write instead. This module imports no
torch: sandbox workers import it.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

__all__ = ["PLUGIN_FAILURES", "importable_name", "import_plugin_file", "is_plugin_spec", "load_plugin",
           "plugin_path", "resolve"]

PLUGIN_FAILURES: tuple[type[BaseException], ...] = (Exception, SystemExit)
"""What importing a plugin in the trainer process may raise and still become an error message: a plugin file never
ends the run, not even with ``sys.exit``. Sandbox workers pass ``(BaseException,)``: a KeyboardInterrupt there is the
plugin's too."""


def is_plugin_spec(name: str) -> bool:
    """``path/to/file.py:name`` (as opposed to a registry name or ``module:qualname``)."""
    return ":" in name and name.rpartition(":")[0].endswith(".py")


def plugin_path(spec: str, *, what: str, example: str = "path/to/file.py:function_name") -> tuple[Path, str]:
    """(absolute file, attribute name) of a plugin spec, checked without importing it. ``rpartition``, so that a
    Windows drive letter's colon survives."""
    path_str, _, attr = spec.rpartition(":")
    path = Path(path_str).expanduser().resolve()
    if not attr:
        raise ValueError(f"{what}: write {example!r}")
    if not path.is_file():
        raise ValueError(f"{what}: plugin file {str(path)!r} does not exist")
    return path, attr


def import_plugin_file(path: Path, *, what: str, catch: tuple[type[BaseException], ...] = PLUGIN_FAILURES
                       ) -> ModuleType:
    """The module of plugin file ``path`` (absolute), executed the first time only. An import that raises one of
    ``catch`` leaves no half-made module behind (the next load tries again) and becomes a ValueError."""
    mod_name = "fastgrpo_plugin_" + hashlib.sha1(str(path).encode()).hexdigest()[:12]
    module = sys.modules.get(mod_name)
    if module is not None:
        return module
    loader_spec = importlib.util.spec_from_file_location(mod_name, path)
    if loader_spec is None or loader_spec.loader is None:
        raise ValueError(f"{what}: cannot import {str(path)!r} as a Python module")
    module = importlib.util.module_from_spec(loader_spec)
    sys.modules[mod_name] = module
    try:
        loader_spec.loader.exec_module(module)
    except catch as e:
        del sys.modules[mod_name]
        raise ValueError(f"{what}: importing {str(path)!r} failed: {e!r}") from None
    return module


def load_plugin(spec: str, *, what: str, catch: tuple[type[BaseException], ...] = PLUGIN_FAILURES) -> Any:
    """The object a plugin spec names; a missing name is a ValueError listing the file's public callables."""
    path, attr = plugin_path(spec, what=what)
    module = import_plugin_file(path, what=what, catch=catch)
    if not hasattr(module, attr):
        found = sorted(n for n, v in vars(module).items() if not n.startswith("_") and callable(v))
        raise ValueError(f"{what}: {str(path)!r} defines no {attr!r}; its callables: {found}")
    return getattr(module, attr)


def importable_name(fn: Any) -> str | None:
    """``module:qualname`` by which another process can import ``fn``; None for a lambda, a closure or a
    ``__main__`` function (no other process can find those)."""
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if not module or module == "__main__" or not qualname or "<" in qualname:
        return None
    return f"{module}:{qualname}"


def resolve(spec: str, *, what: str, catch: tuple[type[BaseException], ...] = PLUGIN_FAILURES) -> Any:
    """The object a plugin spec or a ``module:qualname`` (:func:`importable_name`) names."""
    if is_plugin_spec(spec):
        return load_plugin(spec, what=what, catch=catch)
    module_name, _, qualname = spec.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except catch as e:
        raise ValueError(f"{what}: cannot import it: {e!r}") from None
    return obj
