import json

import pytest

from fastgrpo.plot import plot_run


def test_plot_writes_a_png(tmp_path):
    with open(tmp_path / "metrics.jsonl", "w") as f:
        for s in range(1, 6):
            f.write(json.dumps({"step": s, "reward/mean": s / 10, "completion/len_mean": 10 + s}) + "\n")
    out = plot_run(tmp_path)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_missing_run_is_clear(tmp_path):
    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        plot_run(tmp_path / "nope")


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
