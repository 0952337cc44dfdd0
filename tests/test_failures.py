"""Failure behaviour through the command line (README "Failure behaviour"): nothing a user or a reward function does
can poison, hang or silently damage a run. One test per case of docs/FAILURES.md.

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

from _launch import free_port, run_cli
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

def huge(completions, **kw):  # finite, but beyond float32's range / (2 F): a too_large failure
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
    path.write_text(PLUGIN + PLUGIN_24)
    return str(path)


def _main(tmp_path: Path, *overrides: str, name: str = "run") -> int:
    return train.main([*TOY, f"output_dir={tmp_path}", f"name={name}", *overrides])


def _not_json(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def _metrics(run: Path) -> list[dict]:
    """The run's records, read as strict JSON (no NaN or Infinity)."""
    return [json.loads(x, parse_constant=_not_json) for x in (run / "metrics.jsonl").read_text().splitlines()]


def _one_line_error(err: str, needle: str, prog: str = "fastgrpo") -> None:
    lines = [ln for ln in err.splitlines() if ln.startswith(f"{prog}: ")]
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
    "deeply_nested_json": ("n.jsonl", '{"prompt": "x", "a": ' + "[" * 100_000 + "]" * 100_000 + "}\n",
                           "data.source={path}", "is nested too deeply"),
    "output_dir_under_a_file": ("afile", "x", "output_dir={path}/runs", "is a file, so the run folder"),
}


def _forbid_model_load(monkeypatch) -> None:
    import fastgrpo.trainers.loop
    import fastgrpo.models.loading
    import fastgrpo.trainers.grpo

    def no_model(*a, **k):
        raise AssertionError("the model must not load")

    for module in (fastgrpo.models.loading, fastgrpo.trainers.grpo, fastgrpo.trainers.loop):
        monkeypatch.setattr(module, "load_model", no_model, raising=False)


@pytest.mark.parametrize("case", sorted(CASES))
def test_9_10_bad_input_is_a_one_line_error_before_the_model_loads(tmp_path, capsys, monkeypatch, case):
    _forbid_model_load(monkeypatch)
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
    _one_line_error(capsys.readouterr().err, "model.name_or_path: 'tiny' -> 'tiny:llama'")  # a changed config
    rc = _main(tmp_path, "max_steps=2", "model.name_or_path=tiny:llama", "checkpoint.allow_config_change=true")
    assert rc == 2
    _one_line_error(capsys.readouterr().err, "holds another model")  # allowed, but the weights cannot load


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


def test_1_non_finite_updates_are_skipped_then_the_run_stops_naming_step_and_cause(tmp_path, capsys, monkeypatch):
    import fastgrpo.algorithms.episodes

    # No reward can make the advantages non-finite (too_large catches it first); stand in for any other cause.
    def infinite_advantages(*args, **kwargs):
        result = compute_advantages(*args, **kwargs)
        result.advantages.fill_(math.inf)
        return result

    compute_advantages = fastgrpo.algorithms.episodes.compute_advantages
    monkeypatch.setattr(fastgrpo.algorithms.episodes, "compute_advantages", infinite_advantages)
    rc = _main(tmp_path, "max_steps=5", "optim.max_nonfinite_steps=2", "checkpoint.every=1")
    assert rc == 1
    _one_line_error(capsys.readouterr().err, "step 2: 2 optimizer updates in a row had a non-finite gradient")
    rows = _metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1] and rows[0]["policy/skipped_updates"] == 1
    assert rows[0]["policy/grad_norm"] is None  # not finite: written as null (JSON has no NaN or Infinity)
    # the weights never moved: step 1's checkpoint holds the initial weights
    from fastgrpo.distributed.checkpoint import load_checkpoint
    from fastgrpo.config import ModelConfig
    from fastgrpo.models.loading import load_model

    model = load_model(ModelConfig(name_or_path="tiny"), device=torch.device("cpu"), seed=0)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    load_checkpoint(tmp_path / "run" / "checkpoints" / "step_000001", model=model,
                    optimizer=torch.optim.AdamW(model.parameters()))
    assert all(torch.equal(initial[k], v) for k, v in model.state_dict().items())


# 2: SIGTERM ends a run stuck in a reward ---------------------------------------------------------------------------


