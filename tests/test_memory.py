"""Host memory settings: freed tensors leave the process (fastgrpo.runtime.memory, the run's malloc_mmap_threshold), and
the CPU's micro-batch budget (fastgrpo.update.step.microbatch_tokens)."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from fastgrpo.config import ConfigError, GRPOConfig, load_config
from fastgrpo.runtime.memory import _glibc, set_malloc_mmap_threshold

glibc_only = pytest.mark.skipif(_glibc() is None, reason="glibc's malloc (Linux) only")

# In a fresh process: free one 8 MiB tensor (glibc then raises its mmap threshold to 8 MiB), optionally set the
# threshold, then allocate and free 2 MiB tensors; report malloc's mapped bytes while one lives and the heap's
# free bytes after they are gone.
_PROBE = textwrap.dedent("""
    import ctypes, json, sys
    import torch
    from fastgrpo.runtime.memory import set_malloc_mmap_threshold

    class Info(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                   "fsmblks", "uordblks", "fordblks", "keepcost")]
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = Info
    first = torch.ones(2 << 20)  # 8 MiB, mapped; freed: the dynamic threshold rises to 8 MiB
    del first
    applied = set_malloc_mmap_threshold(int(sys.argv[1]))
    before = libc.mallinfo2()
    ts = [torch.ones(1 << 19) for _ in range(8)]  # 8 x 2 MiB
    live = libc.mallinfo2()
    del ts
    after = libc.mallinfo2()
    print(json.dumps({"applied": applied, "mapped_live": live.hblkhd - before.hblkhd,
                      "mapped_after": after.hblkhd - before.hblkhd,
                      "heap_free_after": after.fordblks - before.fordblks}))
""")


def _probe(threshold: int, env: dict | None = None) -> dict:
    out = subprocess.run([sys.executable, "-c", _PROBE, str(threshold)], capture_output=True, text=True, check=True,
                         env={**os.environ, **(env or {})}, timeout=120)
    return json.loads(out.stdout.strip().splitlines()[-1])


@glibc_only
def test_threshold_returns_freed_tensors_to_the_system():
    # Without it: the 2 MiB tensors come from the heap and 16 MiB stay there, free but resident, after they die.
    kept = _probe(0)
    assert kept["applied"] is False
    assert kept["mapped_live"] < (1 << 20) and kept["heap_free_after"] >= 14 << 20, kept
    # With a 1 MiB threshold: each tensor is its own mapping, unmapped when it is freed; nothing stays in the heap.
    freed = _probe(1 << 20)
    assert freed["applied"] is True
    assert freed["mapped_live"] >= 16 << 20 and freed["mapped_after"] == 0, freed
    assert freed["heap_free_after"] < 1 << 20, freed


@glibc_only
def test_the_environment_variable_wins():
    res = _probe(1 << 20, env={"MALLOC_MMAP_THRESHOLD_": str(64 << 20)})  # glibc refuses 64 MiB: stays dynamic
    assert res["applied"] is False and res["mapped_live"] < (1 << 20), res


def test_bad_thresholds():
    assert set_malloc_mmap_threshold(0) is False
    with pytest.raises(ValueError, match="malloc_mmap_threshold"):
        set_malloc_mmap_threshold(64 << 20)
    with pytest.raises(ConfigError, match="malloc_mmap_threshold"):
        load_config(None, ["malloc_mmap_threshold=-1", "device=cpu", "model.name_or_path=tiny"])


def test_the_run_sets_the_configured_threshold(tmp_path, monkeypatch):
    """The run's setting reaches malloc before the model loads (GRPO and SFT share TrainingLoop._init_run)."""
    from fastgrpo.trainers import loop

    seen = []
    monkeypatch.setattr(loop, "set_malloc_mmap_threshold", seen.append)
    cfg = load_config(None, ["device=cpu", "model.name_or_path=tiny", f"output_dir={tmp_path}",
                             "malloc_mmap_threshold=2097152"])
    loop.TrainingLoop()._init_run(cfg)
    assert seen == [2 << 20]
    assert load_config(None, ["device=cpu"]).malloc_mmap_threshold == 1 << 20  # on by default


def test_microbatch_budget_defaults_per_device():
    from fastgrpo.update.step import microbatch_tokens

    assert GRPOConfig().max_tokens_per_microbatch is None
    assert microbatch_tokens(None, "cpu") == 1024 and microbatch_tokens(None, torch.device("cuda", 0)) == 4096
    assert microbatch_tokens(300, "cpu") == 300  # a set budget stands on every device
    assert load_config(None, ["grpo.max_tokens_per_microbatch=512"]).grpo.max_tokens_per_microbatch == 512
    with pytest.raises(ConfigError, match="grpo.max_tokens_per_microbatch"):
        load_config(None, ["grpo.max_tokens_per_microbatch=0"])


def test_the_cpu_update_packs_under_the_default_budget():
    """grpo_update with the default budget on a CPU: 24 sequences of 100 tokens (2,400) in micro-batches of at most
    1,024 tokens, every sequence in exactly one of them."""
    from dist_helpers import tiny_qwen2

    from fastgrpo.config import ParallelConfig, RolloutConfig
    from fastgrpo.runtime.metrics import StepMetrics
    from fastgrpo.distributed.parallelize import parallelize_model
    from fastgrpo.algorithms.grpo import GRPOBatch, grpo_update

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 100, (90,), generator=g).tolist() for _ in range(24)]
    completions = [torch.randint(0, 100, (10,), generator=g).tolist() for _ in range(24)]
    model = parallelize_model(tiny_qwen2(), ParallelConfig(), device="cpu", world_size=1)
    mbs = grpo_update(model, GRPOBatch(prompt_ids=prompts, completion_ids=completions, advantages=torch.randn(24)),
                      grpo=GRPOConfig(num_generations=8), rollout=RolloutConfig(max_completion_length=10),
                      optimizer=torch.optim.SGD(model.parameters(), lr=0.1), max_grad_norm=0.0,
                      metrics=StepMetrics(), device="cpu")
    assert len(mbs) == 3 and all(mb.input_ids.shape[1] <= 1024 for mb in mbs)
    assert sorted(i for mb in mbs for i in mb.seq_indices) == list(range(24))
