"""End-to-end trainer tests on the embedded tiny model (CPU)."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fastgrpo.config import load_config
from fastgrpo.trainer import Trainer

# The learning task: a prompt asks for a number; reward 1 when the completion starts with a digit. The random tiny
# model starts well below 0.3 (a digit is ~10 of ~100 tokens), so a rise above 0.8 needs the sign of the policy
# gradient, the completion-only masking and the group advantages all to be right.
TOY = ["data.source=toy", "rewards.funcs=[toy_digit]", "model.name_or_path=tiny", "device=cpu",
       "rollout.max_completion_length=4", "grpo.prompts_per_step=8", "grpo.num_generations=8",
       "optim.lr=1e-2", "data.system_prompt=''", "optim.warmup_steps=0", "optim.schedule=constant", "grpo.loss_type=dapo",
       "eval.every=-1", "log.progress=false", "checkpoint.export_hf=false", "log.completions_per_step=2"]


def _rewards(run_dir: Path) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["reward/mean"] for r in rows]


def test_grpo_learns_the_toy_task(tmp_path):
    cfg = load_config(None, TOY + [f"output_dir={tmp_path}", "name=learn", "max_steps=20"])
    Trainer(cfg).run()
    rewards = _rewards(tmp_path / "learn")
    start, end = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert start < 0.3, rewards
    assert end > 0.8, rewards
    comps = [json.loads(x) for x in (tmp_path / "learn" / "completions.jsonl").read_text().splitlines()]
    assert {"prompt", "completion", "rewards", "advantage"} <= set(comps[0])


def test_flipped_advantage_sign_unlearns(tmp_path):
    """Control for the test above: rewarding the opposite behaviour drives the digit rate down, not up."""
    cfg = load_config(None, TOY + [f"output_dir={tmp_path}", "name=neg", "max_steps=12", "rewards.weights=[-1.0]"])
    Trainer(cfg).run()
    rewards = [-r for r in _rewards(tmp_path / "neg")]  # digit rate
    assert sum(rewards[-3:]) / 3 < 0.05, rewards


def _cli(args: list[str], env_extra: dict | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, **(env_extra or {}))
    return subprocess.run([sys.executable, "-m", "fastgrpo.train", *args], capture_output=True, text=True, env=env,
                          timeout=300)


def test_sigkill_mid_step_then_resume_matches_uninterrupted_run(tmp_path):
    common = TOY + [f"output_dir={tmp_path}", "max_steps=4", "checkpoint.every=1", "checkpoint.export_hf=true",
                    "rollout.max_completion_length=3", "grpo.prompts_per_step=4", "grpo.num_generations=4"]
    ref = _cli(common + ["name=straight"])
    assert ref.returncode == 0, ref.stderr[-2000:]

    killed = _cli(common + ["name=killed"], {"FASTGRPO_FAULT_KILL_AT_STEP": "3"})
    assert killed.returncode == -signal.SIGKILL
    ckpts = sorted(p.name for p in (tmp_path / "killed" / "checkpoints").iterdir())
    assert ckpts[-1] == "step_000002"  # at most the step in flight was lost
    resumed = _cli(common + ["name=killed"])
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resumed from" in resumed.stdout

    a = load_file(tmp_path / "straight" / "final" / "model.safetensors")
    b = load_file(tmp_path / "killed" / "final" / "model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    steps = [json.loads(x)["step"] for x in (tmp_path / "killed" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]