def _start_stuck_run(tmp_path: Path, plugin: str, name: str) -> subprocess.Popen:
    """A ``python -m fastgrpo.train`` process, returned once step 2's reward call hangs (for 600 s)."""
    marker = tmp_path / "marker"
    args = [sys.executable, "-m", "fastgrpo.train", *TOY, f"output_dir={tmp_path}", f"name={name}", "max_steps=5",
            f"rewards.funcs=[{plugin}:hang_from_second_call]", "rewards.timeout_s=600"]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, FASTGRPO_TEST_MARKER=str(marker)))
    deadline = time.time() + 240
    while time.time() < deadline and not (marker.exists() and marker.read_text() == "hanging"):
        time.sleep(0.2)
    assert marker.read_text() == "hanging"
    return proc


def test_2_sigterm_ends_a_run_stuck_in_a_reward_and_saves_the_step_before(tmp_path, plugin):
    proc = _start_stuck_run(tmp_path, plugin, "stuck")
    t0 = time.time()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err[-3000:]  # stopped early: not a success
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


# no silent wrong results from rewards and data -------------------------------------------------------------------

# (the plugin fixture's file holds these functions too)
PLUGIN_24 = '''
import asyncio


def _mutate(completions, completion_ids, tags):
    completions[:] = ["MUTATED"] * len(completions)
    for ids, t in zip(completion_ids, tags):
        ids.clear()
        t.append("MUTATED")


def _seen(completions, completion_ids, tags):  # 1.0 where another reward's change shows
    return [float(c == "MUTATED" or not ids or "MUTATED" in t) for c, ids, t in zip(completions, completion_ids, tags)]


def mutate(completions, completion_ids, tags, **kw):
    _mutate(completions, completion_ids, tags)
    return [0.0] * len(completions)


def seen(completions, completion_ids, tags, **kw):
    return _seen(completions, completion_ids, tags)


async def amutate(completions, completion_ids, tags, **kw):
    _mutate(completions, completion_ids, tags)
    await asyncio.sleep(0)
    return [0.0] * len(completions)


async def aseen(completions, completion_ids, tags, **kw):
    await asyncio.sleep(0.05)  # amutate has changed its arguments by now
    return _seen(completions, completion_ids, tags)


def plus_minus(completions, **kw):  # +-3e38: its float32 std overflowed, and every advantage was 0
    return [3e38 if i % 2 else -3e38 for i in range(len(completions))]


def huge_too(completions, **kw):
    return [3e38] * len(completions)


def spread(completions, **kw):  # +-1e20: the float32 sum of squares overflowed, and batch-scaled advantages were 0
    return [1e20 if i % 2 else -1e20 for i in range(len(completions))]


def needs_answer(completions, answer, **kw):
    return [1.0] * len(completions)
'''


