"""Misuse of tools, environments, config changes, run kinds, caches and full disks. Each case is
a one-line error before work starts, a counted failure of one call or trajectory, or a resumable stop; never a
silent wrong result, a traceback or a damaged run folder. One test per item, through the command line where a
user meets it (``fastgrpo.train.main`` / ``fastgrpo.sft.main`` in this process, as tests/test_failures.py does)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fastgrpo import train
from fastgrpo.config import EnvConfig
from fastgrpo.environments import ToolCall, build_environment, parse_qwen_tool_calls

ROOT = Path(__file__).resolve().parents[1]

TOY = ["data.source=toy", "rewards.funcs=[toy_digit]", "model.name_or_path=tiny", "device=cpu",
       "rollout.max_completion_length=3", "grpo.prompts_per_step=2", "grpo.num_generations=2", "optim.lr=1e-2",
       "data.system_prompt=''", "eval.every=-1", "log.progress=false", "checkpoint.export_hf=false"]
"""A GRPO run of seconds on the embedded tiny model."""

ENVS = '''
import math, os, sys
from fastgrpo.environments import Environment

class Exits(Environment):
    def step(self, text):
        raise SystemExit(0)

class TwoTuple(Environment):
    def step(self, text):
        return "a", 1.0

class IntObservation(Environment):
    def step(self, text):
        return 7, None, False

class NanReward(Environment):
    def step(self, text):
        return None, math.nan, True

class HugeIntReward(Environment):
    def step(self, text):
        return None, 10 ** 5000, True

class ResetInt(Environment):
    def reset(self, row):
        return 42
    def step(self, text):
        return None, None, True

class TensorDone(Environment):
    def step(self, text):
        import torch
        return None, None, torch.tensor([True, False])

class NumpyReward(Environment):  # a numpy number is a number: not an error
    def step(self, text):
        import numpy
        return "\\ud800 lone surrogate", numpy.float32(0.5), numpy.bool_(False)

class Mutates(Environment):
    def reset(self, row):
        row["secret"] += 1000  # changes the row it was given
        row["seen"] = True
        return None
    def step(self, text):
        return None, None, True

class AlwaysRight(Environment):
    def reset(self, row):
        return "Guess my number."
    def step(self, text):
        return None, 1.0, True

class LongFirst(Environment):
    def reset(self, row):
        return "x" * 3000
    def step(self, text):
        return None, None, True
'''


@pytest.fixture
def turn_cap(monkeypatch) -> None:
    """Model turns of 2 tokens that end as if the model stopped (a random model rarely samples EOS, and a turn that
    hits the budget ends its trajectory before the environment's step)."""
    from benchmarks.bench_rollout import TurnCap
    from fastgrpo.trainers import grpo

    build = grpo.build_engine
    monkeypatch.setattr(grpo, "build_engine", lambda *a, **k: TurnCap(build(*a, **k), 2))


@pytest.fixture(scope="module")
def envs(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("envs") / "envs.py"
    path.write_text(ENVS)
    return path


def _one_line_error(err: str, *needles: str, prog: str = "fastgrpo") -> str:
    lines = [ln for ln in err.splitlines() if ln.startswith(f"{prog}: ")]
    assert len(lines) == 1 and all(n in lines[0] for n in needles), err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    return lines[0]


def _main(tmp_path: Path, *overrides: str, name: str = "run") -> int:
    return train.main([*TOY, f"output_dir={tmp_path}", f"name={name}", *overrides])


def _records(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


# ---------------------------------------------------------------------------------------------- tools and workers


FORKING_TOOLS = '''
import os, time

def forks(k: int) -> str:
    """Forks, and both processes return.

    Args:
        k: A number.
    """
    if os.fork() == 0:
        return f"child {k}"  # the child answers first
    time.sleep(0.3)
    return f"parent {k}"
'''


def test_a_tool_that_forks_never_delivers_its_results_to_other_calls(tmp_path):
    tools = tmp_path / "forking.py"
    tools.write_text(FORKING_TOOLS)
    factory = build_environment(EnvConfig(name="tools", tools=[f"{tools}:forks"], timeout_s=5, num_workers=1))
    try:
        texts = factory.run([ToolCall(name="forks", arguments={"k": k}) for k in range(4)])
        texts += factory.run([ToolCall(name="forks", arguments={"k": 9})])
    finally:
        factory.close()
    assert texts == [f"parent {k}" for k in (0, 1, 2, 3, 9)]


FORKING_REWARD = '''
import os, time

def forks(completions, k, **kw):
    if os.fork() == 0:
        return [-1.0] * len(completions)  # the child answers first
    time.sleep(0.3)
    return [float(v) for v in k]
'''


def test_a_reward_function_that_forks_never_delivers_its_scores_to_other_calls(tmp_path):
    from fastgrpo.rewards.sandbox import RewardPool

    plugin = tmp_path / "forking_reward.py"
    plugin.write_text(FORKING_REWARD)
    pool = RewardPool([f"{plugin}:forks"], size=1, timeout_s=5)
    try:
        results = pool.run([[(0, {"completions": ["a"], "k": [k]}, 1)] for k in range(4)])
    finally:
        pool.close()
    assert [r[0][0] for r in results] == [[0.0], [1.0], [2.0], [3.0]]


@pytest.mark.parametrize("body", ["[" * 1200 + "]" * 1200, '{"name": "calculator", "arguments": {"x": ' + "7" * 4400
                                  + "}}"])
def test_tool_call_json_nested_1200_deep_or_with_a_4400_digit_int_is_a_parse_failure(body):
    (call,) = parse_qwen_tool_calls(f"<tool_call>{body}</tool_call>")
    assert call.error and call.name == ""


def test_two_tool_files_defining_the_same_function_name_are_a_one_line_error(tmp_path, capsys):
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    for path in (a, b):
        path.write_text('def f(x: int) -> int:\n    """Doubles.\n\n    Args:\n        x: A number.\n    """\n'
                        '    return 2 * x\n')
    rc = _main(tmp_path, "rollout.env.name=tools", f"rollout.env.tools=[{a}:f,{b}:f]", "max_steps=1")
    assert rc == 2
    _one_line_error(capsys.readouterr().err, "rollout.env.tools", str(a), str(b), "'f'")


def test_a_tool_file_hanging_at_import_names_the_tool_timeout_key(tmp_path, capsys, monkeypatch):
    from fastgrpo.environments import tools as tools_module

    monkeypatch.setattr(tools_module, "IMPORT_TIMEOUT_S", 2.0)
    hang = tmp_path / "hang.py"
    hang.write_text("import time\ntime.sleep(600)\ndef f() -> str:\n    return ''\n")
    rc = _main(tmp_path, "rollout.env.name=tools", f"rollout.env.tools=[{hang}:f]", "rollout.env.timeout_s=1",
               "max_steps=1")
    assert rc == 2
    line = _one_line_error(capsys.readouterr().err, "rollout.env.tools", "rollout.env.timeout_s", "tool file")
    assert "reward" not in line


def test_lone_surrogates_in_a_tool_result_or_the_models_tool_call_reach_the_tokenizer_as_text(tmp_path):
    from fastgrpo.config import ModelConfig
    from fastgrpo.environments import step_result
    from fastgrpo.environments.trajectory import ObservationRenderer
    from fastgrpo.models.loading import load_tokenizer

    tools = tmp_path / "echo.py"
    tools.write_text('def echo(text: str) -> str:\n    """Echoes, with a lone surrogate.\n\n    Args:\n'
                     '        text: Anything.\n    """\n    return text + "\\udfff"\n')
    factory = build_environment(EnvConfig(name="tools", tools=[f"{tools}:echo"], timeout_s=5, num_workers=1))
    try:
        env = factory.new()
        model_text = '<tool_call>{"name": "echo", "arguments": {"text": "a\\ud800b"}}</tool_call>'  # JSON escape
        (out,) = env.step_many([env], [model_text])
        result = step_result(out, env)
    finally:
        factory.close()
    render = ObservationRenderer(load_tokenizer(ModelConfig(name_or_path="tiny")), factory.tool_schemas)
    assert result.messages[0]["content"] == "a\ufffdb\ufffd" and render(result.messages)


# ---------------------------------------------------------------------------------------------- environments


@pytest.mark.parametrize("cls, needle", [
    ("Exits", "Exits.step raised SystemExit"),
    ("TwoTuple", "expected (observation, reward, done)"),
    ("IntObservation", "the observation 7"),
    ("NanReward", "the reward nan"),
    ("HugeIntReward", "expected a number"),
    ("ResetInt", "ResetInt.reset returned 42"),
    ("TensorDone", "expected True or False"),
])
def test_an_environment_plugin_that_misbehaves_is_one_line_and_exit_1(tmp_path, capsys, envs, turn_cap, cls,
                                                                      needle):
    rc = _main(tmp_path, f"rollout.env.name={envs}:{cls}", "rollout.max_turns=2", "max_steps=1",
               "rollout.max_completion_length=16")
    assert rc == 1
    _one_line_error(capsys.readouterr().err, f"environment {cls}.", needle)


def test_an_environment_with_numpy_values_and_a_lone_surrogate_trains(tmp_path, capsys, envs, turn_cap):
    rc = _main(tmp_path, f"rollout.env.name={envs}:NumpyReward", "rollout.max_turns=2", "max_steps=1",
               "rollout.max_completion_length=16")
    assert rc == 0, capsys.readouterr().err[-3000:]


def test_an_environment_reset_that_changes_its_row_changes_neither_the_data_nor_the_rewards(tmp_path, capsys, envs,
                                                                                             turn_cap):
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"game {i}", "secret": 5}) + "\n" for i in range(4)))
    plugin = tmp_path / "reward.py"
    plugin.write_text("def secret_reward(completions, secret, **kw):\n    return [float(s) for s in secret]\n")
    rc = _main(tmp_path, f"rollout.env.name={envs}:Mutates", "rollout.max_turns=2", "max_steps=3",
               f"data.source={data}", "data.num_eval=0", "data.template=chat", "grpo.prompts_per_step=4",
               f"rewards.funcs=[{plugin}:secret_reward]")
    assert rc == 0, capsys.readouterr().err[-3000:]
    assert [r["reward/mean"] for r in _records(tmp_path / "run")] == [5.0, 5.0, 5.0]


