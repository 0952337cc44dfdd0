"""PPO with a critic: GAE and the value loss by hand, the critic's packed forward against unpadded
sequences, 1 vs 2 ranks, and the trainer end to end (learning, a sign-flipped control, resume, LoRA, config)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

import dist_helpers as dh
import ppo_dist_helpers as pdh
from _launch import run_ranks
from fastgrpo.config import ConfigError, ParallelConfig, load_config
from fastgrpo.algorithms.critic import attach_value_head, is_value_model, packed_values, value_head_forward
from fastgrpo.distributed.parallelize import parallelize_model
from fastgrpo.distributed.runner import ModelRunner
from fastgrpo.algorithms.ppo import clipped_value_loss, gae, mini_batches, token_rewards, whiten
from fastgrpo.update.step import plan_step
from test_trainer import TOY, _first_token_digit_mass, _rewards

# --------------------------------------------------------------------------------------------------- the maths


def test_gae_matches_a_hand_computed_example():
    # sequence A: 3 tokens, reward 1 on the last; sequence B: 1 token, reward -1. gamma 0.9, lam 0.5 (c = 0.45)
    r = token_rewards(torch.tensor([1.0, -1.0]), [3, 1])
    assert r.tolist() == [0.0, 0.0, 1.0, -1.0]
    v = torch.tensor([0.5, 0.2, 0.4, 0.25])
    adv, ret = gae(r, v, [3, 1], gamma=0.9, lam=0.5)
    # delta_2 = 1 - 0.4 = 0.6; delta_1 = 0.9 * 0.4 - 0.2 = 0.16; delta_0 = 0.9 * 0.2 - 0.5 = -0.32
    # A_2 = 0.6; A_1 = 0.16 + 0.45 * 0.6 = 0.43; A_0 = -0.32 + 0.45 * 0.43 = -0.1265; B: -1 - 0.25 = -1.25
    torch.testing.assert_close(adv, torch.tensor([-0.1265, 0.43, 0.6, -1.25]))
    torch.testing.assert_close(ret, torch.tensor([0.3735, 0.63, 1.0, -1.0]))


def test_gae_with_gamma_and_lam_one_is_the_reward_minus_the_value():
    r = token_rewards(torch.tensor([2.0, -1.0]), [2, 3], kl=torch.tensor([0.1, 0.0, 0.2, 0.5, -0.4]), kl_coef=0.5)
    torch.testing.assert_close(r, torch.tensor([-0.05, 2.0, -0.1, -0.25, -0.8]))  # KL on every token, R on the last
    v = torch.randn(5)
    adv, ret = gae(r, v, [2, 3], gamma=1.0, lam=1.0)
    togo = torch.tensor([1.95, 2.0, -1.15, -1.05, -0.8])  # the rewards summed to the end of each sequence
    torch.testing.assert_close(ret, togo)
    torch.testing.assert_close(adv, togo - v)


def _gae_loop(r: list[float], v: list[float], gamma: float, lam: float) -> list[float]:
    out, last = [0.0] * len(r), 0.0
    for t in reversed(range(len(r))):
        nxt = v[t + 1] if t + 1 < len(r) else 0.0
        last = r[t] + gamma * nxt - v[t] + gamma * lam * last
        out[t] = last
    return out


@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.99, 0.0), (0.9, 1.0)])
def test_gae_equals_the_backward_recursion_on_random_lengths(gamma, lam):
    g = torch.Generator().manual_seed(0)
    lengths = [int(n) for n in torch.randint(1, 40, (7,), generator=g)]
    r, v = torch.randn(sum(lengths), generator=g), torch.randn(sum(lengths), generator=g)
    adv, _ = gae(r, v, lengths, gamma=gamma, lam=lam)
    want, o = [], 0
    for n in lengths:
        want += _gae_loop(r[o:o + n].tolist(), v[o:o + n].tolist(), gamma, lam)
        o += n
    torch.testing.assert_close(adv, torch.tensor(want), rtol=1e-5, atol=1e-5)


def test_gae_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="N=4"):
        gae(torch.zeros(3), torch.zeros(3), [3, 1], gamma=1.0, lam=1.0)


def test_whiten_gives_zero_mean_unit_variance():
    x = torch.randn(101) * 3 + 5
    y = whiten(x)
    assert abs(y.mean().item()) < 1e-5 and abs(y.std().item() - 1) < 1e-4


def test_clipped_value_loss_by_hand():
    v = torch.tensor([0.5, 0.1, -0.3], requires_grad=True)
    old, ret, w = torch.zeros(3), torch.tensor([1.0, 0.0, -0.3]), torch.tensor([1.0, 2.0, 0.0])
    loss, clipfrac = clipped_value_loss(v, old, ret, w, cliprange=0.2)
    # token 0: clipped to 0.2, (0.2 - 1)^2 = 0.64 > (0.5 - 1)^2 = 0.25 -> 0.5 * 0.64; token 1: 2 * 0.5 * 0.01;
    # token 2 has weight 0
    torch.testing.assert_close(loss, torch.tensor(0.32 + 0.01))
    assert clipfrac.item() == pytest.approx(0.5)  # of the two tokens with weight
    loss.backward()
    torch.testing.assert_close(v.grad, torch.tensor([0.0, 0.2, 0.0]))  # the clipped branch passes no gradient


def test_mini_batches_split_every_sequence_once():
    parts = mini_batches(10, 3, torch.Generator().manual_seed(0))
    assert sorted(i for p in parts for i in p) == list(range(10)) and sorted(map(len, parts)) == [3, 3, 4]
    assert all(p == sorted(p) for p in parts)


# --------------------------------------------------------------------------------------------------- the critic


def test_critic_gradient_through_packed_rows_equals_unpadded():
    """Values and the value head's and trunk's gradients from packed rows (several sequences per row, several rows)
    equal those of each sequence run alone without padding."""
    torch.manual_seed(0)
    critic = parallelize_model(attach_value_head(dh.tiny_qwen2(1), seed=5), ParallelConfig(), device="cpu",
                               world_size=1)
    assert is_value_model(critic) and critic.lm_head.weight is not critic.model.embed_tokens.weight
    prompts, completions, _ = dh.problem()
    n_tok = sum(len(c) for c in completions)
    coef = torch.randn(n_tok)  # [N] a weight per token, so every value enters the loss differently
    plan = plan_step(prompts, completions, 40, device="cpu")
    assert len(plan.mbs) > 1 and any(len(mb.seq_indices) > 1 for mb in plan.mbs)
    for mb in plan.mbs:
        ModelRunner(critic).packed_forward(mb, lambda h, w, mb=mb: (value_head_forward(h, w) * coef[mb.flat_index]).sum()
                              ).backward()
    packed = {n: p.grad.clone() for n, p in critic.named_parameters()}
    values = packed_values(critic, plan.mbs, n_tok)
    critic.zero_grad()
    alone, o = [], 0
    for p, c in zip(prompts, completions):
        ids = torch.tensor([p + c])
        hidden = critic.model(input_ids=ids).last_hidden_state[0, len(p) - 1:len(p) + len(c) - 1]  # [L, H]
        v = value_head_forward(hidden, critic.lm_head.weight)
        (v * coef[o:o + len(c)]).sum().backward()
        alone.append(v.detach())
        o += len(c)
    torch.testing.assert_close(values, torch.cat(alone), rtol=1e-5, atol=1e-6)
    for n, p in critic.named_parameters():
        torch.testing.assert_close(packed[n], p.grad, rtol=1e-4, atol=1e-6, msg=n)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """Both scenarios of ppo_dist_helpers (full fine-tuning, LoRA) from one launch of 2 gloo processes."""
    out = tmp_path_factory.mktemp("ppo") / "rank0.pt"
    run_ranks([sys.executable, str(Path(pdh.__file__)), "--out", str(out)], what="PPO FSDP workers", timeout=240)
    return torch.load(out)


@pytest.mark.parametrize("lora", [False, True])
def test_ppo_update_two_ranks_match_one_process(two_ranks, lora):
    """Both models after two PPO epochs (KL in the reward, global whitening, value clipping) under FSDP2 on 2 gloo
    ranks equal the one-process ones, and so do the globally reduced metrics; with LoRA only the adapters and the
    value head train, the reference being the policy with its adapters off."""
    torch.set_num_threads(1)
    policy, critic, ref = pdh.models(1, lora=lora)
    before = {"policy": pdh.full_params(policy), "critic": pdh.full_params(critic)}
    record = pdh.ppo_step(policy, critic, ref, list(range(dh.NUM_SEQS)), budget=25)
    got = two_ranks["lora" if lora else "full"]
    assert got["param_type"] == "DTensor"
    assert record["critic/value_clipfrac"] > 0 and record["policy/clip_low_frac"] + \
        record["policy/clip_high_frac"] > 0  # both clips were exercised
    for name, model in (("policy", policy), ("critic", critic)):
        want = pdh.full_params(model)
        assert got[name].keys() == want.keys()
        for k, v in want.items():
            torch.testing.assert_close(got[name][k], v, rtol=1e-4, atol=1e-6, msg=f"{name} {k}")
        moved = {k for k, v in want.items() if not torch.equal(v, before[name][k])}
        if lora:
            assert moved and all("lora_" in k or (name == "critic" and k.endswith("lm_head.weight")) for k in moved)
        else:
            assert moved == set(want)
    if lora:
        assert any(k.endswith("lm_head.weight") for k, v in pdh.full_params(critic).items()
                   if not torch.equal(v, before["critic"][k]))  # the value head trained
    for k in ("critic/explained_variance", "critic/value_mean", "ppo/return_mean", "critic/loss", "loss"):
        assert got["metrics"][k] == pytest.approx(record[k], rel=1e-4, abs=1e-6), k


# --------------------------------------------------------------------------------------------------- the trainer

PPO_TOY = TOY + ["algorithm=ppo", "ppo.critic_lr=1e-2"]


def _trainer(tmp_path: Path, name: str, *extra: str):
    from fastgrpo.trainers.grpo import Trainer

    return Trainer(load_config(None, PPO_TOY + [f"output_dir={tmp_path}", f"name={name}", *extra]))


def test_ppo_learns_the_toy_task(tmp_path):
    _trainer(tmp_path, "learn", "max_steps=16", "ppo.num_ppo_epochs=2").run()
    rewards = _rewards(tmp_path / "learn")
    assert sum(rewards[:3]) / 3 < 0.3, rewards
    assert sum(rewards[-3:]) / 3 > 0.8, rewards
    rows = [json.loads(x) for x in (tmp_path / "learn" / "metrics.jsonl").read_text().splitlines()]
    assert {"critic/loss", "critic/explained_variance", "critic/value_clipfrac", "critic/grad_norm"} <= set(rows[-1])


def test_flipped_advantage_sign_does_not_learn(tmp_path, monkeypatch):
    """Control for the test above: the same run with every token advantage negated (the critic still fits the true
    returns) drives the digit probability down."""
    import fastgrpo.algorithms.ppo as ppo

    gae_ = ppo.gae
    monkeypatch.setattr(ppo, "gae", lambda *a, **k: (lambda a_r: (-a_r[0], a_r[1]))(gae_(*a, **k)))
    trainer = _trainer(tmp_path, "flip", "max_steps=8", "ppo.num_ppo_epochs=2")
    before = _first_token_digit_mass(trainer)
    trainer.run()
    after = _first_token_digit_mass(trainer)
    assert after < 0.5 * before, (before, after)
    assert max(_rewards(tmp_path / "flip")) < 0.3


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("lora", [False, True])
def test_resume_is_bit_exact_with_both_models(tmp_path, lora):
    """2 steps straight == 1 step, a new Trainer resuming from its checkpoint, 1 more step: the policy, the critic and
    both optimizers' states are bit-identical (with LoRA: adapters and the value head, the only trained weights)."""
    small = ["grpo.prompts_per_step=2", "grpo.num_generations=4", "rollout.max_completion_length=3",
             "ppo.num_mini_batches=2", "ppo.kl_coef=0.1", "checkpoint.every=1"]
    if lora:
        small += ["model.lora.rank=4"]
    straight = _trainer(tmp_path, "straight", "max_steps=2", *small)
    straight.run()
    _trainer(tmp_path, "resumed", "max_steps=1", *small).run()
    resumed = _trainer(tmp_path, "resumed", "max_steps=2", *small)
    assert resumed.step == 1
    resumed.run()
    for name in ("model", "critic"):
        a, b = _state(getattr(straight, name)), _state(getattr(resumed, name))
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]), (name, k)
    for opt in ("optimizer", "critic_optimizer"):
        sa, sb = getattr(straight, opt).state_dict()["state"], getattr(resumed, opt).state_dict()["state"]
        assert sa.keys() == sb.keys() and sa
        assert all(torch.equal(sa[i]["exp_avg_sq"], sb[i]["exp_avg_sq"]) for i in sa)
    if lora:
        trained = [n for n, p in straight.critic.named_parameters() if p.requires_grad]
        assert trained and all("lora_" in n or n.endswith("lm_head.weight") for n in trained)
        assert any(n.endswith("lm_head.weight") for n in trained)  # the value head trains under LoRA
        assert type(straight.ref_model).__name__ == "AdapterDisabled"  # kl_coef > 0: the base as reference


