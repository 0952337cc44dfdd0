"""kernels/ installs as fastgrpo.kernels, in the editable install and in a built wheel."""

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_kernels_import_as_fastgrpo_kernels_from_the_source_tree():
    import fastgrpo.kernels as k

    assert Path(k.__file__).resolve().parent == ROOT / "kernels"
    assert callable(k.linear_logprobs) and callable(k.linear_grpo_loss)


def test_built_wheel_contains_fastgrpo_kernels(tmp_path):
    # build from a copy of the tracked sources: a stale build/ folder in the checkout could hide a missing file
    src = tmp_path / "src"
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout.split()
    for f in files:
        if (ROOT / f).is_file():
            (src / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, src / f)
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           "-w", str(tmp_path), str(src)], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    wheel = next(tmp_path.glob("fastgrpo-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    for f in ("fastgrpo/kernels/__init__.py", "fastgrpo/kernels/reference.py", "fastgrpo/trainers/grpo.py",
              "fastgrpo/rollout/base.py", "fastgrpo/data/countdown.py", "fastgrpo/rewards/countdown.py"):
        assert f in names, f
    assert not any(n.startswith("kernels/") for n in names)


def test_kernels_do_not_import_fastgrpo_transformers_or_vllm():
    code = ("import sys, importlib.util as u; "
            f"spec = u.spec_from_file_location('fk', r'{ROOT / 'kernels' / '__init__.py'}', "
            f"submodule_search_locations=[r'{ROOT / 'kernels'}']); "
            "m = u.module_from_spec(spec); sys.modules['fk'] = m; spec.loader.exec_module(m); "
            "bad = [n for n in ('transformers', 'vllm', 'fastgrpo') if n in sys.modules]; print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