def test_evaluation_of_a_multi_turn_run_scores_what_training_scores(tmp_path, capsys, envs, turn_cap):
    example = ROOT / "examples" / "guess_number"
    rc = _main(tmp_path, f"rollout.env.name={envs}:AlwaysRight", "rollout.max_turns=2", "max_steps=1",
               f"data.source={example / 'data.jsonl'}", "data.template=chat", "data.num_eval=4", "eval.every=1",
               "eval.num_prompts=4", f"rewards.funcs=[{example / 'reward.py'}:solved]",
               "rollout.max_completion_length=8")
    assert rc == 0, capsys.readouterr().err[-3000:]
    (record,) = _records(tmp_path / "run")
    assert record["reward/mean"] == 1.0 and record["eval/greedy_acc"] == 1.0


def test_an_environments_first_message_longer_than_the_context_is_one_line_not_past_the_positions(
        tmp_path, capsys, envs):
    rc = _main(tmp_path, f"rollout.env.name={envs}:LongFirst", "rollout.max_turns=2", "max_steps=1")
    assert rc == 1
    _one_line_error(capsys.readouterr().err, "LongFirst.reset", "max_position_embeddings")


@pytest.mark.parametrize("overrides, needle", [
    (["rollout.env.name={envs}:AlwaysRight", "rollout.env.kwargs={{lwo: 1}}"], "'lwo'"),
    (["rollout.env.name=tools", "rollout.env.tools=[calculator]", "rollout.env.kwargs={{low: 1}}"],
     "would be ignored"),
    (["rollout.env.kwargs={{low: 1}}"], "would be ignored"),
])
def test_rollout_env_kwargs_an_environment_does_not_take_are_one_line_errors_before_the_model_loads(
        tmp_path, capsys, monkeypatch, envs, overrides, needle):
    from fastgrpo.trainers import loop

    monkeypatch.setattr(loop, "load_model", lambda *a, **k: pytest.fail("the model loaded"))
    rc = _main(tmp_path, "rollout.max_turns=2", *[o.format(envs=envs) for o in overrides])
    assert rc == 2
    _one_line_error(capsys.readouterr().err, "rollout.env.kwargs", needle)


