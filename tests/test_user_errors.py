"""A user's mistakes, met where the user meets them (``fastgrpo.train.main`` and the benchmarks' ``main`` in this
process; a subprocess where a signal is the point): each is one line naming the key, file or argument and what to
do, before any work; a failed run is named and counted, never an exit 0 with an empty result; a benchmark's children
end with it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fastgrpo import train

ROOT = Path(__file__).resolve().parents[1]

TOY = ["data.source=toy", "rewards.funcs=[toy_digit]", "model.name_or_path=tiny", "device=cpu",
       "rollout.max_completion_length=3", "grpo.prompts_per_step=2", "grpo.num_generations=2", "optim.lr=1e-2",
       "data.system_prompt=''", "eval.every=-1", "log.progress=false", "checkpoint.export_hf=false"]
"""A GRPO run of seconds on the embedded tiny model."""


def _one_line_error(err: str, *needles: str, prog: str = "fastgrpo") -> str:
    lines = [ln for ln in err.splitlines() if ln.startswith(f"{prog}: ")]
    assert len(lines) == 1 and all(n in lines[0] for n in needles), err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    return lines[0]


def _main(tmp_path: Path, *args: str) -> int:
    return train.main([*TOY, f"output_dir={tmp_path}", "name=run", *args])


# ---------------------------------------------------------------------------------------------- the config


def test_two_config_flags_are_one_line_naming_both_files(tmp_path, capsys):
    first, second = tmp_path / "first.yaml", tmp_path / "second.yaml"
    first.write_text("max_steps: 1\n")
    second.write_text("max_steps: 2\n")
    assert _main(tmp_path, "--config", str(first), "--config", str(second)) == 2
    _one_line_error(capsys.readouterr().err, "--config given 2 times", "first.yaml", "second.yaml")
    # overrides between the two flags: still the second flag that is named, not an override
    assert _main(tmp_path, "--config", str(first), "max_steps=1", "--config", str(second), "seed=1") == 2
    _one_line_error(capsys.readouterr().err, "--config given 2 times", "second.yaml")
    assert not any(tmp_path.glob("run"))


def test_a_yaml_key_given_twice_is_one_line_naming_the_key_and_both_lines(tmp_path, capsys):
    from fastgrpo.config import load_config

    config = tmp_path / "twice.yaml"
    config.write_text("max_steps: 1\nseed: 0\nmax_steps: 2\n")
    assert _main(tmp_path, "--config", str(config)) == 2
    _one_line_error(capsys.readouterr().err, "twice.yaml", "'max_steps'", "lines 1 and 3")
    nested = tmp_path / "nested.yaml"
    nested.write_text("optim:\n  lr: 0.1\n  lr: 0.2\n")
    assert _main(tmp_path, "--config", str(nested)) == 2
    _one_line_error(capsys.readouterr().err, "nested.yaml", "'lr'", "lines 2 and 3")
    # a merge may still override the keys it brings in
    merge = tmp_path / "merge.yaml"
    merge.write_text("rewards:\n  funcs: [toy_digit]\n  kwargs:\n    a: &base {x: 1, y: 2}\n"
                     "    toy_digit:\n      <<: *base\n      x: 3\n")
    assert load_config(merge, []).rewards.kwargs["toy_digit"] == {"x": 3, "y": 2}


@pytest.mark.parametrize("where", ["file", "override"])
def test_a_value_nested_5000_deep_is_one_line_naming_where_it_is(tmp_path, capsys, where):
    deep = "[" * 5000 + "]" * 5000
    if where == "file":
        config = tmp_path / "deep.yaml"
        config.write_text(f"max_steps: 1\nrewards:\n  funcs: {deep}\n")
        rc, needle = _main(tmp_path, "--config", str(config)), "deep.yaml"
    else:
        rc, needle = _main(tmp_path, f"rewards.funcs={deep}"), "override 'rewards.funcs'"
    assert rc == 2
    _one_line_error(capsys.readouterr().err, needle, "nested too deeply")


def test_an_unknown_section_whose_name_is_a_key_suggests_that_key_first(tmp_path, capsys):
    assert _main(tmp_path, "compile.enable=true") == 2
    _one_line_error(capsys.readouterr().err, "'compile.enable'", "did you mean 'parallel.compile'?")


# ---------------------------------------------------------------------------------------------- the benchmarks


def test_bench_real_model_checks_its_arguments_and_configs_before_any_run(tmp_path, capsys):
    from benchmarks import bench_real_model

    out = str(tmp_path / "out")
    for argv, needles in ((["--parallel", "0"], ["--parallel", ">= 1"]),
                          (["--threads", "0"], ["--threads"]),
                          (["bogus.key=1"], ["unknown config key 'bogus.key'"]),
                          (["max_steps=-1"], ["max_steps"]),
                          (["--out", "/dev/null"], ["--out", "/dev/null"])):
        argv = ["--out", out, *argv] if "--out" not in argv else argv
        assert bench_real_model.main(["--seeds", "0", *argv]) == 2, argv
        _one_line_error(capsys.readouterr().err, *needles, prog="bench_real_model.py")
    assert not (tmp_path / "out").exists()  # nothing started


def test_bench_real_model_report_only_on_a_folder_without_runs_is_an_error(tmp_path, capsys):
    from benchmarks import bench_real_model

    assert bench_real_model.main(["--report-only", "--out", str(tmp_path / "missing")]) == 2
    _one_line_error(capsys.readouterr().err, "--out", "missing", "--report-only", prog="bench_real_model.py")
    assert not (tmp_path / "missing").exists()


def test_bench_real_model_names_its_failed_runs_and_writes_no_empty_table(tmp_path, capsys):
    from benchmarks import bench_real_model

    # valid as a config; the run itself fails at its start (no such model folder)
    rc = bench_real_model.main(["--seeds", "0", "--no-control", "--out", str(tmp_path),
                                f"model.name_or_path={tmp_path / 'no' / 'model'}"])
    assert rc == 1
    line = _one_line_error(capsys.readouterr().err, "1 of 1 runs failed", "seed0 (exit 2", prog="bench_real_model.py")
    assert "does not exist" in line
    assert not (tmp_path / "learning.md").exists()


@pytest.mark.parametrize("argv, needles", [
    (["--steps", "-1"], ["--steps", ">= 1"]),
    (["--steps", "0"], ["--steps"]),
    (["--common", "bogus.key=1"], ["unknown config key 'bogus.key'"]),
    (["--cap", "0.5"], ["rollout.importance_sampling_cap"]),
    (["--staleness", "0"], ["rollout.max_staleness"]),
    (["--out", "/dev/null"], ["--out", "/dev/null"]),
])
def test_bench_async_checks_its_arguments_and_configs_before_any_run(tmp_path, capsys, argv, needles):
    from benchmarks import bench_async

    if "--out" not in argv:
        argv = [*argv, "--out", str(tmp_path / "out")]
    assert bench_async.main(argv) == 2
    _one_line_error(capsys.readouterr().err, *needles, prog="bench_async.py")
    assert not (tmp_path / "out").exists()


def _descendants(pid: int) -> set[int]:
    """Every process below ``pid`` (read from /proc)."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat.rpartition(")")[2].split()[1])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {p for p, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_sigterm_to_bench_real_model_ends_its_training_child_and_that_childs_reward_worker(tmp_path):
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_real_model.py"), "--seeds", "0", "--no-control",
           "--out", str(tmp_path), "model.name_or_path=tiny", "max_steps=100000",
           "eval.at_start=false", "eval.every=-1", "rollout.max_completion_length=8", "grpo.prompts_per_step=2",
           "grpo.num_generations=2", "data.num_train=16", "data.num_eval=4"]
    bench = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # the run's first step is logged: its reward worker is up
            metrics = tmp_path / "seed0" / "metrics.jsonl"
            if metrics.is_file() and metrics.read_text().strip():
                break
            assert bench.poll() is None, bench.communicate()[0][-3000:]
            time.sleep(0.5)
        else:
            pytest.fail("the run logged no step in 120 s")
        below = _descendants(bench.pid)
        assert len(below) >= 2, below  # the training child and at least its reward worker
        bench.send_signal(signal.SIGTERM)
        out, _ = bench.communicate(timeout=120)
        assert bench.returncode == 128 + signal.SIGTERM, out[-3000:]
        assert "stopped by SIGTERM" in out and "Traceback" not in out, out[-3000:]
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in below) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [p for p in below if _alive(p)]
        assert "fastgrpo: stopped early: SIGTERM" in (tmp_path / "seed0.log").read_text()  # the child saved
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait()