def test_critic_warmup_leaves_the_policy_alone(tmp_path):
    trainer = _trainer(tmp_path, "warm", "max_steps=2", "ppo.critic_warmup_steps=1",
                       "grpo.prompts_per_step=2", "grpo.num_generations=4", "rollout.max_completion_length=3")
    policy0, critic0 = _state(trainer.model), _state(trainer.critic)
    trainer.train_step()
    assert all(torch.equal(v, trainer.model.state_dict()[k]) for k, v in policy0.items())
    assert not all(torch.equal(v, trainer.critic.state_dict()[k]) for k, v in critic0.items())
    trainer.train_step()
    assert not all(torch.equal(v, trainer.model.state_dict()[k]) for k, v in policy0.items())


@pytest.mark.parametrize("override,field", [
    ("grpo.num_iterations=2", "grpo.num_iterations"), ("ppo.gamma=1.5", "ppo.gamma"),
    ("grpo.dynamic_sampling=true", "grpo.dynamic_sampling"), ("ppo.num_mini_batches=100", "ppo.num_mini_batches"),
    ("ppo.critic_warmup_steps=5", "ppo.critic_warmup_steps")])
def test_bad_ppo_settings_are_errors_naming_the_field(override, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_config(None, PPO_TOY + ["max_steps=5", override])


def test_shipped_ppo_configs_load_and_the_gsm8k_one_mirrors_oat():
    assert load_config("configs/tiny-ppo.yaml").algorithm == "ppo"
    cfg = load_config("configs/qwen2.5-1.5b-gsm8k-ppo.yaml")
    # oat's command: --num_samples 8 --temperature 1.2 --top_p 0.9 --beta 1e-4 --num_ppo_epochs 2, and 16 optimizer
    # steps per rollout batch (its max_step_adjustment / critic_max_step_adjustment 16)
    assert (cfg.algorithm, cfg.grpo.num_generations, cfg.rollout.temperature, cfg.rollout.top_p, cfg.grpo.beta,
            cfg.ppo.num_ppo_epochs) == ("ppo", 8, 1.2, 0.9, 1e-4, 2)
    assert cfg.ppo.num_ppo_epochs * cfg.ppo.num_mini_batches == 16
    assert cfg.optim.lr == cfg.ppo.critic_lr == 1e-6 and cfg.ppo.kl_coef == 0


@pytest.mark.parametrize("lora", [False, True])
def test_ppo_trains_both_models_on_bf16_weights_with_masters_and_padded_rows(tmp_path, monkeypatch, lora):
    """Issue 38's update options through PPO's two updates on the CPU: parallel.master_weights (bf16 compute weights,
    float32 masters and moments in MasterAdamW, for the policy and the critic) and parallel.token_buckets (every row
    padded to a bucket), with and without LoRA: both models train, their rows are the buckets' lengths."""
    import fastgrpo.algorithms.ppo as ppo
    from fastgrpo.update.master_weights import MasterAdamW

    rows = []
    plan_step = ppo.plan_step
    monkeypatch.setattr(ppo, "plan_step", lambda *a, **k: (lambda plan: rows.extend(
        mb.num_tokens for mb in plan.mbs) or plan)(plan_step(*a, **k)))
    small = ["grpo.prompts_per_step=2", "grpo.num_generations=4", "rollout.max_completion_length=3",
             "ppo.num_mini_batches=2", "max_steps=2", "parallel.master_weights=true", "parallel.token_buckets=[256,512]"]
    trainer = _trainer(tmp_path, "bf16", *small, *(["model.lora.rank=4"] if lora else []))
    before = {name: _state(getattr(trainer, name)) for name in ("model", "critic")}
    trainer.run()
    assert rows and set(rows) <= {256, 512}, rows
    for name, opt in (("model", "optimizer"), ("critic", "critic_optimizer")):
        model, optimizer = getattr(trainer, name), getattr(trainer, opt)
        assert isinstance(optimizer, MasterAdamW)
        trained = [p for p in model.parameters() if p.requires_grad]
        assert trained and all(p.dtype == torch.bfloat16 for p in trained)
        assert all(optimizer.state[p]["master"].dtype == torch.float32 for p in trained)
        after = _state(model)
        changed = [k for k in after if not torch.equal(after[k], before[name][k])]
        assert changed, f"{name} did not train"
        if lora:
            assert all("lora_" in k or k.endswith("lm_head.weight") for k in changed), changed
    record = json.loads((tmp_path / "bf16" / "metrics.jsonl").read_text().splitlines()[-1])
    assert all(math.isfinite(record[k]) for k in ("loss", "critic/loss", "policy/grad_norm", "critic/grad_norm"))
