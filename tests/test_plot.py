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
