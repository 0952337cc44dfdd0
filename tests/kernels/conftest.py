"""Make ``import fastgrpo.kernels`` (and ``benchmarks.harness``) work from the source tree before install.

setup.py maps the top-level ``kernels/`` folder to ``fastgrpo.kernels``; until the package is installed we load
that folder under the same name. Guarded, so an installed package (or the lead's own shim) wins.
"""

import importlib.util
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
for path in (REPO, HERE):  # benchmarks.harness; _cases.py (also under --import-mode=importlib)
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

try:
    import fastgrpo.kernels  # noqa: F401
except ImportError:
    spec = importlib.util.spec_from_file_location(
        "fastgrpo.kernels", REPO / "kernels" / "__init__.py", submodule_search_locations=[str(REPO / "kernels")]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["fastgrpo.kernels"] = module
    spec.loader.exec_module(module)
    import fastgrpo

    fastgrpo.kernels = module
