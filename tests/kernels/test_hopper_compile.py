"""Ahead-of-time compile of the Triton kernels for sm_90 (no GPU needed): no register spills, and every
``tl.dot`` lowered to Hopper warpgroup MMA. Skips cleanly when Triton's NVIDIA toolchain is unavailable."""

import importlib.util

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")


@pytest.fixture(scope="module")
def reports():
    from benchmarks import check_hopper

    if check_hopper.cuobjdump_path() is None:
        pytest.skip("cuobjdump not available")
    try:
        return check_hopper.run(bf16_only=True)
    except Exception as exc:  # ptxas missing or no CUDA backend in this triton build
        if "ptxas" in str(exc).lower() or "backend" in str(exc).lower():
            pytest.skip(f"sm_90 toolchain unavailable: {exc}")
        raise


def test_hopper_kernels_do_not_spill(reports):
    spilled = [(r.kernel, r.variant, r.regs, r.local_bytes, r.spill_instrs) for r in reports if r.spills]
    assert not spilled, spilled


DOT_KERNELS = {"_fwd_kernel", "_dlogits_kernel", "_dhidden_kernel", "_dweight_kernel"}
ROW_KERNELS = {"_rowstats_kernel", "_softmax_grad_kernel", "_scale_kernel"}  # the "cublas" path's: no dot


def test_hopper_dots_use_wgmma(reports):
    assert {r.kernel for r in reports} == DOT_KERNELS | ROW_KERNELS
    dots = [r for r in reports if r.kernel in DOT_KERNELS]
    assert all(r.hgmma > 0 for r in dots), [(r.kernel, r.hgmma) for r in dots]
