"""The import graph of fastgrpo (module-level and function-level imports alike) has no circle, and its folders
import one way, down a declared order (``LAYERS``).

A function-level import that only dodges a circle hides it: moving a function then breaks at run time rather than
at import. So the graph is read from the source (``ast``), every ``import`` statement wherever it stands, and any
strongly connected component of more than one module fails the test with the modules it contains. No circle is not
yet a direction: two folders could still import each other through different modules. So each folder (sub-package,
or top-level module) has a layer, and an import from one folder into another must point to a lower layer.

A ``'package.module:NAME'`` string (config's registry paths, loaded with importlib when a config is validated) is an
import too: it counts as an edge from the file that holds it, and the layers judge it like a statement. Config's
choice fields read tables of components above it; each such path is declared in ``CHOICE_TABLES`` with its reason.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# import name -> source folder (kernels/ installs as fastgrpo.kernels, see setup.py)
PACKAGES = {"fastgrpo": ROOT / "fastgrpo", "fastgrpo.kernels": ROOT / "kernels"}

LAYERS = (
    ("kernels", "__init__"),  # torch and triton only; the package's own __init__ imports nothing
    ("runtime",),  # errors, files, sinks, the plugin loader and worker sandbox: no other fastgrpo folder
    ("config",),  # at validation: the kernels' loss settings and backend check, the choice tables
    ("models", "rewards"),
    ("distributed", "rollout", "data"),
    ("update",),  # the optimizer update on packed rows, whatever the loss
    ("algorithms",),  # episodes (rollout -> rewards -> advantages), GRPO, PPO, SFT's loss, the registry
    ("environments", "integrations"),  # multi-turn rollouts build episodes; the TRL adapter reads the kernels
    ("trainers",),
    ("cli",),
    ("train", "sft", "plot"),  # entry points
)
"""fastgrpo's folders (sub-packages and top-level modules), lowest first: an import between two folders points to a
lower line. Folders on one line do not import each other."""

CHOICE_TABLES = {
    **dict.fromkeys((
        "fastgrpo.models.attention:ATTN_BACKENDS", "fastgrpo.data.templates:TEMPLATES",
        "fastgrpo.data.arithmetic:OPERATORS", "fastgrpo.data.sft:TRACES", "fastgrpo.rewards:REWARDS",
        "fastgrpo.environments:ENVIRONMENTS", "fastgrpo.environments:TOOLS", "fastgrpo.environments:TOOL_CALL_FORMATS",
        "fastgrpo.rollout:ENGINES", "fastgrpo.algorithms.registry:ALGORITHMS",
        "fastgrpo.algorithms.losses:SFT_NORMALIZATIONS"),
        "each name maps to its implementation (a function, a class, a backend), which lives in the component, and a "
        "name registered there at run time is a valid choice with no edit in config"),
    "fastgrpo.data.sft:SOLUTIONS": "the solutions a countdown trace can show: names that the trace builders of "
                                   "data/sft branch on, kept beside them",
}
"""The registry paths in config/ that point to a higher layer, each with why the table cannot move down. Config
reads these tables' names when a config is validated (never at import); importing a component also registers its
section checks (``fastgrpo.config.loader.section_check``), which is how config validates through them without
naming them. Any other upward path fails the layering test."""

_REGISTRY_PATH = re.compile(r"([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*):[A-Za-z_]\w*")


def _modules(packages: dict[str, Path]) -> dict[str, Path]:
    mods = {}
    for name, folder in packages.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join([name, *parts])] = path
    return mods


def _targets(module: str, is_package: bool, node: ast.Import | ast.ImportFrom, mods: dict[str, Path],
             roots: tuple[str, ...]) -> list[str]:
    """The project modules one import statement loads (``from pkg import sub`` loads pkg.sub when it is one)."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        if node.level:
            base = module.split(".")[: len(module.split(".")) - (0 if is_package else 1)]
            base = base[: len(base) - (node.level - 1)]
            source = ".".join([*base, *([node.module] if node.module else [])])
        else:
            source = node.module or ""
        names = [f"{source}.{a.name}" if f"{source}.{a.name}" in mods else source for a in node.names]
    out = []
    for name in names:
        if not name.startswith(roots):
            continue
        while name not in mods and "." in name:  # `import fastgrpo.x.attr` -> the module fastgrpo.x
            name = name.rpartition(".")[0]
        if name in mods and name != module:
            out.append(name)
    return out