# ---------------------------------------------------------------------------------------------- engines and models


def test_prompts_longer_than_the_vllm_context_are_one_line_before_any_model_loads(tmp_path, capsys, monkeypatch):
    from fastgrpo.rollout import ENGINES
    from fastgrpo.trainers import loop

    # vLLM need not be installed: the check reads the data and the tokenizer only
    monkeypatch.setattr(ENGINES["vllm"], "check_available", lambda: None)
    monkeypatch.setattr(loop, "load_model", lambda *a, **k: pytest.fail("the model loaded"))
    assert _main(tmp_path, "max_steps=1", "rollout.engine=vllm", "rollout.vllm.max_model_len=6") == 2
    _one_line_error(capsys.readouterr().err, "row 0", "rollout.vllm.max_model_len=6",
                    "raise rollout.vllm.max_model_len")


def test_a_completion_budget_as_long_as_the_vllm_context_is_a_config_error(tmp_path, capsys):
    assert _main(tmp_path, "rollout.engine=vllm", "rollout.vllm.max_model_len=64",
                 "rollout.max_completion_length=100") == 2
    _one_line_error(capsys.readouterr().err, "rollout.max_completion_length", "rollout.vllm.max_model_len=64")


def test_an_async_max_staleness_past_the_open_file_limit_is_one_line_before_the_worker_starts(tmp_path, capsys):
    assert _main(tmp_path, "max_steps=1", "rollout.asynchronous=true", "rollout.importance_sampling_cap=2",
                 "rollout.max_staleness=1000000") == 2
    _one_line_error(capsys.readouterr().err, "rollout.max_staleness=1000000", "open files", "ulimit -n")


