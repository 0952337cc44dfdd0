"""The whole trainer under torchrun with 2 gloo processes (FSDP2), and a checkpoint resumed on 1 process."""

import json
import math
import os
import subprocess
import sys

import pytest
import torch.distributed as dist
from _launch import free_port

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")

ARGS = ["data.source=toy", "rewards.funcs=[toy_digit]", "model.name_or_path=tiny", "device=cpu",
        "rollout.max_completion_length=3", "grpo.prompts_per_step=2", "grpo.num_generations=4",
        "optim.lr=1e-2", "data.system_prompt=''", "log.progress=false",
        "grpo.max_tokens_per_microbatch=64", "checkpoint.every=1",
        "eval.every=2", "eval.num_prompts=3", "eval.best_of_n=2"]


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=400)


def test_two_process_fsdp_training_then_resume_on_one_process(tmp_path):
    out = [f"output_dir={tmp_path}", "name=dist"]
    two = _run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                str(free_port()), "-m", "fastgrpo.train", *ARGS, *out, "max_steps=2", "checkpoint.export_hf=false"])
    assert two.returncode == 0, two.stderr[-3000:]
    rows = [json.loads(x) for x in (tmp_path / "dist" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert 0 <= rows[1]["eval/greedy_acc"] <= 1 and "eval/best_of_2" in rows[1]  # 3 prompts over 2 ranks
    # both ranks' sequences count in the global normalisers: 2 ranks x 2 prompts x 4 completions x 3 tokens
    assert rows[0]["perf/update_tokens"] > 0
    ckpt = tmp_path / "dist" / "checkpoints" / "step_000002"
    assert (ckpt / "rng_rank0.pt").is_file() and (ckpt / "rng_rank1.pt").is_file()

    one = _run([sys.executable, "-m", "fastgrpo.train", *ARGS, *out, "max_steps=3"])
    assert one.returncode == 0, one.stderr[-3000:]
    assert "resumed from" in one.stdout and "step_000002" in one.stdout
    rows = [json.loads(x) for x in (tmp_path / "dist" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    # the export is a Hugging Face folder that from_pretrained loads, tokenizer included
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "dist" / "final")
    tok = AutoTokenizer.from_pretrained(tmp_path / "dist" / "final")
    assert len(tok) == model.config.vocab_size


def test_torchrun_with_one_process_runs_like_python_dash_m(tmp_path):
    out = _run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--master-port",
                str(free_port()), "-m", "fastgrpo.train", *ARGS, f"output_dir={tmp_path}", "name=one",
                "max_steps=1", "eval.every=-1", "checkpoint.export_hf=false"])
    assert out.returncode == 0, out.stderr[-3000:]
    assert (tmp_path / "one" / "checkpoints" / "step_000001").is_dir()


CHAOS = '''
import math, os, time

def chaos(completions, **kw):
    if os.environ["RANK"] == "0":
        time.sleep(600)  # hangs: the sandbox kills it after rewards.timeout_s
    return [-math.inf] + [1.0] * (len(completions) - 1)
'''


def test_a_hanging_reward_on_one_rank_and_inf_on_the_other_cannot_stop_or_poison_the_run(tmp_path):
    import torch
    from safetensors.torch import load_file

    plugin = tmp_path / "chaos.py"
    plugin.write_text(CHAOS)
    out = _run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                str(free_port()), "-m", "fastgrpo.train", *ARGS, f"output_dir={tmp_path}", "name=chaos",
                "max_steps=2", "eval.every=-1", "checkpoint.every=0", f"rewards.funcs=[{plugin}:chaos,toy_digit]",
                "rewards.timeout_s=1"])
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(x) for x in (tmp_path / "chaos" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    # per step: rank 0's call timed out (its 2 prompts x 4 completions), rank 1's first value was -inf
    assert [r["reward/chaos/errors"] for r in rows] == [9.0, 9.0]
    assert all(r["reward/toy_digit/errors"] == 0 for r in rows)
    assert all(math.isfinite(r["reward/mean"]) and math.isfinite(r["policy/grad_norm"]) for r in rows)
    assert "did not finish within rewards.timeout_s=1 s" in out.stderr and "returned -inf" in out.stderr
    weights = load_file(tmp_path / "chaos" / "final" / "model.safetensors")
    assert all(torch.isfinite(t).all() for t in weights.values())


def test_two_processes_with_dynamic_sampling_and_the_algorithm_choices(tmp_path):
    """Dynamic sampling's extra rounds are agreed over ranks (batch-std scaling and the update issue collectives),
    so 2 processes whose groups differ finish without a deadlock; GSPO, truncation masking, self-imitation and the
    entropy mask run under FSDP too."""
    out = _run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                str(free_port()), "-m", "fastgrpo.train", *ARGS, f"output_dir={tmp_path}", "name=algos",
                "max_steps=2", "eval.every=-1", "checkpoint.export_hf=false", "grpo.scale_rewards=batch",
                "grpo.dynamic_sampling=true", "grpo.dynamic_sampling_max_rounds=3",
                "grpo.importance_sampling_level=sequence", "grpo.mask_truncated_completions=true",
                "grpo.sil_top_k=1", "grpo.top_entropy_quantile=0.5"])
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(x) for x in (tmp_path / "algos" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(0 <= r["sampling/extra_rounds"] <= 3 and "policy/entropy" in r for r in rows)
