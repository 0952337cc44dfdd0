"""The algorithm choices of the GRPO update, each against a value computed independently:
GSPO (sequence-level importance sampling), mask_truncated_completions, self-imitation on the k best of n, the
top-entropy-quantile mask (DAPO's dynamic sampling: test_sampling.py).

The update tests run ``fastgrpo.algorithms.grpo.grpo_update`` (the trainer's) on a tiny Qwen2 with several micro-batches
and compare the parameters after two SGD updates with an oracle: plain torch, one sequence at a time (no
packing), with the float64-checked reference loss and token weights written out by hand."""

import math

import pytest
import torch
from dist_helpers import problem, tiny_qwen2

from fastgrpo.algorithms.advantages import self_imitation_mask
from fastgrpo.config import GRPOConfig, ParallelConfig, RolloutConfig
from fastgrpo.kernels import reference_linear_grpo_loss, reference_linear_logprobs
from fastgrpo.runtime.metrics import StepMetrics
from fastgrpo.distributed.parallelize import parallelize_model
from fastgrpo.algorithms.grpo import GRPOBatch, entropy_mask, grpo_update

LR = 0.5


def test_self_imitation_mask_by_hand():
    r = torch.tensor([1.0, 0.0, 2.0, 2.0, 0.0, 0.0, 0.0, 0.0, 3.0, 1.0, 1.0, 0.0])
    # group 0 mean 1.25: eligible 2, 3 -> both; group 1: all equal -> none; group 2 mean 1.25: only 8
    assert self_imitation_mask(r, 4, 2).tolist() == [False, False, True, True] + [False] * 4 + \
        [True, False, False, False]
    # threshold 1.0, k = 3: group 0 -> 2, 3, 0; group 2 -> 8 then the earlier of the tied 9, 10
    assert self_imitation_mask(r, 4, 3, 1.0).tolist() == [True, False, True, True] + [False] * 4 + \
        [True, True, True, False]
    assert self_imitation_mask(r, 4, 1, 1.0).tolist() == [False, False, True, False] + [False] * 4 + \
        [True, False, False, False]


def test_entropy_mask_by_hand():
    ent = torch.tensor([0.1, 0.5, 0.9, 0.3, 7.0])
    counted = torch.tensor([True, True, True, True, False])
    keep, thr = entropy_mask(ent, counted, 0.5)  # median of 0.1, 0.3, 0.5, 0.9 (linear) = 0.4
    assert thr.item() == pytest.approx(0.4)
    assert keep.tolist() == [False, True, True, False, False]  # the uncounted token stays out


