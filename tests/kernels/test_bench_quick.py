"""The benchmark script runs end to end on tiny shapes (CPU) and writes its table and CSV."""

import csv

import pytest

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


def test_trl_row_is_trls_own_fused_head_and_matches_the_reference():
    """The `trl` row runs TRL's add_fused_lm_head (as its GRPOTrainer calls it): same loss and gradients as full
    logits in float32, with some tokens weighted 0 (TRL's label -100)."""
    import torch

    pytest.importorskip("trl")
    from benchmarks.harness import Shape, make_inputs
    from fastgrpo.kernels import reference_linear_grpo_loss

    inp = make_inputs(Shape(n=3 * 40, h=24, v=301, label="t"), dtype=torch.float32, seed=3, zero_weight_frac=0.25)
    inp["hidden"].requires_grad_(True)
    loss_fn, (hidden, weight) = bench_kernels.trl_loss(dict(inp) | {"hidden": inp["hidden"]})
    loss = loss_fn()
    g_hidden, g_weight = torch.autograd.grad(loss, (hidden, weight))
    ref, _ = reference_linear_grpo_loss(inp["hidden"], inp["weight"], inp["targets"], inp["advantages"],
                                        inp["token_weights"])
    r_hidden, r_weight = torch.autograd.grad(ref, (inp["hidden"], inp["weight"]))
    assert (inp["token_weights"] == 0).any()
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(g_weight, r_weight, rtol=1e-4, atol=1e-6)
    # TRL's hidden has one extra (unscored) position per sequence: no gradient there
    torch.testing.assert_close(g_hidden[:, :-1].reshape(-1, 24), r_hidden, rtol=1e-4, atol=1e-6)
    assert g_hidden[:, -1].abs().max() == 0


def test_trl_row_says_not_run_without_trl(tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "trl", None)  # import trl -> ImportError
    monkeypatch.setitem(sys.modules, "trl.trainer.utils", None)
    out = tmp_path / "kernels.csv"
    assert bench_kernels.main(["--quick", "--reps", "1", "--warmup", "0", "--methods", "floor,trl", "--out",
                               str(out)]) == 0
    rows = [r for r in csv.DictReader(out.read_text().splitlines()[1:]) if r["method"] == "trl"]
    assert rows and all(r["ms"] == "" and r["note"].startswith("not run: trl not installed") for r in rows)
