"""Put this folder on ``sys.path`` for ``_cases`` (also under --import-mode=importlib); the repository root (for
``benchmarks.harness``) is added by ``tests/conftest.py``."""

import sys
from pathlib import Path

HERE = str(Path(__file__).resolve().parent)
if HERE not in sys.path:
    sys.path.insert(0, HERE)
