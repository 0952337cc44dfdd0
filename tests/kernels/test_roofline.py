"""benchmarks/roofline.py, the speed model: its arithmetic on hand-checkable cases, and the side-by-side with a
bench_kernels.py CSV that run_gpu.sh prints (the model is a prediction; these tests check that it computes what its
docstring says, not that it is right)."""

import json
from pathlib import Path

import pytest

pytest.importorskip("triton")
roofline = pytest.importorskip("benchmarks.roofline")

CTAS = roofline.ctas_per_sm(json.loads((Path(roofline.__file__).parent / "hopper_sm90.json").read_text())["reports"])
H100 = roofline.DEVICES["h100"]
A = roofline.Assumptions()


def test_floor_is_three_compute_bound_products():
    n, h = 16384, 2048
    expected = 3 * 2.0 * n * roofline.V * h / (H100.flops * A.cublas_mma) + 3 * A.launch_s
    assert roofline.floor_path(n, h).seconds(H100, A) == pytest.approx(expected, rel=1e-9)


def test_dweight_launch_order_reads_dx_once_instead_of_once_per_h_tile():
    n, h = 16384, 3584
    after = [x for x in roofline.triton_path(n, h, H100, A, CTAS).launches if x.kernel == "_dweight_kernel"]
    before = [x for x in roofline.triton_path(n, h, H100, A, CTAS, before=True).launches
              if x.kernel == "_dweight_kernel"]
    dx_after = sum(x.bytes for x in after)
    dx_before = sum(x.bytes for x in before)
    assert dx_before > 20 * dx_after  # the naive schedule re-streams dx over 28 H tiles
    assert sum(x.seconds(H100, A) for x in after) < 0.7 * sum(x.seconds(H100, A) for x in before)


def test_wave_efficiency_and_split_choice_follow_the_launcher():
    assert roofline.wave_eff(264, 132) == 1.0 and roofline.wave_eff(133, 132) == pytest.approx(133 / 264)
    fwd = next(x for x in roofline.triton_path(4096, 2048, H100, A, CTAS).launches if x.kernel == "_fwd_kernel")
    assert fwd.wave_eff >= 0.95  # fwd_splits, the launcher's own choice, fills the last wave
    old = next(x for x in roofline.triton_path(4096, 2048, H100, A, CTAS, before=True).launches
               if x.kernel == "_fwd_kernel")
    assert old.wave_eff == pytest.approx(288 / 396)  # the naive schedule: 3 waves at 73%


def test_measured_csv_is_printed_next_to_the_model(tmp_path):
    csv_path = tmp_path / "bench_kernels.csv"
    csv_path.write_text(
        "# device: NVIDIA H200; torch 2.11\n"
        "label,n,h,v,method,ms,x_floor,peak_mb,over_grads_mb,note\n"
        "qwen2.5 H=2048,4096,2048,151936,floor,10.00,1.00,,,\n"
        "qwen2.5 H=2048,4096,2048,151936,ours,11.00,1.10,,,\n"
        "qwen2.5 H=2048,4096,2048,151936,naive,50.00,5.00,,,\n"
        "qwen2.5 H=1536,4096,1536,151936,ours_recompute,,,,,skipped: time budget\n")
    text = roofline.compare_measured(csv_path, A, CTAS)
    assert "H200" in text.splitlines()[0]
    model_floor = 1e3 * roofline.floor_path(4096, 2048).seconds(roofline.DEVICES["h200"], A)
    assert f"| 4096 | 2048 | floor | {model_floor:.2f} | 10.00 | {10 / model_floor:.2f} |" in text
    assert "| cublas |" in text and "naive" not in text and "1536" not in text  # unmodelled or unmeasured rows
