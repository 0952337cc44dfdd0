"""Ahead-of-time compile of the Triton kernels for sm_90 (no GPU needed): no register spills, every ``tl.dot``
lowered to Hopper warpgroup MMA, the target check's device assert compiled in, and the occupancy recorded for
benchmarks/roofline.py equal to what the compile gives. Skips cleanly when Triton's NVIDIA toolchain is
unavailable. The occupancy comparison runs only under the triton version that made the record."""

import importlib.util
import json
from pathlib import Path

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


def test_hopper_dots_use_wgmma_and_the_target_check_asserts(reports):
    from benchmarks.check_hopper import CHECK_KERNELS, DOT_KERNELS, ROW_KERNELS, problems_of

    assert {r.kernel for r in reports} == set(DOT_KERNELS + ROW_KERNELS + CHECK_KERNELS)
    assert all(r.hgmma > 0 and r.hmma == 0 for r in reports if r.kernel in DOT_KERNELS)
    assert all(r.asserts > 0 for r in reports if r.kernel in CHECK_KERNELS)
    assert problems_of(reports) == []


def test_roofline_occupancy_record_matches_the_compile(reports):
    # benchmarks/hopper_sm90.json lets run_gpu.sh print the model without compiling; it must not drift from the
    # kernels (regenerate: python benchmarks/check_hopper.py --bf16-only --json benchmarks/hopper_sm90.json).
    from benchmarks import roofline
    from benchmarks.check_hopper import asdict

    import triton

    recorded = json.loads((Path(roofline.__file__).parent / "hopper_sm90.json").read_text())
    if recorded["triton"] != triton.__version__:  # another compiler may allocate registers / smem differently
        pytest.skip(f"benchmarks/hopper_sm90.json was compiled with triton {recorded['triton']}, this is triton "
                    f"{triton.__version__}: occupancies are only comparable within one triton version")
    assert roofline.ctas_per_sm(recorded["reports"]) == roofline.ctas_per_sm([asdict(r) for r in reports])