# ---------------------------------------------------------------------------------------------- resume and run kinds


CONSTANT_LR = ["optim.schedule=constant", "optim.warmup_steps=0", "checkpoint.every=1"]


def test_allow_config_change_trains_with_the_new_lr_and_weight_decay_that_config_json_records(tmp_path, capsys):
    from fastgrpo.config import TrainConfig, load_config
    from fastgrpo.trainers.grpo import Trainer

    assert _main(tmp_path, *CONSTANT_LR, "max_steps=1", "optim.lr=1e-2", "optim.weight_decay=0.0") == 0
    new = [*CONSTANT_LR, "optim.lr=5e-3", "optim.weight_decay=0.1", "checkpoint.allow_config_change=true"]
    assert _main(tmp_path, *new, "max_steps=2") == 0, capsys.readouterr().err[-3000:]
    records = _records(tmp_path / "run")
    assert [r["lr"] for r in records] == [1e-2, 5e-3]
    saved = json.loads((tmp_path / "run" / "config.json").read_text())["optim"]
    assert (saved["lr"], saved["weight_decay"]) == (5e-3, 0.1)
    cfg = load_config(None, [*TOY, *new, f"output_dir={tmp_path}", "name=run", "max_steps=3",
                             "optim.lr=2e-3", "optim.weight_decay=0.2"], cls=TrainConfig)
    trainer = Trainer(cfg)  # resumes step 2's optimizer state, with yet another lr and weight decay
    try:
        group = trainer.optimizer.param_groups[0]
        assert (group["lr"], group["initial_lr"], group["weight_decay"]) == (2e-3, 2e-3, 0.2)
        assert trainer.scheduler.base_lrs == [2e-3] * len(trainer.optimizer.param_groups)
        assert trainer.optimizer.state  # the moments were restored
    finally:
        trainer.close()


