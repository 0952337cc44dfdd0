"""The benchmark script runs end to end on tiny shapes (CPU) and writes its table and CSV."""

import csv

from benchmarks import bench_kernels


def test_bench_quick_writes_csv(tmp_path, capsys):
    out = tmp_path / "kernels.csv"
    rc = bench_kernels.main(["--quick", "--reps", "1", "--warmup", "0", "--out", str(out),
                             "--methods", "ours,naive,liger,floor"])
    assert rc == 0
    lines = out.read_text().splitlines()
    assert lines[0].startswith("# device:")
    rows = list(csv.DictReader(lines[1:]))
    assert len(rows) == len(bench_kernels.QUICK_SHAPES) * 4
    for row in rows:
        if row["method"] in ("ours", "naive", "floor"):
            assert float(row["ms"]) > 0, row
        else:  # liger: measured when installed, otherwise a note says why not
            assert row["ms"] or row["note"], row
    assert "| ours |" in capsys.readouterr().out


def test_bench_time_budget_lists_unstarted_shapes_as_skipped(tmp_path):
    out = tmp_path / "kernels.csv"
    assert bench_kernels.main(["--quick", "--budget-s", "0", "--methods", "ours,floor", "--out", str(out)]) == 0
    rows = list(csv.DictReader(out.read_text().splitlines()[1:]))
    assert len(rows) == len(bench_kernels.QUICK_SHAPES) * 2
    assert all(r["ms"] == "" and r["note"] == "skipped: time budget" for r in rows)


def test_kernel_accuracy_table_runs(capsys):
    from benchmarks import kernel_accuracy

    assert kernel_accuracy.main(["--n", "40", "--h", "16", "--v", "100", "--chunk-size", "16"]) == 0
    out = capsys.readouterr().out
    assert "| plain bf16 torch |" in out and "| torch |" in out