def _oracle(model, prompts, completions, adv, *, grpo: GRPOConfig, seq_mask, sil_mask, iterations):
    """Two SGD updates computed sequence by sequence (no packing), token weights written out by hand (dapo)."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    lengths = [len(c) for c in completions]
    kept_tokens = sum(L for L, k in zip(lengths, seq_mask) if k)
    a = adv.clone() + grpo.sil_coef * sil_mask.float()

    def per_seq(i):
        ids = torch.tensor([prompts[i] + completions[i]])
        P, L = len(prompts[i]), lengths[i]
        hidden = model.model(input_ids=ids).last_hidden_state[0, P - 1:P + L - 1]  # [L, H]
        return hidden, torch.tensor(completions[i])

    def loss_terms():
        hs, ts = zip(*(per_seq(i) for i in range(len(prompts))))
        hidden, targets = torch.cat(hs), torch.cat(ts)
        w = torch.cat([torch.full((L,), (1.0 / kept_tokens) if k else 0.0) for L, k in zip(lengths, seq_mask)])
        return hidden, targets, w

    with torch.no_grad():
        hidden, targets, w = loss_terms()
        old, ent = reference_linear_logprobs(hidden, model.lm_head.weight, targets, return_entropy=True)
    if grpo.top_entropy_quantile < 1:
        keep, _ = entropy_mask(ent, w != 0, grpo.top_entropy_quantile)
        w = w * keep
    seq_index = torch.cat([torch.full((L,), i) for i, L in enumerate(lengths)])
    sequence = grpo.importance_sampling_level == "sequence"
    eps = (grpo.sequence_epsilon_low, grpo.sequence_epsilon_high) if sequence else (grpo.epsilon_low,
                                                                                     grpo.epsilon_high)
    for _ in range(iterations):
        opt.zero_grad()
        hidden, targets, _ = loss_terms()
        loss, _ = reference_linear_grpo_loss(
            hidden, model.lm_head.weight, targets, torch.repeat_interleave(a, torch.tensor(lengths)), w,
            old_logprobs=old, epsilon_low=eps[0], epsilon_high=eps[1],
            sequence_index=seq_index if sequence else None)
        loss.backward()
        opt.step()


@pytest.mark.parametrize("case", [
    dict(importance_sampling_level="sequence", sequence_epsilon_low=0.05, sequence_epsilon_high=0.08),
    dict(mask_truncated_completions=True),
    dict(sil_top_k=2, sil_coef=0.5),
    dict(top_entropy_quantile=0.4),
], ids=["gspo", "mask_truncated", "sil", "top_entropy"])
def test_grpo_update_equals_the_per_sequence_oracle(case):
    prompts, completions, adv = problem(seed=3)
    S = len(prompts)
    seq_mask = torch.tensor([i % 3 != 1 for i in range(S)]) if case.get("mask_truncated_completions") else \
        torch.ones(S, dtype=torch.bool)
    rewards = torch.arange(S, dtype=torch.float32) % 4  # groups of 5: [0 1 2 3 0], [1 2 3 0 1]
    sil_mask = self_imitation_mask(rewards, 5, case["sil_top_k"]) if case.get("sil_top_k") else \
        torch.zeros(S, dtype=torch.bool)
    grpo = GRPOConfig(loss_type="dapo", max_tokens_per_microbatch=40, head_backend="torch", num_iterations=2,
                      num_generations=5, epsilon_low=0.05, epsilon_high=0.05, **case)
    model = parallelize_model(tiny_qwen2(), ParallelConfig(), device="cpu", world_size=1)
    metrics = StepMetrics()
    mbs = grpo_update(model, GRPOBatch(prompt_ids=prompts, completion_ids=completions, advantages=adv,
                                       sequence_mask=seq_mask if case.get("mask_truncated_completions") else None,
                                       sil_mask=sil_mask if case.get("sil_top_k") else None),
                      grpo=grpo, rollout=RolloutConfig(max_completion_length=16),
                      optimizer=torch.optim.SGD(model.parameters(), lr=LR), max_grad_norm=0.0, metrics=metrics,
                      device="cpu")
    assert len(mbs) >= 3  # sequences spread over several micro-batches
    oracle = tiny_qwen2()
    _oracle(oracle, prompts, completions, adv, grpo=grpo, seq_mask=seq_mask, sil_mask=sil_mask,
            iterations=2)
    start = tiny_qwen2()
    moved = 0.0
    for (name, p), (_, q), (_, p0) in zip(model.named_parameters(), oracle.named_parameters(),
                                         start.named_parameters()):
        torch.testing.assert_close(p, q, rtol=2e-4, atol=2e-6, msg=name)
        moved = max(moved, float((q - p0).detach().abs().max()))
    assert moved > 1e-4  # the update did something
    rec = metrics.reduce()
    assert 0 < rec["policy/entropy"] < math.log(131) + 1e-4  # logged every update
    if case.get("top_entropy_quantile"):
        assert rec["policy/entropy_kept_frac"] == pytest.approx(0.4, abs=0.05)


def test_gspo_differs_from_token_level_after_the_first_update():
    """Control: the oracle comparison above would pass vacuously if both levels trained alike."""
    prompts, completions, adv = problem(seed=3)
    out = []
    for level in ("token", "sequence"):
        model = parallelize_model(tiny_qwen2(), ParallelConfig(), device="cpu", world_size=1)
        grpo_update(model, GRPOBatch(prompt_ids=prompts, completion_ids=completions, advantages=adv),
                    grpo=GRPOConfig(loss_type="dapo", head_backend="torch", num_iterations=2,
                                    importance_sampling_level=level, sequence_epsilon_low=0.05,
                                    sequence_epsilon_high=0.08, epsilon_low=0.05, epsilon_high=0.08),
                    rollout=RolloutConfig(max_completion_length=16),
                    optimizer=torch.optim.SGD(model.parameters(), lr=LR), max_grad_norm=0.0, metrics=StepMetrics(),
                    device="cpu")
        out.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    assert (out[0] - out[1]).abs().max() > 1e-4


def test_trainer_runs_with_every_algorithm_choice(tmp_path):
    import json

    from fastgrpo.config import load_config
    from fastgrpo.trainers.grpo import Trainer

    cfg = load_config(None, [
        "data.source=toy", "rewards.funcs=[toy_digit]", "device=cpu", "rollout.max_completion_length=3",
        "grpo.prompts_per_step=2", "grpo.num_generations=4", "eval.every=-1", "log.progress=false",
        "checkpoint.export_hf=false", f"output_dir={tmp_path}", "name=algos", "max_steps=2",
        "grpo.importance_sampling_level=sequence", "grpo.dynamic_sampling=true", "grpo.dynamic_sampling_max_rounds=2",
        "grpo.mask_truncated_completions=true", "grpo.sil_top_k=1", "grpo.top_entropy_quantile=0.5",
        "grpo.num_iterations=2"])
    Trainer(cfg).run()
    rec = [json.loads(x) for x in (tmp_path / "algos" / "metrics.jsonl").read_text().splitlines()][-1]
    for key in ("sampling/extra_rounds", "sampling/dropped_groups", "policy/entropy", "policy/masked_seq_frac",
                "policy/sil_frac", "policy/entropy_threshold"):
        assert key in rec and math.isfinite(rec[key]), key
    assert 0 <= rec["sampling/extra_rounds"] <= 2
    assert rec["policy/masked_seq_frac"] > 0  # 3 tokens: the random tiny model rarely stops that early
