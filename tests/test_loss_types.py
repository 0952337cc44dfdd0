"""TRL 1.16's loss types in fastgrpo's own trainer: each one registration (normaliser and per-token term), the term
parameters under ``grpo.`` as TRL names them, and the update's rule that the entropy mask weights the policy term
only (the KL keeps the plain normaliser), checked against a per-sequence oracle built on the reference loss."""

import pytest
import torch
from dist_helpers import problem, tiny_qwen2

from fastgrpo.config import ConfigError, GRPOConfig, ParallelConfig, RolloutConfig, load_config
from fastgrpo.kernels import reference_linear_grpo_loss, reference_linear_logprobs
from fastgrpo.algorithms.losses import LOSS_TYPES, POLICY_LOSS_OF, GlobalCounts, token_weights
from fastgrpo.runtime.metrics import StepMetrics
from fastgrpo.distributed.parallelize import parallelize_model
from fastgrpo.algorithms.grpo import GRPOBatch, entropy_mask, grpo_update

LR = 0.5


def test_each_trl_loss_type_is_one_registration_of_normaliser_and_term():
    assert set(POLICY_LOSS_OF) == set(LOSS_TYPES)
    assert {k: POLICY_LOSS_OF[k] for k in ("grpo", "dapo", "bnpo", "dr_grpo", "luspo", "cispo", "sapo")} == {
        "grpo": "clip", "dapo": "clip", "bnpo": "clip", "dr_grpo": "clip", "luspo": "clip", "cispo": "cispo",
        "sapo": "sapo"}
    lengths = torch.tensor([3, 1, 4])
    counts = GlobalCounts(num_sequences=5, num_tokens=20, max_completion_length=8)
    weights = {name: token_weights(name, lengths, counts) for name in ("grpo", "dapo", "luspo", "cispo", "sapo")}
    assert torch.equal(weights["cispo"], weights["dapo"]) and torch.equal(weights["sapo"], weights["grpo"])
    torch.testing.assert_close(weights["luspo"], torch.full((8,), 1 / 5))  # sequence sums, then the batch mean
    torch.testing.assert_close(weights["dapo"], torch.full((8,), 1 / 20))


def test_config_takes_trls_names_and_refuses_bad_term_parameters():
    cfg = load_config(None, ["grpo.loss_type=sapo", "grpo.sapo_temperature_neg=2.0",
                             "grpo.use_bias_correction_kl=false"])
    assert (cfg.grpo.loss_type, cfg.grpo.sapo_temperature_neg, cfg.grpo.use_bias_correction_kl) == ("sapo", 2.0,
                                                                                                     False)
    assert load_config(None, []).grpo.use_bias_correction_kl  # TRL's default
    with pytest.raises(ConfigError, match="grpo.epsilon_high.*cispo"):
        load_config(None, ["grpo.loss_type=cispo", "grpo.epsilon_high=0"])
    with pytest.raises(ConfigError, match="grpo.sapo_temperature_pos"):
        load_config(None, ["grpo.sapo_temperature_pos=0"])


def _oracle(model, ref_model, prompts, completions, adv, *, grpo: GRPOConfig, iterations):
    """SGD updates computed sequence by sequence (no packing) with the reference loss: policy weights = the loss
    type's normaliser times the entropy mask, KL weights = the normaliser alone (TRL's rule)."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    lengths = [len(c) for c in completions]
    S = len(lengths)

    def hidden_of(m):
        hs = []
        for i in range(S):
            ids = torch.tensor([prompts[i] + completions[i]])
            P, L = len(prompts[i]), lengths[i]
            hs.append(m.model(input_ids=ids).last_hidden_state[0, P - 1:P + L - 1])  # [L, H]
        return torch.cat(hs)

    targets = torch.tensor([t for c in completions for t in c])
    if grpo.loss_type == "sapo":  # grpo's normaliser
        norm = torch.cat([torch.full((L,), 1.0 / (S * L)) for L in lengths])
    else:  # cispo: dapo's
        norm = torch.full((sum(lengths),), 1.0 / sum(lengths))
    with torch.no_grad():
        old, ent = reference_linear_logprobs(hidden_of(model), model.lm_head.weight, targets, return_entropy=True)
        ref = reference_linear_logprobs(hidden_of(ref_model), ref_model.lm_head.weight, targets)
    keep, _ = entropy_mask(ent, norm != 0, grpo.top_entropy_quantile)
    for _ in range(iterations):
        opt.zero_grad()
        loss, _ = reference_linear_grpo_loss(
            hidden_of(model), model.lm_head.weight, targets, torch.repeat_interleave(adv, torch.tensor(lengths)),
            norm * keep, kl_token_weights=norm, old_logprobs=old, ref_logprobs=ref, beta=grpo.beta,
            epsilon_low=grpo.epsilon_low, epsilon_high=grpo.epsilon_high, policy_loss=grpo.loss_type,
            sapo_temperature_pos=grpo.sapo_temperature_pos, sapo_temperature_neg=grpo.sapo_temperature_neg,
            use_bias_correction_kl=grpo.use_bias_correction_kl)
        loss.backward()
        opt.step()


@pytest.mark.parametrize("case", [dict(loss_type="cispo", epsilon_high=1.02),
                                  dict(loss_type="sapo", sapo_temperature_neg=2.0, use_bias_correction_kl=False)],
                         ids=["cispo-biascorr", "sapo-plain-kl"])
def test_grpo_update_weights_the_kl_by_the_plain_normaliser(case):
    prompts, completions, adv = problem(seed=4)
    grpo = GRPOConfig(max_tokens_per_microbatch=40, head_backend="torch", num_iterations=2, num_generations=5,
                      beta=0.2, top_entropy_quantile=0.5, **case)
    model = parallelize_model(tiny_qwen2(), ParallelConfig(), device="cpu", world_size=1)
    ref_model = parallelize_model(tiny_qwen2(seed=1), ParallelConfig(), device="cpu", world_size=1)
    metrics = StepMetrics()
    grpo_update(model, GRPOBatch(prompt_ids=prompts, completion_ids=completions, advantages=adv), grpo=grpo,
                rollout=RolloutConfig(max_completion_length=16), optimizer=torch.optim.SGD(model.parameters(), lr=LR),
                max_grad_norm=0.0, metrics=metrics, device="cpu", ref_model=ref_model)
    oracle = tiny_qwen2()
    _oracle(oracle, tiny_qwen2(seed=1), prompts, completions, adv, grpo=grpo, iterations=2)
    for (name, p), (_, q) in zip(model.named_parameters(), oracle.named_parameters()):
        torch.testing.assert_close(p, q, rtol=2e-4, atol=2e-6, msg=name)
    rec = metrics.reduce()
    assert rec["policy/kl_mean"] > 0
    if case["loss_type"] == "cispo":  # the truncation bound binds in the second update
        assert rec["policy/cispo_clip_frac"] > 0