def test_the_async_refusal_of_a_user_environment_names_that_environment(tmp_path, capsys):
    envs = tmp_path / "myenv.py"
    envs.write_text("from fastgrpo.environments import Environment\n\nclass Guess(Environment):\n"
                    "    def step(self, text):\n        return None, 1.0, True\n")
    assert _main(tmp_path, "max_steps=1", "rollout.asynchronous=true", "rollout.importance_sampling_cap=2",
                 f"rollout.env.name={envs}:Guess", "rollout.max_turns=2") == 2
    line = _one_line_error(capsys.readouterr().err, "rollout.env.name", "myenv.py:Guess", "rollout.asynchronous")
    assert "tools" not in line


def test_a_disk_too_full_for_the_run_lock_is_exit_1_naming_the_file_and_the_rerun_resumes(tmp_path, capsys,
                                                                                          monkeypatch):
    import errno

    assert _main(tmp_path, "max_steps=1") == 0
    real_write = os.write

    def full(fd, data):  # a full disk: any new byte fails (the first the run writes is its lock's pid)
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(os, "write", full)
        rc = _main(tmp_path, "max_steps=2")
    assert os.write is real_write
    assert rc == 1
    _one_line_error(capsys.readouterr().err, "no space left", str(tmp_path / "run" / ".lock"), "same command")
    assert _main(tmp_path, "max_steps=2") == 0  # room again: the same command resumes
    assert "resumed from" in capsys.readouterr().out


def _write_gguf(path: Path) -> Path:
    """A minimal GGUF file (one tensor, no tokenizer): what a real one starts with, for the name and cache logic."""
    import numpy as np

    gguf = pytest.importorskip("gguf", reason="the gguf package is not installed (pip install gguf==0.19.0)")
    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture
