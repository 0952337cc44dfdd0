"""Suite-wide settings: one intra-op thread per process.

The models here are tiny, so torch's thread pool costs more in spin-waiting than it gains, and test files that
launch 2-process jobs would oversubscribe the 2 cores of CI (seen: 10 ms vs 1.6 ms for the same small matmul).
Subprocesses inherit OMP_NUM_THREADS.
"""

import os
import sys
from pathlib import Path

# The repository root, for `benchmarks.*` (tests share the benchmarks' setup). fastgrpo and fastgrpo.kernels
# need nothing: the package is always installed (editable).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

torch.set_num_threads(1)

# Hypothesis explores new examples on every local run; CI (CI=true) replays a fixed sequence so that a run's
# verdict does not depend on luck, and has no per-example deadline on a loaded 2-core machine.
from hypothesis import settings  # noqa: E402

settings.register_profile("ci", derandomize=True, deadline=None)
if os.environ.get("CI"):
    settings.load_profile("ci")


# Same policy for tests that draw fresh random inputs (prompts, tensors): a new seed on every local run, a fixed
# one per test under CI. The seed is printed with a failure so that the case can be replayed.
import random  # noqa: E402
import zlib  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture
def rng(request) -> random.Random:
    if os.environ.get("CI"):
        seed = zlib.crc32(request.node.nodeid.encode())
    else:
        seed = random.SystemRandom().randrange(1 << 32)
    request.node.user_properties.append(("rng_seed", seed))
    print(f"[rng] {request.node.nodeid}: seed {seed}")  # shown in the captured output of a failure
    return random.Random(seed)