def registry_paths(tree: ast.AST, mods: dict[str, Path]) -> list[tuple[str, str]]:
    """``(path, module)`` for each string constant of ``tree`` that is a whole ``'module:NAME'`` naming a project
    module (a registry path, loaded with importlib)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            match = _REGISTRY_PATH.fullmatch(node.value)
            if match and match.group(1) in mods:
                found.append((node.value, match.group(1)))
    return found


def import_graph(packages: dict[str, Path], declared: dict[str, str] | None = None) -> dict[str, set[str]]:
    """Module -> the project modules it imports anywhere in its source (top level or inside functions), and those its
    registry paths name, but for the paths in ``declared``."""
    mods = _modules(packages)
    roots = tuple(packages)
    graph = {}
    for module, path in mods.items():
        edges = set()
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                edges.update(_targets(module, path.name == "__init__.py", node, mods, roots))
        edges.update(target for text, target in registry_paths(tree, mods)
                     if target != module and text not in (declared or {}))
        graph[module] = edges
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_fastgrpo_imports_have_no_circle():
    graph = import_graph(PACKAGES, declared=CHOICE_TABLES)
    assert len(graph) > 50 and graph["fastgrpo.trainers.grpo"], "the graph was not read"
    assert circles(graph) == []


def test_config_reaches_down_only_but_for_its_declared_choice_tables():
    """The config package imports no other fastgrpo module at import time; at validation it imports the kernels
    (the loss settings, the backend check) and reads the runtime's metric sinks and the declared choice tables."""
    graph = import_graph(PACKAGES, declared=CHOICE_TABLES)
    below = {m for m in graph if m.startswith(("fastgrpo.config", "fastgrpo.kernels"))} | {"fastgrpo.runtime.sinks"}
    for module in (m for m in graph if m.startswith("fastgrpo.config")):
        assert graph[module] <= below, module


def test_the_declared_choice_tables_are_config_registry_paths_that_point_up():
    """Each declared path is in config's source, names a table that exists, and points to a higher layer (a path
    that points down needs no declaration); a statement import of its module stays judged."""
    mods = _modules(PACKAGES)
    found = {text: target for module, path in mods.items() if module.startswith("fastgrpo.config")
             for text, target in registry_paths(ast.parse(path.read_text()), mods)}
    layer = {name: i for i, names in enumerate(LAYERS) for name in names}
    assert set(CHOICE_TABLES) <= set(found), set(CHOICE_TABLES) - set(found)
    for text in CHOICE_TABLES:
        assert layer[folder_of(found[text])] > layer["config"], text
    upward = {t for t, target in found.items() if layer[folder_of(target)] > layer["config"]}
    assert upward == set(CHOICE_TABLES)


def test_a_planted_circle_is_found_also_through_a_function_level_import(tmp_path):
    pkg = tmp_path / "demo"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from demo.sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from ..c import g\n    return g\n")  # relative, in a function
    (pkg / "c.py").write_text("import demo.a\n")
    (pkg / "d.py").write_text("from demo import a\n")  # imports into the circle, not part of it
    graph = import_graph({"demo": pkg})
    assert graph["demo.sub.b"] == {"demo.c"}
    assert circles(graph) == [["demo.a", "demo.c", "demo.sub.b"]]
    (pkg / "c.py").write_text("")
    assert circles(import_graph({"demo": pkg})) == []