def _prompt_rows(path: Path, n: int, **columns) -> str:
    """A JSON-lines file of ``n`` prompt rows; ``columns``: name -> function of the row index (None: left out)."""
    rows = [{"prompt": f"Write a number ({i}):", **{k: f(i) for k, f in columns.items() if f(i) is not None}}
            for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.mark.parametrize("mutate, seen, sandbox", [("amutate", "aseen", "true"), ("mutate", "seen", "false")])
def test_24_1_a_reward_changing_its_arguments_changes_nothing_another_reward_or_the_data_sees(
        tmp_path, plugin, capsys, mutate, seen, sandbox):
    data = _prompt_rows(tmp_path / "tags.jsonl", 12, tags=lambda i: [i])
    rc = _main(tmp_path, "max_steps=2", f"data.source={data}", "data.num_eval=2", f"rewards.sandbox={sandbox}",
               f"rewards.funcs=[{plugin}:{mutate},{plugin}:{seen}]")
    assert rc == 0, capsys.readouterr().err[-3000:]
    rows = _metrics(tmp_path / "run")
    assert [(r[f"reward/{seen}/mean"], r[f"reward/{seen}/errors"]) for r in rows] == [(0.0, 0.0)] * 2


@pytest.mark.parametrize("column", ["task", "completions", "prompts", "completion_ids"])
def test_24_2_a_data_column_with_a_reserved_name_is_a_one_line_error_before_the_model_loads(
        tmp_path, capsys, monkeypatch, column):
    _forbid_model_load(monkeypatch)
    data = _prompt_rows(tmp_path / "d.jsonl", 12, **{column: lambda i: "mine"})
    assert _main(tmp_path, "max_steps=1", f"data.source={data}", "data.num_eval=2") == 2
    _one_line_error(capsys.readouterr().err, f"column name(s) [{column!r}] are reserved")


def test_24_3_rewards_beyond_float32s_range_are_counted_errors_not_zero_advantages_or_the_runs_end(
        tmp_path, plugin, capsys):
    rc = _main(tmp_path, "max_steps=2", f"rewards.funcs=[{plugin}:plus_minus,{plugin}:huge,{plugin}:huge_too]")
    assert rc == 0, capsys.readouterr().err[-3000:]
    rows = _metrics(tmp_path / "run")
    for name in ("plus_minus", "huge", "huge_too"):
        assert [r[f"reward/{name}/errors"] for r in rows] == [8.0, 8.0]  # every completion, every step
    assert [r["policy/skipped_updates"] for r in rows] == [0.0, 0.0]


def test_24_3_batch_scaled_advantages_of_large_finite_rewards_are_not_zero(tmp_path, plugin, capsys):
    rc = _main(tmp_path, "max_steps=1", f"rewards.funcs=[{plugin}:spread]", "grpo.scale_rewards=batch")
    assert rc == 0, capsys.readouterr().err[-3000:]
    (row,) = _metrics(tmp_path / "run")
    assert row["reward/spread/errors"] == 0 and row["adv/std"] > 0.5
    assert 0 < row["policy/grad_norm"] < math.inf


IMPORT_CASES = {  # case -> (plugin file, extra override, what the error says)
    "exit_in_a_worker": ("import os\nos._exit(0)\n", "rewards.sandbox=true", "ended the process (exit code 0)"),
    "exit_in_process": ("import os\nos._exit(0)\n", "rewards.sandbox=false", "ended the process (exit code 0)"),
    "sleep": ("import time\ntime.sleep(600)\n", "rewards.sandbox=true", "took more than 5 s (rewards.timeout_s)"),
    "keyboard_interrupt": ("raise KeyboardInterrupt\n", "rewards.sandbox=false", "KeyboardInterrupt()"),
}


@pytest.mark.parametrize("case", sorted(IMPORT_CASES))
def test_24_6_a_plugin_that_exits_hangs_or_is_interrupted_at_import_is_a_one_line_error(tmp_path, case):
    content, override, needle = IMPORT_CASES[case]
    path = tmp_path / "at_import.py"
    path.write_text(content)
    # a child process: before the fix, these ended (exit code 0), hung or interrupted the process that imported them
    out = subprocess.run([sys.executable, "-m", "fastgrpo.train", *TOY, f"output_dir={tmp_path}", "name=run",
                          "max_steps=1", f"rewards.funcs=[{path}:f]", "rewards.timeout_s=5", override],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr[-3000:]
    _one_line_error(out.stderr, needle)


def test_24_10_no_training_rows_says_data_num_eval_held_them_out(tmp_path, capsys, monkeypatch):
    _forbid_model_load(monkeypatch)
    data = _prompt_rows(tmp_path / "d.jsonl", 60)
    assert _main(tmp_path, "max_steps=1", f"data.source={data}") == 2
    _one_line_error(capsys.readouterr().err, "60 valid row(s), 60 held out for evaluation (data.num_eval=64)")


def test_24_10_sft_no_training_rows_says_data_num_eval_held_them_out(tmp_path, capsys):
    from fastgrpo import sft

    data = _prompt_rows(tmp_path / "pairs.jsonl", 60, completion=lambda i: str(i))
    rc = sft.main(["model.name_or_path=tiny", "device=cpu", f"data.source={data}", f"output_dir={tmp_path}",
                   "name=sft", "max_steps=1", "log.progress=false"])
    assert rc == 2
    _one_line_error(capsys.readouterr().err, "60 valid row(s), 60 held out for evaluation (data.num_eval=64)",
                    prog="fastgrpo.sft")


def test_24_10_rows_missing_a_rewards_column_are_counted_as_its_errors(tmp_path, plugin, capsys):
    data = _prompt_rows(tmp_path / "d.jsonl", 12, answer=lambda i: "1" if i % 2 else None)
    rc = _main(tmp_path, "max_steps=2", "grpo.prompts_per_step=4", f"data.source={data}", "data.num_eval=2",
               f"rewards.funcs=[{plugin}:needs_answer]")
    assert rc == 0, capsys.readouterr().err[-3000:]
    rows = _metrics(tmp_path / "run")
    errors = [r["reward/needs_answer/errors"] for r in rows]  # 4 completions per row without an answer
    assert sum(errors) > 0 and all(e % 4 == 0 for e in errors)
    assert [r["reward/needs_answer/mean"] for r in rows] == [1 - e / 16 for e in errors]  # they score 0, others 1


# no silent wrong results from a rerun, a long prompt, a signal or a config mistake -------------------------------

PLUGIN_SIGNALS = '''
import os, signal
from pathlib import Path

def term_trainer_once(completions, **kw):  # a preemption in the middle of the first step's rewards
    marker = Path(os.environ["FASTGRPO_TEST_MARKER"])
    if not marker.exists():
        marker.write_text("sent")
        os.kill(os.getppid(), signal.SIGTERM)  # the sandbox worker's parent: the trainer
    return [1.0] * len(completions)

def interrupt_trainer(completions, **kw):  # Ctrl-C
    os.kill(os.getppid(), signal.SIGINT)
    return [1.0] * len(completions)
'''


@pytest.fixture(scope="module")
def signals_plugin(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("plugin") / "signals.py"
    path.write_text(PLUGIN_SIGNALS)
    return str(path)


def test_24_4_resuming_with_a_changed_config_names_what_changed_unless_allowed(tmp_path, capsys):
    assert _main(tmp_path, "max_steps=1") == 0
    run = tmp_path / "run"
    saved = (run / "config.json").read_text()
    assert _main(tmp_path, "max_steps=2", "grpo.num_generations=2", "optim.lr=1e-3") == 2
    _one_line_error(capsys.readouterr().err, "(optim.lr: 0.01 -> 0.001; grpo.num_generations: 4 -> 2)")
    assert (run / "config.json").read_text() == saved and [r["step"] for r in _metrics(run)] == [1]
    # what does not define the run may change: its length, logs, evaluations, checkpoints
    assert _main(tmp_path, "max_steps=2", "log.completions_per_step=2", "checkpoint.keep_last=3") == 0
    assert _main(tmp_path, "max_steps=3", "grpo.num_generations=2", "checkpoint.allow_config_change=true") == 0
    assert json.loads((run / "config.until_step_000002.json").read_text())["grpo"]["num_generations"] == 4
    assert json.loads((run / "config.json").read_text())["grpo"]["num_generations"] == 2
    assert [r["step"] for r in _metrics(run)] == [1, 2, 3]


@pytest.mark.parametrize("entry, chars", [("fastgrpo", 3000), ("fastgrpo", 1_000_000), ("fastgrpo.sft", 3000)])
def test_24_5_a_prompt_longer_than_the_models_context_is_a_one_line_error_before_the_model_loads(
        tmp_path, capsys, monkeypatch, entry, chars):
    from fastgrpo import sft

    _forbid_model_load(monkeypatch)
    data = _prompt_rows(tmp_path / "d.jsonl", 8, prompt=lambda i: "L" * chars if i == 3 else f"short {i}",
                        completion=lambda i: str(i) if entry == "fastgrpo.sft" else None)
    argv = [f"data.source={data}", "data.num_eval=2", "max_steps=1"]
    rc = _main(tmp_path, *argv) if entry == "fastgrpo" else sft.main(
        ["model.name_or_path=tiny", "device=cpu", "log.progress=false", f"output_dir={tmp_path}", *argv])
    assert rc == 2
    _one_line_error(capsys.readouterr().err, "more than the model's 2048 (max_position_embeddings)", prog=entry)


def test_24_7_a_second_run_in_the_same_folder_is_refused_naming_the_first_ones_pid(tmp_path, plugin, capsys):
    first = _start_stuck_run(tmp_path, plugin, "run")
    try:
        assert _main(tmp_path, "max_steps=1") == 2
        _one_line_error(capsys.readouterr().err, f"another run (pid {first.pid}) is using the run folder")
    finally:
        first.kill()
        first.communicate(timeout=60)
    assert _main(tmp_path, "max_steps=1") == 0  # the kernel released the killed run's lock
    assert [r["step"] for r in _metrics(tmp_path / "run")] == [1]


def test_24_8_a_reward_that_sigterms_the_trainer_stops_it_with_143_and_the_same_command_resumes(
        tmp_path, capsys, monkeypatch, signals_plugin):
    from fastgrpo.distributed.checkpoint import list_checkpoints

    monkeypatch.setenv("FASTGRPO_TEST_MARKER", str(tmp_path / "marker"))
    command = ("max_steps=2", f"rewards.funcs=[{signals_plugin}:term_trainer_once]", "checkpoint.export_hf=true")
    assert _main(tmp_path, *command) == 143
    _one_line_error(capsys.readouterr().err, "stopped early: SIGTERM")
    run = tmp_path / "run"
    assert list_checkpoints(run / "checkpoints") and not (run / "final").exists()
    assert _main(tmp_path, *command) == 0
    assert "resumed from" in capsys.readouterr().out and (run / "final" / "model.safetensors").is_file()


def test_24_9_sigint_is_one_line_and_exit_130(tmp_path, signals_plugin):
    out = run_cli("fastgrpo.train", [*TOY, f"output_dir={tmp_path}", "max_steps=2",
                                     f"rewards.funcs=[{signals_plugin}:interrupt_trainer]"])
    assert out.returncode == 130
    _one_line_error(out.stderr, "interrupted (SIGINT)")


@pytest.mark.parametrize("override, needle", [
    ("optim.lr=1e39", "optim.lr: must be in (0, 1.0]"),  # overflowed float32 in the optimizer (a traceback)
    ("optim.lr=1e30", "optim.lr: must be in (0, 1.0]"),  # saved 1e30 weights with exit 0
    ("model.lora.alpha=16", "model.lora.rank: is 0 (LoRA off: every weight trains) but model.lora.alpha is set"),
    ("optim.learning_rate=1e-5", "did you mean 'optim.lr'?"),
    ("lora.rank=8", "did you mean 'model.lora.rank'?"),
    ("r=8", "did you mean 'model.lora.rank'?"),
])
def test_24_9_10_config_mistakes_are_one_line_errors_that_name_the_fix(tmp_path, capsys, override, needle):
    assert _main(tmp_path, "max_steps=1", override) == 2
    _one_line_error(capsys.readouterr().err, needle)
    assert not any(tmp_path.iterdir())


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs on this platform")
@pytest.mark.parametrize("given", ["--config", "data.source", "rewards.funcs"])
def test_24_10_a_fifo_given_as_a_file_is_named_as_one(tmp_path, capsys, given):
    fifo = tmp_path / {"--config": "c.yaml", "data.source": "d.jsonl", "rewards.funcs": "r.py"}[given]
    os.mkfifo(fifo)
    argv = {"--config": ["--config", str(fifo), *TOY], "data.source": [*TOY, f"data.source={fifo}"],
            "rewards.funcs": [*TOY, f"rewards.funcs=[{fifo}:f]"]}[given]
    assert train.main([*argv, f"output_dir={tmp_path / 'out'}", "max_steps=1"]) == 2
    _one_line_error(capsys.readouterr().err, f"{str(fifo)!r} is a FIFO (named pipe), not a regular file")


def test_24_10_a_step_larger_than_the_data_is_announced_before_the_model_loads(tmp_path, capsys, monkeypatch):
    _forbid_model_load(monkeypatch)
    with pytest.raises(AssertionError, match="the model must not load"):
        _main(tmp_path, "max_steps=1", "grpo.prompts_per_step=100")
    assert "grpo.prompts_per_step=100 is more than the 36 training rows" in capsys.readouterr().out


def test_cuda_graphs_off_a_cuda_device_is_a_one_line_error_before_the_model_loads(tmp_path, capsys, monkeypatch):
    _forbid_model_load(monkeypatch)
    rc = train.main([*TOY, f"output_dir={tmp_path}", "name=run", "max_steps=1", "parallel.cuda_graphs=true",
                     "parallel.token_buckets=[256]"])
    assert rc == 2
    _one_line_error(capsys.readouterr().err, "parallel.cuda_graphs needs one plain CUDA device")


def test_parallel_settings_that_do_not_fit_the_launch_are_refused_by_the_preflight():
    from fastgrpo.config import load_config
    from fastgrpo.trainers.preflight import check_launch

    cfg = load_config(None, [*TOY, "parallel.master_weights=true"])
    check_launch(cfg, 1, "cpu")  # one process: a plain module
    with pytest.raises(ValueError, match="parallel.master_weights applies to a plain module"):
        check_launch(cfg, 2, "cpu")  # FSDP2 over 2 processes
    with pytest.raises(ValueError, match="parallel.cpu_offload needs FSDP"):
        check_launch(load_config(None, [*TOY, "parallel.cpu_offload=true"]), 1, "cpu")
