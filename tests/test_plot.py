import json

import pytest

from fastgrpo.plot import PlotError, choose_panels, main, plot_run, smoothed


def test_plot_writes_a_png(tmp_path):
    with open(tmp_path / "metrics.jsonl", "w") as f:
        for s in range(1, 6):
            f.write(json.dumps({"step": s, "reward/mean": s / 10, "completion/len_mean": 10 + s}) + "\n")
    out = plot_run(tmp_path)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_missing_run_is_clear(tmp_path):
    with pytest.raises(PlotError, match="metrics.jsonl"):
        plot_run(tmp_path / "nope")


def _write(tmp_path, rows, tail=""):
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + tail)


def test_only_series_that_vary_are_drawn_and_eval_always(tmp_path):
    rows = [{"step": s, "reward/mean": s / 10, "policy/clip_high_frac": 0.0, "policy/clip_low_frac": 0.0,
             "policy/grad_norm": 1.0 + s, "policy/entropy": 2.0 - s / 100, "policy/kl_mean": 0.0,
             "reward/countdown/mean": s / 10, "eval/greedy_acc": 0.25} for s in range(1, 6)]
    panels = dict(choose_panels(rows))
    assert "clipped fraction" not in panels  # always 0: the demo's clip_high_frac panel
    assert panels["KL / entropy"] == ["policy/entropy"]  # the constant KL is left out, the entropy kept
    assert "reward per function" not in panels  # one reward function: the reward panel is its curve
    assert panels["held-out accuracy"] == ["eval/greedy_acc"]  # flat, but the result
    for r in rows:
        r["reward/format/mean"] = 1.0 - r["step"] / 10
    assert dict(choose_panels(rows))["reward per function"] == ["reward/countdown/mean", "reward/format/mean"]
    _write(tmp_path, rows)
    assert plot_run(tmp_path).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_smoothed_line_is_a_bias_corrected_moving_average():
    assert smoothed([4.0, 4.0, 4.0], span=5) == pytest.approx([4.0, 4.0, 4.0])  # no pull toward 0
    out = smoothed([0.0, 10.0], span=3)  # alpha 0.5: (0.5*10) / (1 - 0.25)
    assert out == pytest.approx([0.0, 5.0 / 0.75])
    noisy = [(-1.0) ** i for i in range(40)]
    assert max(abs(v) for v in smoothed(noisy, span=9)[10:]) < 0.25


def test_a_torn_last_line_is_skipped_and_a_broken_middle_line_named(tmp_path, capsys):
    rows = [{"step": s, "reward/mean": s / 10} for s in range(1, 4)]
    _write(tmp_path, rows, tail='{"step": 4, "reward/me')
    assert main([str(tmp_path)]) == 0
    assert "skipping the last line" in capsys.readouterr().err
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "reward/mean": 0.1}\n{"step": 2, "rew\n{"step": 3}\n')
    assert main([str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "metrics.jsonl:2 is not a metrics record" in err


def test_an_unwritable_run_folder_is_one_line_and_out_writes_elsewhere(tmp_path, monkeypatch, capsys):
    import fastgrpo.runtime.files as files_mod  # the atomic writer the plot uses

    _write(tmp_path, [{"step": s, "reward/mean": s / 10} for s in range(1, 4)])

    def refuse(src, dst):
        raise PermissionError(13, "Permission denied", str(dst))

    with monkeypatch.context() as m:  # root ignores a read-only mode, so the rename is refused instead
        m.setattr(files_mod.os, "replace", refuse)
        assert main([str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Permission denied" in err and "--out" in err
    assert not list(tmp_path.glob(".*tmp")) and not (tmp_path / "metrics.png").exists()
    assert main([str(tmp_path), "--out", str(tmp_path / "elsewhere.png")]) == 0
    assert (tmp_path / "elsewhere.png").read_bytes()[:4] == b"\x89PNG"


def test_accuracy_summary_compares_the_first_and_last_evaluation(tmp_path, capsys):
    from fastgrpo.plot import main

    rows = [{"step": 0, "eval/greedy_acc": 0.125, "eval/best_of_8": 0.4},
            {"step": 1, "reward/mean": 0.1},
            {"step": 50, "reward/mean": 0.3, "eval/greedy_acc": 0.25, "eval/best_of_8": 0.5},
            {"step": 100, "reward/mean": 0.4, "eval/greedy_acc": 0.3125, "eval/best_of_8": 0.55}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main([str(tmp_path)]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.endswith("held-out greedy accuracy 12.5% -> 31.2%, best-of-8 40.0% -> 55.0% (step 0 -> 100)")
