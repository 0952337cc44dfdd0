"""The side-by-side benchmark against TRL gives both trainers the same work (benchmarks/peer_work.py).

Runs without TRL: the fastgrpo side is checked through fastgrpo's own config loader; the TRL side through
GRPOConfig only where TRL is installed (the bench environment, `make bench-env`).
"""

import dataclasses

import pytest
import torch
import yaml

from benchmarks import peer_work
from fastgrpo.config import load_config, to_dict


def _spec(name, engine, tmp_path):
    work = peer_work.WORKS[name]
    return peer_work.make_spec(work, model_dir=tmp_path / "model", prompts_file=tmp_path / "p.jsonl", prompt_len=10,
                               engine=engine, run_dir=str(tmp_path / "run"))


@pytest.mark.parametrize("engine", ["hf", "vllm"])
@pytest.mark.parametrize("name", sorted(peer_work.WORKS))
def test_both_configs_ask_for_the_same_grpo_run(name, engine, tmp_path):
    spec = _spec(name, engine, tmp_path)
    path = tmp_path / "fastgrpo.yaml"
    path.write_text(yaml.safe_dump(peer_work.fastgrpo_config(spec)))
    parsed = to_dict(load_config(path))  # what fastgrpo itself reads from the file, after validation
    ours = peer_work.settings_of_fastgrpo(parsed)
    theirs = peer_work.settings_of_trl(peer_work.trl_config(spec))
    assert ours == theirs
    assert ours["sequences_per_step"] == spec["prompts_per_step"] * spec["generations"]
    assert ours["loss_type"] == "dr_grpo" and ours["beta"] == 0.0


@pytest.mark.parametrize("name", sorted(peer_work.WORKS))
def test_trl_reads_the_same_settings(name, tmp_path):
    pytest.importorskip("trl")
    from trl import GRPOConfig

    spec = _spec(name, "hf", tmp_path)
    args = GRPOConfig(**peer_work.trl_config(spec))
    read_back = {f.name: getattr(args, f.name) for f in dataclasses.fields(args)}
    assert peer_work.settings_of_trl(read_back) == peer_work.settings_of_fastgrpo(peer_work.fastgrpo_config(spec))
    assert args.gradient_checkpointing is False and args.steps_per_generation == args.gradient_accumulation_steps


def test_suppress_eos_makes_eos_unreachable_at_unchanged_shapes(tmp_path):
    from transformers import AutoModelForCausalLM

    from fastgrpo.tiny import build_tiny

    folder = build_tiny(cache_dir=tmp_path)
    eos = peer_work.eos_ids_of(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    ids = torch.randint(0, 250, (3, 40), generator=torch.Generator().manual_seed(1))  # [B, T], no EOS inputs
    with torch.no_grad():
        before = model(input_ids=ids).logits.softmax(-1)[..., eos].max()
        peer_work.suppress_eos(model, eos)
        after = model(input_ids=ids).logits.softmax(-1)[..., eos].max()
    assert before > 1e-4  # a random model does emit EOS now and then
    assert after < 1e-15
    assert {k: v.shape for k, v in model.state_dict().items()} == shapes


def test_spread_reward_varies_within_a_group():
    ids = [[3, 5, 7], [3, 5, 8], [9], [100, 2]]
    scores = peer_work.spread_reward(completions=["a"] * 4, completion_ids=ids, nums=[[1]] * 4)
    assert scores == [15 / 100, 16 / 100, 9 / 100, 1 / 100]
    assert len(set(scores)) == len(scores)
