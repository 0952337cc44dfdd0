"""The package installs as users install it: a wheel built from a clean copy of the tracked sources, installed
alone into a scratch folder, imports every module of the source tree from outside the repo and trains two GRPO
steps; kernels/ installs as fastgrpo.kernels. (The editable install that `make` uses hides a package that a
hand-written list leaves out: that once broke `import fastgrpo.trainer` from a wheel.)"""

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# import name -> source folder, as setup.py maps them
SOURCES = {"fastgrpo": ROOT / "fastgrpo", "fastgrpo.kernels": ROOT / "kernels"}


def source_modules() -> list[str]:
    """Every module the source tree holds, by import name (what an installed wheel must provide)."""
    names = []
    for pkg, folder in SOURCES.items():
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            names.append(".".join([pkg, *parts]))
    return names


# Run in the scratch install, from a folder outside the repo: every module must come from the scratch folder.
_IMPORT_ALL = """
import importlib, sys
scratch, names = sys.argv[1], sys.argv[2:]
# an editable install of the checkout (as `make` makes) would otherwise supply what the wheel lacks
editable = lambda f: "__editable__" in (getattr(f, "__module__", "") or "")
sys.meta_path[:] = [f for f in sys.meta_path if not editable(f)]
sys.path_hooks[:] = [h for h in sys.path_hooks if not editable(h)]
sys.path_importer_cache.clear()
bad = []
for n in names:
    try:
        m = importlib.import_module(n)
        if not m.__file__.startswith(scratch):
            bad.append(f"{n}: imported from {m.__file__}, not the wheel")
    except Exception as e:  # a module left out of the wheel, or one that needs the source tree
        bad.append(f"{n}: {type(e).__name__}: {e}")
print("\\n".join(bad) or "ok")
"""


def build_wheel(out: Path) -> Path:
    """A wheel of the tracked (and untracked, not ignored) files, built from a copy: a stale build/ folder in the
    checkout could hide a missing file."""
    src = out / "src"
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout.split()
    for f in files:
        if (ROOT / f).is_file():
            (src / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, src / f)
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           "-w", str(out), str(src)], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return next(out.glob("fastgrpo-*.whl"))


def install_alone(wheel: Path, scratch: Path) -> None:
    """The wheel and nothing else into ``scratch`` (its dependencies come from this environment)."""
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-compile", "-q",
                           "--target", str(scratch), str(wheel)], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]


def scratch_env(scratch: Path) -> dict:
    return {**os.environ, "PYTHONPATH": str(scratch), "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}


def import_all(scratch: Path, cwd: Path) -> str:
    """'ok', or one line per module of the source tree that the scratch install cannot import."""
    proc = subprocess.run([sys.executable, "-c", _IMPORT_ALL, str(scratch), *source_modules()], cwd=cwd,
                          env=scratch_env(scratch), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip()


def without_package(wheel: Path, package_dir: str, out: Path) -> Path:
    """A copy of ``wheel`` that leaves out one package folder (what a hand-written package list did)."""
    planted = out / wheel.name
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(planted, "w") as dst:
        for item in src.infolist():
            if not item.filename.startswith(package_dir + "/"):
                dst.writestr(item, src.read(item.filename))
    return planted


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    return build_wheel(tmp_path_factory.mktemp("wheel"))


def test_the_wheel_installed_alone_imports_every_module_and_trains_two_steps(wheel, tmp_path):
    scratch, outside = tmp_path / "site", tmp_path / "elsewhere"
    outside.mkdir()
    install_alone(wheel, scratch)
    assert import_all(scratch, outside) == "ok"
    # two GRPO steps through the console entry point's module, with a config copied out of the repo
    shutil.copy2(ROOT / "configs" / "tiny-toy.yaml", outside / "toy.yaml")
    proc = subprocess.run([sys.executable, "-m", "fastgrpo.train", "--config", "toy.yaml", "max_steps=2",
                           "grpo.prompts_per_step=2", "grpo.num_generations=2", "eval.every=0", "output_dir=runs"],
                          cwd=outside, env=scratch_env(scratch), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    steps = (outside / "runs" / "tiny-toy" / "metrics.jsonl").read_text().splitlines()
    assert len([s for s in steps if '"reward/mean"' in s]) == 2


def test_a_wheel_missing_a_package_fails_the_import_check(wheel, tmp_path):
    planted = without_package(wheel, "fastgrpo/environments", tmp_path)
    install_alone(planted, tmp_path / "site")
    (tmp_path / "elsewhere").mkdir()
    failures = import_all(tmp_path / "site", tmp_path / "elsewhere")
    assert "fastgrpo.environments: ModuleNotFoundError" in failures, failures
    assert "fastgrpo.trainers.grpo: ModuleNotFoundError" in failures, failures  # and what imports it


def test_kernels_import_as_fastgrpo_kernels_from_the_source_tree():
    import fastgrpo.kernels as k

    assert Path(k.__file__).resolve().parent == ROOT / "kernels"
    assert callable(k.linear_logprobs) and callable(k.linear_grpo_loss)


def test_the_wheel_holds_kernels_as_fastgrpo_kernels_and_no_top_level_kernels(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "fastgrpo/kernels/__init__.py" in names and "fastgrpo/kernels/reference.py" in names
    assert not any(n.startswith(("kernels/", "tests/", "benchmarks/")) for n in names)


def test_kernels_do_not_import_fastgrpo_transformers_or_vllm():
    code = ("import sys, importlib.util as u; "
            f"spec = u.spec_from_file_location('fk', r'{ROOT / 'kernels' / '__init__.py'}', "
            f"submodule_search_locations=[r'{ROOT / 'kernels'}']); "
            "m = u.module_from_spec(spec); sys.modules['fk'] = m; spec.loader.exec_module(m); "
            "bad = [n for n in ('transformers', 'vllm', 'fastgrpo') if n in sys.modules]; print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
