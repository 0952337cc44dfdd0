"""Failure behaviour through the command line (README "Failure behaviour"): nothing a user or a reward function does
can poison, hang or silently damage a run. One test per numbered case of issue 12.

Most runs call ``fastgrpo.train.main`` in this process (as the CLI does, without an interpreter start each); the
ones about signals, kills and torchrun start real processes.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from _launch import free_port
from fastgrpo import train

TOY = ["data.source=toy", "rewards.funcs=[toy_digit]", "model.name_or_path=tiny", "device=cpu",
       "rollout.max_completion_length=3", "grpo.prompts_per_step=2", "grpo.num_generations=4", "optim.lr=1e-2",
       "data.system_prompt=''", "eval.every=-1", "log.progress=false", "checkpoint.export_hf=false",
       "log.completions_per_step=1"]

PLUGIN = '''
import math, os, sys, time
from pathlib import Path

def neg_inf(completions, **kw):
    return [-math.inf] + [1.0] * (len(completions) - 1)

def huge(completions, **kw):  # finite, but the group mean overflows float32: the advantages are not finite
    return [3e38] * len(completions)

def one_float(completions, **kw):
    return 0.5

def hang_from_second_call(completions, **kw):
    marker = Path(os.environ["FASTGRPO_TEST_MARKER"])
    if marker.exists():
        marker.write_text("hanging")
        time.sleep(600)
    marker.write_text("called once")
    return [1.0] * len(completions)
'''


@pytest.fixture(scope="module")
def plugin(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("plugin") / "hostile.py"
    path.write_text(PLUGIN)
    return str(path)


def _main(tmp_path: Path, *overrides: str, name: str = "run") -> int:
    return train.main([*TOY, f"output_dir={tmp_path}", f"name={name}", *overrides])


def _metrics(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def _one_line_error(err: str, needle: str) -> None:
    lines = [ln for ln in err.splitlines() if ln.startswith("fastgrpo: ")]
    assert len(lines) == 1 and needle in lines[0], err[-3000:]
    assert "Traceback" not in err, err[-3000:]


# 1 ---------------------------------------------------------------------------------------------------------------


def test_1_an_inf_reward_scores_on_error_value_and_the_weights_stay_finite(tmp_path, plugin, capsys):
    rc = _main(tmp_path, "max_steps=2", f"rewards.funcs=[{plugin}:neg_inf,toy_digit]", "checkpoint.export_hf=true",
               "rewards.timeout_s=30")
    assert rc == 0, capsys.readouterr().err[-3000:]
    rows = _metrics(tmp_path / "run")
    assert [r["reward/neg_inf/errors"] for r in rows] == [1.0, 1.0]  # one -inf completion per step
    assert all(math.isfinite(r["reward/mean"]) and math.isfinite(r["policy/grad_norm"]) for r in rows)
    weights = load_file(tmp_path / "run" / "final" / "model.safetensors")
    assert all(torch.isfinite(t).all() for t in weights.values())


@pytest.mark.parametrize("override, field", [("rewards.weights=[inf,1]", "rewards.weights[0]"),
                                             ("optim.weight_decay=inf", "optim.weight_decay"),
                                             ("grpo.epsilon_high=nan", "grpo.epsilon_high")])
def test_1_non_finite_config_numbers_are_one_line_errors(tmp_path, capsys, override, field):
    rc = _main(tmp_path, "rewards.funcs=[toy_digit,toy_digit]", override)
    assert rc == 2
    _one_line_error(capsys.readouterr().err, f"{field}: must be a finite number")
    assert not any(tmp_path.iterdir())


# 4 ---------------------------------------------------------------------------------------------------------------


def test_4_a_run_name_cannot_write_outside_output_dir(tmp_path, capsys):
    out = tmp_path / "runs"
    out.mkdir()
    (tmp_path / "precious.txt").write_text("mine")
    rc = train.main([*TOY, f"output_dir={out}", "name=..", "max_steps=1"])
    assert rc == 2
    _one_line_error(capsys.readouterr().err, "name: must be a plain folder name")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["precious.txt", "runs"] and not any(out.iterdir())


# 6 ---------------------------------------------------------------------------------------------------------------


def test_6_fsdp_off_with_two_ranks_is_an_error_not_two_unsynchronised_models(tmp_path):
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                          str(free_port()), "-m", "fastgrpo.train", *TOY, f"output_dir={tmp_path}", "name=dp",
                          "max_steps=1", "parallel.fsdp=false"],
                         capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode != 0
    assert "parallel.fsdp=false with 2 processes would train 2 unsynchronised copies" in out.stderr
    assert not (tmp_path / "dp").exists()


# 7, 8 -------------------------------------------------------------------------------------------------------------


def test_7_8_torn_log_line_resumes_and_resume_never_refuses_to_overwrite(tmp_path, capsys):
    assert _main(tmp_path, "max_steps=1", "checkpoint.every=1", "checkpoint.keep_last=3") == 0
    run = tmp_path / "run"
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 2, "reward/me')  # a kill in the middle of a write
    assert _main(tmp_path, "max_steps=2", "checkpoint.keep_last=3") == 0, capsys.readouterr().err[-3000:]
    assert [r["step"] for r in _metrics(run)] == [1, 2]
    assert "torn last line" in capsys.readouterr().out

    before = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert _main(tmp_path, "max_steps=1", "checkpoint.resume=never") == 2
    _one_line_error(capsys.readouterr().err, "already holds a run and checkpoint.resume=never would overwrite it")
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == before and len(_metrics(run)) == 2

    # overwrite: the old run goes entirely (its step-1 checkpoint would otherwise sit beside the new step 3)
    assert _main(tmp_path, "max_steps=3", "checkpoint.resume=never", "checkpoint.overwrite=true",
                 "checkpoint.keep_last=3") == 0
    assert [r["step"] for r in _metrics(run)] == [1, 2, 3]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000003"]


# 9, 10: one-line errors -------------------------------------------------------------------------------------------


ROW = '{"nums": [1, 2], "target": 3}'
CASES = {  # case -> (file to write or None, its content, override (with {path}), what the error says)
    "empty_jsonl": ("e.jsonl", "", "data.source={path}", "has no rows"),
    "broken_jsonl_line": ("b.jsonl", f"{ROW}\n{{oops\n", "data.source={path}", "line 2 is not valid JSON"),
    "nums_as_strings": ("s.jsonl", '{"nums": ["1", "2"], "target": 3}\n', "data.source={path}",
                        "row 0 (line 1): field 'nums' must be a list of integers"),
    "output_dir_is_a_file": ("afile", "x", "output_dir={path}", "is a file, not a folder"),
    "final_is_a_file": ("run/final", "x", "checkpoint.export_hf=true", "the export folder"),
    "plugin_exits_at_import": ("p.py", "raise SystemExit(5)", "rewards.funcs=[{path}:f]", "SystemExit(5)"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_9_10_bad_input_is_a_one_line_error_before_the_model_loads(tmp_path, capsys, monkeypatch, case):
    import fastgrpo.model
    import fastgrpo.trainer

    def no_model(*a, **k):
        raise AssertionError("the model must not load")

    for module in (fastgrpo.model, fastgrpo.trainer):
        monkeypatch.setattr(module, "load_model", no_model, raising=False)
    name, content, override, needle = CASES[case]
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(content)
    rc = train.main([*TOY, f"output_dir={tmp_path}", "name=run", "max_steps=1", override.format(path=path)])
    assert rc == 2
    _one_line_error(capsys.readouterr().err, needle)


def test_9_resuming_another_models_checkpoint_is_a_one_line_error(tmp_path, capsys):
    assert _main(tmp_path, "max_steps=1") == 0
    rc = _main(tmp_path, "max_steps=2", "model.name_or_path=tiny:llama")
    assert rc == 2
    _one_line_error(capsys.readouterr().err, "holds another model")


def test_9_a_full_disk_is_a_one_line_error(tmp_path, capsys):
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full on this platform")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").symlink_to("/dev/full")  # every write fails with ENOSPC
    rc = _main(tmp_path, "max_steps=2")
    assert rc == 1
    _one_line_error(capsys.readouterr().err, "no space left on the device while writing")


def test_9_a_plugin_returning_a_float_with_on_error_raise_is_a_one_line_error(tmp_path, capsys, plugin):
    rc = _main(tmp_path, "max_steps=1", f"rewards.funcs=[{plugin}:one_float]", "rewards.on_error=raise")
    assert rc == 1
    _one_line_error(capsys.readouterr().err, "reward 'one_float' returned float 0.5")


# 1: the optimizer never steps on a non-finite gradient --------------------------------------------------------------


def test_1_non_finite_updates_are_skipped_then_the_run_stops_naming_step_and_cause(tmp_path, plugin, capsys):
    rc = _main(tmp_path, "max_steps=5", f"rewards.funcs=[{plugin}:huge]", "optim.max_nonfinite_steps=2",
               "checkpoint.every=1")
    assert rc == 1
    _one_line_error(capsys.readouterr().err, "step 2: 2 optimizer updates in a row had a non-finite gradient")
    rows = _metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1] and rows[0]["policy/skipped_updates"] == 1
    assert not math.isfinite(rows[0]["policy/grad_norm"])
    # the weights never moved: step 1's checkpoint holds the initial weights
    from fastgrpo.checkpoint import load_checkpoint
    from fastgrpo.config import ModelConfig
    from fastgrpo.model import load_model

    model = load_model(ModelConfig(name_or_path="tiny"), device=torch.device("cpu"), seed=0)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    load_checkpoint(tmp_path / "run" / "checkpoints" / "step_000001", model=model,
                    optimizer=torch.optim.AdamW(model.parameters()))
    assert all(torch.equal(initial[k], v) for k, v in model.state_dict().items())


# 2: SIGTERM ends a run stuck in a reward ---------------------------------------------------------------------------


def test_2_sigterm_ends_a_run_stuck_in_a_reward_and_saves_the_step_before(tmp_path, plugin):
    marker = tmp_path / "marker"
    args = [sys.executable, "-m", "fastgrpo.train", *TOY, f"output_dir={tmp_path}", "name=stuck", "max_steps=5",
            f"rewards.funcs=[{plugin}:hang_from_second_call]", "rewards.timeout_s=600"]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, FASTGRPO_TEST_MARKER=str(marker)))
    deadline = time.time() + 240
    while time.time() < deadline and not (marker.exists() and marker.read_text() == "hanging"):
        time.sleep(0.2)
    assert marker.read_text() == "hanging"  # step 2's reward call hangs (for 600 s)
    t0 = time.time()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    assert time.time() - t0 < 30  # not the 600 s of the hang nor rewards.timeout_s
    assert "SIGTERM during step 2: dropped that step" in out + err
    run = tmp_path / "stuck"
    assert [r["step"] for r in _metrics(run)] == [1]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000001"]


# 5: the export is written on rerun ---------------------------------------------------------------------------------


def test_5_a_run_killed_before_its_export_writes_it_on_rerun(tmp_path, capsys):
    import shutil

    assert _main(tmp_path, "max_steps=1", "checkpoint.export_hf=true") == 0
    shutil.rmtree(tmp_path / "run" / "final")  # what a kill after the last checkpoint leaves
    assert _main(tmp_path, "max_steps=1", "checkpoint.export_hf=true") == 0
    assert "has no final/ export: writing it" in capsys.readouterr().out
    assert (tmp_path / "run" / "final" / "model.safetensors").is_file()
    assert _main(tmp_path, "max_steps=1", "checkpoint.export_hf=true") == 0  # and now there is nothing to do
    assert "nothing to do" in capsys.readouterr().out
