"""benchmarks/mem_profile.py wraps the phases of fastgrpo's step by name: a renamed function would make it fail or,
worse, leave a phase unmeasured. One short run of the toy config in a child process (the wrappers patch modules)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_phase_of_a_step_is_measured(tmp_path):
    out = tmp_path / "mem.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "mem_profile.py"), "--config",
                           str(ROOT / "configs" / "tiny-toy.yaml"), "--json", str(out), "max_steps=2",
                           "eval.every=-1", f"output_dir={tmp_path / 'run'}", "log.progress=false"],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    phases = {r["phase"] for r in result["rows"] if r["step"] == 2}
    assert {"rollout", "trunk forward", "head (forward)", "backward", "grad clip", "optimizer step"} <= phases
    assert result["vm_hwm"] >= max(r["rss_max"] for r in result["rows"]) > 0
