"""benchmarks/bench_update_variants.py sets up and trains every variant a CPU runs (the GPU call must not fail on
set-up): its smoke mode on the tiny model, eager variants only (the compiled one is tests/test_compile_blocks.py)."""

import json

from benchmarks.bench_update_variants import main


def test_the_update_variants_benchmark_runs_and_writes_its_table(tmp_path):
    out = tmp_path / "variants"
    assert main(["--smoke", "--variants", "autocast,bf16-masters", "--out", str(out)]) == 0
    rows = json.loads(out.with_suffix(".json").read_text())
    assert [(r["work"], r["variant"], r["error"]) for r in rows] == [("tiny", "autocast", ""),
                                                                     ("tiny", "bf16-masters", "")]
    assert all(r["update_s"] > 0 and r["graph_breaks"] == 0 for r in rows)
    assert "| tiny | bf16-masters |" in out.with_suffix(".md").read_text()