def folder_of(module: str, root: str = "fastgrpo", kernels: str | None = "fastgrpo.kernels") -> str:
    """The folder a module belongs to: its sub-package or top-level module under ``root``, ``kernels`` for the
    kernels' package, ``__init__`` for the root package itself."""
    if kernels and (module == kernels or module.startswith(kernels + ".")):
        return "kernels"
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def backward_imports(graph: dict[str, set[str]], layers: tuple[tuple[str, ...], ...], **folder) -> list[str]:
    """``'a -> b'`` for each import from a module into another folder on the same or a higher layer, and for each
    module whose folder has no layer."""
    layer = {name: i for i, names in enumerate(layers) for name in names}
    found = []
    for module, targets in sorted(graph.items()):
        src = folder_of(module, **folder)
        if src not in layer:
            found.append(f"{module}: its folder {src!r} has no layer in LAYERS")
            continue
        for target in sorted(targets):
            dst = folder_of(target, **folder)
            if dst != src and layer.get(dst, len(layers)) >= layer[src]:
                found.append(f"{module} -> {target} ({src} may not import {dst})")
    return found


def test_folders_import_down_the_declared_layers():
    graph = import_graph(PACKAGES, declared=CHOICE_TABLES)
    assert {folder_of(m) for m in graph} >= {"algorithms", "update", "trainers", "kernels", "config"}
    assert backward_imports(graph, LAYERS) == []


DEMO_LAYERS = (("__init__",), ("low",), ("high",))
DEMO = dict(root="demo", kernels=None)


def _demo_package(tmp_path: Path) -> Path:
    """A package ``demo`` with two folders, ``low`` under ``high`` in DEMO_LAYERS."""
    pkg = tmp_path / "demo"
    for sub in ("low", "high"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    return pkg


def test_a_planted_backward_import_between_folders_is_found(tmp_path):
    pkg = _demo_package(tmp_path)
    (pkg / "high" / "step.py").write_text("from demo.low import base\n")
    (pkg / "low" / "base.py").write_text("X = 1\n")
    layers, opts = DEMO_LAYERS, DEMO
    assert backward_imports(import_graph({"demo": pkg}), layers, **opts) == []
    # no circle: low/helper imports high/step, which imports low/base, a different module
    (pkg / "low" / "helper.py").write_text("def f():\n    from demo.high.step import base\n    return base\n")
    graph = import_graph({"demo": pkg})
    assert circles(graph) == []
    assert backward_imports(graph, layers, **opts) == ["demo.low.helper -> demo.high.step (low may not import high)"]
    (pkg / "side").mkdir()
    (pkg / "side" / "__init__.py").write_text("")
    assert "demo.side: its folder 'side' has no layer in LAYERS" in backward_imports(
        import_graph({"demo": pkg}), layers, **opts)


def test_a_planted_upward_registry_path_is_found(tmp_path):
    """A 'module:NAME' string is an import of module: in a lower folder pointing up it fails as a statement would,
    unless it is declared."""
    pkg = _demo_package(tmp_path)
    (pkg / "high" / "table.py").write_text("TABLE = {'a': 1}\n")
    (pkg / "low" / "fields.py").write_text(
        "def registry(source):\n    return {'registry': source}\n\n"
        "NAME = registry('demo.high.table:TABLE')\nDOC = 'see demo.high.table:TABLE for more'\n")
    layers, opts = DEMO_LAYERS, DEMO
    graph = import_graph({"demo": pkg})
    assert graph["demo.low.fields"] == {"demo.high.table"}  # the path; the sentence that mentions one is no edge
    assert backward_imports(graph, layers, **opts) == [
        "demo.low.fields -> demo.high.table (low may not import high)"]
    declared = {"demo.high.table:TABLE": "why"}
    assert backward_imports(import_graph({"demo": pkg}, declared=declared), layers, **opts) == []
    # a declaration covers the path only: an import statement of the same module is still judged
    (pkg / "low" / "fields.py").write_text("from demo.high.table import TABLE\nNAME = 'demo.high.table:TABLE'\n")
    assert backward_imports(import_graph({"demo": pkg}, declared=declared), layers, **opts) == [
        "demo.low.fields -> demo.high.table (low may not import high)"]
