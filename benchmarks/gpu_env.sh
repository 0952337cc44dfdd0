# Sourced by run_gpu.sh (and by one-off commands on a lent GPU machine): installs the carried wheels in .whl/ and
# makes this source tree importable as fastgrpo, fastgrpo.kernels included, without pip or network.
#   source benchmarks/gpu_env.sh
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  if python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl; then
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    echo "gpu_env.sh: carried wheels installed: $(cd .whl && ls *.whl | sed 's/-py.*//' | tr '\n' ' ')"
  else  # e.g. two versions of one package in .whl/: nothing carried is importable, and the steps needing it say so
    echo "gpu_env.sh: installing .whl/*.whl failed; the carried packages are not available" >&2
  fi
fi
# As `make install` does (editable), but without pip: the image's setuptools falls back to `setup.py develop`, which
# wants to fetch build dependencies, and there is no network. fastgrpo.kernels lives in the top-level kernels/
# folder, so a small finder in site-packages maps it under the source tree's fastgrpo package.
SITE=$(python3 -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
cat > "$SITE/_fastgrpo_src_finder.py" <<PYEOF
import importlib.abc, importlib.util, sys
_ROOT = "$PWD"
class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "fastgrpo":
            return importlib.util.spec_from_file_location(
                name, _ROOT + "/fastgrpo/__init__.py", submodule_search_locations=[_ROOT + "/fastgrpo"])
        if name == "fastgrpo.kernels":
            return importlib.util.spec_from_file_location(
                name, _ROOT + "/kernels/__init__.py", submodule_search_locations=[_ROOT + "/kernels"])
        return None
sys.meta_path.insert(0, _Finder())
PYEOF
echo "import _fastgrpo_src_finder" > "$SITE/_fastgrpo_src_finder.pth"
python3 -c "import fastgrpo.kernels" || { echo "run_gpu.sh: fastgrpo.kernels is not importable" >&2; exit 2; }