def fake_conversion(tmp_path, monkeypatch) -> list[Path]:
    """GGUF conversion into a cache under tmp_path that copies the tiny model in (the dequantization itself is
    tests/test_real_model.py's): returns the list of files converted, one entry per conversion."""
    import shutil

    from fastgrpo.models import sources
    from fastgrpo.models.tiny import build_tiny

    tiny = build_tiny()
    calls: list[Path] = []

    def write_folder(path, out):
        calls.append(path)
        for f in tiny.iterdir():
            shutil.copy(f, out / f.name)

    monkeypatch.setenv("FASTGRPO_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(sources, "_write_folder", write_folder)
    monkeypatch.setattr(sources, "check_gguf", lambda path: None)
    return calls


def _damage_tokenizer(folder: Path) -> None:
    (folder / "tokenizer.json").unlink()


def _damage_truncate(folder: Path) -> None:
    weights = folder / "model.safetensors"
    with open(weights, "r+b") as f:
        f.truncate(weights.stat().st_size // 2)


def _damage_other_tensors(folder: Path) -> None:
    import torch
    from safetensors.torch import save_file

    save_file({"model.embed_tokens.weight": torch.zeros(3, 5)}, str(folder / "model.safetensors"))


@pytest.mark.parametrize("damage", [_damage_tokenizer, _damage_truncate, _damage_other_tensors],
                         ids=["no-tokenizer-json", "truncated-safetensors", "other-tensors"])
def test_a_damaged_gguf_cache_folder_is_converted_again_not_loaded(tmp_path, capsys, fake_conversion, damage):
    import filecmp

    from fastgrpo.models import sources
    from fastgrpo.models.tiny import build_tiny

    gguf_file = _write_gguf(tmp_path / "model.gguf")
    assert _main(tmp_path, f"model.name_or_path={gguf_file}", "max_steps=1") == 0, capsys.readouterr().err[-3000:]
    folder = sources.gguf_folder(gguf_file)
    assert len(fake_conversion) == 1
    damage(folder)
    rc = train.main([*TOY, f"output_dir={tmp_path}", "name=again", f"model.name_or_path={gguf_file}", "max_steps=1"])
    err = capsys.readouterr().err
    assert rc == 0 and "converting again" in err and "Traceback" not in err, err[-3000:]
    assert len(fake_conversion) == 2
    names = [f.name for f in build_tiny().iterdir()]
    assert filecmp.cmpfiles(folder, build_tiny(), names, shallow=False)[0] == names  # whole again


def test_a_gguf_file_is_known_by_its_bytes_whatever_its_name(tmp_path, capsys, fake_conversion):
    gguf_file = _write_gguf(tmp_path / "weights.bin")
    assert _main(tmp_path, f"model.name_or_path={gguf_file}", "max_steps=1") == 0, capsys.readouterr().err[-3000:]
    assert fake_conversion == [gguf_file]
    other = tmp_path / "other.bin"
    other.write_bytes(b"PK\x03\x04 not a model")
    assert train.main([*TOY, f"output_dir={tmp_path}", "name=other", f"model.name_or_path={other}"]) == 2
    _one_line_error(capsys.readouterr().err, str(other), "is a file", "GGUF")


def test_a_folder_named_like_a_gguf_file_is_a_folder(tmp_path, capsys):
    import shutil

    from fastgrpo.models.tiny import build_tiny

    empty = tmp_path / "empty.gguf"
    empty.mkdir()
    assert _main(tmp_path, f"model.name_or_path={empty}", "max_steps=1") == 2
    line = _one_line_error(capsys.readouterr().err, str(empty), "folder", "config.json")
    assert "does not exist" not in line
    model = tmp_path / "model.gguf"
    shutil.copytree(build_tiny(), model)
    assert _main(tmp_path, f"model.name_or_path={model}", "max_steps=1") == 0, capsys.readouterr().err[-3000:]


@pytest.mark.parametrize("name", ["smollm2-135m", "SmolLM2-135M-Instruct"])
@pytest.mark.parametrize("offline", ["HF_HUB_OFFLINE", "no-connection"])
def test_a_near_miss_of_a_named_source_without_network_names_it_at_once(tmp_path, capsys, monkeypatch, name, offline):
    import socket

    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    if offline == "HF_HUB_OFFLINE":
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    else:
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        for proxy in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
            monkeypatch.delenv(proxy, raising=False)

        def refused(*a, **k):
            raise ConnectionRefusedError(111, "Connection refused")

        monkeypatch.setattr(socket, "create_connection", refused)
    start = time.monotonic()
    assert _main(tmp_path, f"model.name_or_path={name}", "max_steps=1") == 2
    _one_line_error(capsys.readouterr().err, f"{name!r}", "did you mean the named source 'smollm2-135m-instruct'?")
    assert time.monotonic() - start < 30  # no minute of hub retries