def _pairs(path: Path, prompt: str = "Say hi:") -> Path:
    path.write_text("".join(json.dumps({"prompt": f"{prompt} {i}", "completion": " hi"}) + "\n"
                            for i in range(8)))
    return path


def _sft(tmp_path: Path, *overrides: str, name: str = "run") -> int:
    from fastgrpo import sft

    return sft.main(["model.name_or_path=tiny", "device=cpu", f"data.source={_pairs(tmp_path / 'pairs.jsonl')}",
                     "data.num_eval=0", "sft.batch_size=2", "log.progress=false", "checkpoint.export_hf=false",
                     f"output_dir={tmp_path}", f"name={name}", *overrides])


@pytest.mark.parametrize("first", ["sft", "grpo"])
def test_an_sft_and_a_grpo_run_never_resume_each_others_checkpoints(tmp_path, capsys, first):
    runs = {"sft": lambda: _sft(tmp_path, "max_steps=1"), "grpo": lambda: _main(tmp_path, "max_steps=1")}
    assert runs[first]() == 0
    capsys.readouterr()
    second = "grpo" if first == "sft" else "sft"
    assert runs[second]() == 2
    _one_line_error(capsys.readouterr().err, f"holds a {first} run", f"this is a {second} run",
                    prog="fastgrpo" if second == "grpo" else "fastgrpo.sft")


