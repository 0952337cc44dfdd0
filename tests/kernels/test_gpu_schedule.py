"""CUDA-only checks of the Triton launch schedule (skipped without a GPU): the device-side target check on every path (no
host sync when the ids are fine; a bad id stops the process with the check's message), the occupancy the
launcher reads from the compiled kernel, and the Triton path's numerics under its real schedule (splits, split-K,
several chunks) at a bench-like vocabulary."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from _cases import assert_bf16_loss_error_at_most_twice_plain

from benchmarks.harness import Shape, make_inputs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
REPO = Path(__file__).resolve().parents[2]
PATHS = ("torch", "triton", "cublas")


def test_target_check_does_not_sync_the_host():
    from fastgrpo.kernels._targets import check_targets

    targets = torch.randint(0, 1000, (4096,), device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        check_targets(targets, 1000)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()  # the ids were fine: no assert


@pytest.mark.parametrize("backend", PATHS)
def test_bad_target_stops_with_the_checks_message_on_every_path(backend):
    # A device-side assert poisons the CUDA context, so each case runs in its own process.
    code = f"""
import torch
from fastgrpo.kernels import linear_grpo_loss
n, h, v = 64, 32, 1000
hidden = torch.randn(n, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
weight = torch.randn(v, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
targets = torch.randint(0, v, (n,), device="cuda")
targets[7] = -100
loss, _ = linear_grpo_loss(hidden, weight, targets, torch.randn(n, device="cuda"), torch.ones(n, device="cuda"),
                           backend="{backend}")
loss.backward()
torch.cuda.synchronize()
print("NO ERROR")
"""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "NO ERROR" not in out, out[-3000:]
    assert "targets must lie in [0, V)" in out or "device-side assert" in out, out[-3000:]


def test_launcher_reads_occupancy_from_the_compiled_kernel():
    from fastgrpo.kernels import _schedule, _triton

    inp = make_inputs(Shape(n=256, h=256, v=4096), dtype=torch.bfloat16, device="cuda", seed=1)
    _triton.forward(inp["hidden"].detach(), inp["weight"].detach(), inp["targets"], active=None, inv_temp=1.0,
                    with_entropy=False, chunk_size=None)
    fwd = [v for k, v in _schedule._SLOTS.items() if k[0] == "_fwd_kernel"]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert fwd and all(v % sms == 0 and 1 <= v // sms <= 4 for v in fwd), (_schedule._SLOTS, sms)


@pytest.mark.parametrize("backend", ["triton", "cublas"])
def test_bf16_loss_under_the_real_schedule(backend):
    # V large enough for many splits and split-K, chunk_size small enough for several chunks (all dW modes); the
    # project's bf16 criterion: error against float64 at most 2x that of plain bf16 torch.
    assert_bf16_loss_error_at_most_twice_plain(Shape(n=2048, h=256, v=32000), device="cuda", backend=backend,
                                               chunk_size=512, seed=2)
