"""Put the repository root (for ``benchmarks.harness``) and this folder (for ``_cases``) on ``sys.path``.

``fastgrpo.kernels`` itself needs nothing: the package is always installed (editable), which maps ``kernels/``.
"""

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
for path in (HERE.parents[1], HERE):  # also under --import-mode=importlib
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))