class _HalfWrites:
    """A file whose writes of a run's config stop half-way with ENOSPC (a full disk), whichever way it was opened."""

    def __init__(self, f):
        self._f = f

    def write(self, data):
        if '"max_steps"' in (data if isinstance(data, str) else data.decode(errors="ignore")):
            self._f.write(data[:len(data) // 2])
            self._f.flush()
            import errno
            raise OSError(errno.ENOSPC, "No space left on device")
        return self._f.write(data)

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return self._f.__exit__(*exc)


def test_a_full_disk_while_config_json_is_rewritten_leaves_it_whole_and_the_run_resumable(tmp_path, capsys,
                                                                                         monkeypatch):
    import io

    assert _main(tmp_path, "max_steps=1") == 0
    before = (tmp_path / "run" / "config.json").read_text()
    real_open = io.open
    with monkeypatch.context() as m:
        m.setattr(io, "open", lambda *a, **k: _HalfWrites(real_open(*a, **k)))
        rc = _main(tmp_path, "max_steps=2")
    assert rc == 1
    _one_line_error(capsys.readouterr().err, "no space left", "config.json")
    assert (tmp_path / "run" / "config.json").read_text() == before
    assert _main(tmp_path, "max_steps=2") == 0  # room again: the same command resumes
    assert [r["step"] for r in _records(tmp_path / "run")] == [1, 2]


def test_a_full_disk_during_a_checkpoint_save_is_one_line_and_the_rerun_resumes(tmp_path, capsys, monkeypatch):
    import errno

    from torch.distributed.checkpoint.api import CheckpointException

    from fastgrpo.distributed import checkpoint as ckpt

    real_save, calls = ckpt.dcp.save, []

    def save(*a, **k):
        calls.append(1)
        if len(calls) == 2:  # the second checkpoint: step 2
            raise CheckpointException("save", {0: (OSError(errno.ENOSPC, "No space left on device"), None)})
        return real_save(*a, **k)

    monkeypatch.setattr(ckpt.dcp, "save", save)
    assert _main(tmp_path, "max_steps=2", "checkpoint.every=1") == 1
    _one_line_error(capsys.readouterr().err, "no space left", "the checkpoint of step 1 is intact")
    assert [p.name for p in (tmp_path / "run" / "checkpoints").iterdir()] == ["step_000001"]
    monkeypatch.setattr(ckpt.dcp, "save", real_save)
    assert _main(tmp_path, "max_steps=2", "checkpoint.every=1") == 0
    assert "resumed from" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------- SFT


def test_sft_eval_reward_with_an_unknown_name_is_a_one_line_error(tmp_path, capsys):
    assert _sft(tmp_path, "sft.eval_reward=countdwn", "max_steps=1") == 2
    _one_line_error(capsys.readouterr().err, "sft.eval_reward", "did you mean 'countdown'", prog="fastgrpo.sft")


def test_an_empty_sft_prompt_is_a_one_line_error_naming_the_row(tmp_path, capsys):
    from fastgrpo import sft

    data = tmp_path / "empty.jsonl"
    data.write_text(json.dumps({"prompt": "", "completion": "hi"}) + "\n")
    rc = sft.main(["model.name_or_path=tiny", "device=cpu", f"data.source={data}", "data.num_eval=0",
                   "sft.batch_size=1", "log.progress=false", f"output_dir={tmp_path}", "max_steps=1"])
    assert rc == 2
    _one_line_error(capsys.readouterr().err, "row 0 has an empty prompt", prog="fastgrpo.sft")


@pytest.mark.parametrize("module", ["fastgrpo.train", "fastgrpo.sft"])
def test_a_bare_entry_point_asks_for_a_config_instead_of_starting_a_default_run(tmp_path, capsys, monkeypatch,
                                                                                 module):
    import importlib

    monkeypatch.chdir(tmp_path)
    assert importlib.import_module(module).main([]) == 2
    _one_line_error(capsys.readouterr().err, "no config given", prog="fastgrpo" if module == "fastgrpo.train"
                    else "fastgrpo.sft")
    assert not any(tmp_path.iterdir())


# ---------------------------------------------------------------------------------------------- caches


def test_a_tiny_cache_folder_without_tokenizer_json_is_rebuilt(tmp_path, capsys, monkeypatch):
    from fastgrpo.models.tiny import build_tiny

    monkeypatch.setenv("FASTGRPO_CACHE", str(tmp_path / "cache"))
    folder = build_tiny()
    (folder / "tokenizer.json").unlink()
    assert _main(tmp_path, "max_steps=1") == 0, capsys.readouterr().err[-3000:]
    assert (folder / "tokenizer.json").is_file()
    assert _records(tmp_path / "run")[0]["completion/len_mean"] > 0


def test_a_truncated_model_safetensors_in_the_tiny_cache_is_rebuilt(tmp_path, capsys, monkeypatch):
    from fastgrpo.models.tiny import build_tiny

    monkeypatch.setenv("FASTGRPO_CACHE", str(tmp_path / "cache"))
    weights = build_tiny() / "model.safetensors"
    whole = weights.stat().st_size
    with open(weights, "r+b") as f:
        f.truncate(whole // 2)
    assert _main(tmp_path, "max_steps=1") == 0, capsys.readouterr().err[-3000:]
    assert weights.stat().st_size == whole


def test_a_warm_model_folder_without_config_json_is_rebuilt_in_place(tmp_path):
    from fastgrpo.trainers import warm

    final = warm.warm_folder("countdown", tmp_path)
    final.mkdir(parents=True)
    (final / "model.safetensors").write_bytes(b"partial")  # a copy cut short: no config.json, not empty
    path = warm.build_warm("countdown", cache_dir=tmp_path, overrides=["max_steps=1", "sft.batch_size=4",
                                                                        "data.num_train=8", "checkpoint.every=0"])
    assert path == final and (final / "config.json").is_file() and (final / "tokenizer.json").is_file()
    assert not list(tmp_path.glob(".*stale*"))


# ---------------------------------------------------------------------------------------------- wrong words


def test_a_missing_critic_init_folder_is_reported_under_its_own_key(tmp_path, capsys):
    rc = _main(tmp_path, "algorithm=ppo", f"ppo.critic_init={tmp_path / 'nope'}", "max_steps=1")
    assert rc == 2
    line = _one_line_error(capsys.readouterr().err, "ppo.critic_init", "does not exist")
    assert "model.name_or_path" not in line


def test_the_vllm_context_error_does_not_advise_a_null_max_model_len_it_already_has():
    from fastgrpo.rollout.vllm import VLLMEngine

    engine = VLLMEngine.__new__(VLLMEngine)
    engine.max_model_len, engine.derived_context = 100, True
    with pytest.raises(ValueError) as derived:
        engine.check_lengths(90, 20)
    assert "is null" in str(derived.value) and "leave it null" not in str(derived.value)
    engine.derived_context = False
    with pytest.raises(ValueError, match="leave it null"):
        engine.check_lengths(90, 20)


@pytest.mark.parametrize("value", ["~", "null"])
def test_a_null_run_name_is_a_one_line_error_not_a_folder_named_none(tmp_path, capsys, value):
    rc = train.main([*TOY, f"output_dir={tmp_path}", f"name={value}", "max_steps=1"])
    assert rc == 2
    _one_line_error(capsys.readouterr().err, "name: expected a string, got null")
    assert not any(tmp_path.iterdir())


def test_output_dir_with_a_tilde_is_under_the_home_folder(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    rc = train.main([*TOY, "output_dir=~/runs", "name=run", "max_steps=1"])
    assert rc == 0, capsys.readouterr().err[-3000:]
    assert (tmp_path / "home" / "runs" / "run" / "metrics.jsonl").is_file() and not (tmp_path / "~").exists()


def test_a_truncated_model_safetensors_in_a_local_model_folder_is_one_line_naming_it(tmp_path, capsys):
    import shutil

    from fastgrpo.models.tiny import build_tiny

    folder = tmp_path / "model"
    shutil.copytree(build_tiny(), folder)
    weights = folder / "model.safetensors"
    with open(weights, "r+b") as f:
        f.truncate(weights.stat().st_size - 100)
    rc = _main(tmp_path, f"model.name_or_path={folder}", "max_steps=1")
    assert rc == 2
    _one_line_error(capsys.readouterr().err, "model.name_or_path", "model.safetensors is truncated")
