"""Each choice has one home: config's choice fields read the component registries (or are closed Literals that the
component implements), and a name registered in one place is accepted by config with no other edit."""

from __future__ import annotations

import dataclasses
import typing

import pytest
import torch

from fastgrpo import config as C
from fastgrpo.config import ConfigError, describe, load_config


def _choice_fields(cls=C.TrainConfig, prefix=""):
    """(section class, field name, dotted key) of every Literal or registry field, nested sections included."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            yield from _choice_fields(hints[f.name], f"{prefix}{f.name}.")
        elif C.choices(cls, f.name) is not None:
            yield cls, f.name, prefix + f.name


def _registries():
    from fastgrpo import kernels, rewards, rollout
    from fastgrpo.models import attention
    from fastgrpo.algorithms import losses
    from fastgrpo.runtime import sinks
    from fastgrpo.data import templates

    return {
        "model.attn_implementation": ["auto", *attention.ATTN_BACKENDS],
        "data.template": list(templates.TEMPLATES),
        "rewards.funcs": list(rewards.REWARDS),
        "rollout.engine": list(rollout.ENGINES),
        "grpo.loss_type": list(losses.LOSS_TYPES),
        "grpo.head_backend": list(kernels.BACKENDS),
        "log.report_to": list(sinks.SINKS),
    }


def test_every_registry_field_lists_exactly_its_registry():
    found = {key: C.choices(cls, name) for cls, name, key in _choice_fields()}
    for key, names in _registries().items():
        assert found[key] == names, key
    assert {"model.dtype", "rollout.vllm.sleep_level", "grpo.scale_rewards", "optim.schedule", "parallel.param_dtype",
            "device"} <= set(found)


def test_literal_choices_are_what_the_components_implement():
    from fastgrpo.algorithms.advantages import compute_advantages
    from fastgrpo.models.loading import resolve_dtype
    from fastgrpo.distributed.parallelize import _DTYPES
    from fastgrpo.trainers.grpo import build_scheduler

    for scale in C.choices(C.GRPOConfig, "scale_rewards"):
        compute_advantages(torch.tensor([0.0, 1.0, 1.0, 3.0]), 2, scale=scale)
    with pytest.raises(ValueError):
        compute_advantages(torch.tensor([0.0, 1.0]), 2, scale="other")
    assert set(C.choices(C.ParallelConfig, "param_dtype")) == set(_DTYPES)
    assert set(C.choices(C.ParallelConfig, "reduce_dtype")) == set(_DTYPES)
    for dtype in C.choices(C.ModelConfig, "dtype"):
        resolve_dtype(dtype, "cpu")
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    factors = {s: build_scheduler(opt, warmup_steps=0, total_steps=4, schedule=s, min_lr_ratio=0.0).lr_lambdas[0](3)
               for s in C.choices(C.OptimConfig, "schedule")}
    assert factors["constant"] == 1.0 and factors["cosine"] < 1.0


@pytest.mark.parametrize("cls,name,key", list(_choice_fields()), ids=lambda x: x if isinstance(x, str) else "")
def test_choice_fields_reject_an_unknown_name_with_the_choices(cls, name, key):
    value = "[nope]" if key in ("rewards.funcs", "log.report_to") else "nope"
    with pytest.raises(ConfigError, match=rf"{key.replace('.', '[.]')}.*nope"):
        load_config(None, [f"{key}={value}"])


def test_help_config_lists_the_choices_of_a_registry_field():
    text = describe()
    block = text[text.index("grpo.loss_type"):]
    assert "choices: grpo, dapo, bnpo, dr_grpo" in block.split("\ngrpo.")[0]


def test_registering_a_name_in_one_place_makes_config_accept_it():
    """A new loss type, reward, rollout engine and attention backend: one registration each, here in the test."""
    from fastgrpo import rewards, rollout
    from fastgrpo.models import attention
    from fastgrpo.algorithms import losses
    from fastgrpo.rollout import RolloutEngine

    new = ["grpo.loss_type=seq_mean", "rewards.funcs=[length_bonus]", "rollout.engine=scripted",
           "model.attn_implementation=my_attn"]
    for item in new:
        with pytest.raises(ConfigError, match=item.split("=")[0].replace(".", "[.]")):
            load_config(None, [item])

    @losses.register_loss_type("seq_mean")
    def _seq_mean(lengths, counts):
        return 1.0 / (counts.num_sequences * lengths.float())

    @rewards.register_reward("length_bonus")
    def _length_bonus(completions, **kwargs):
        return [float(len(c)) for c in completions]

    @rollout.register_engine("scripted")
    class _Scripted(RolloutEngine):
        def generate(self, prompts, n, sampling):
            return []

        def update_weights(self, named_tensors):
            pass

    attention.register_attn_backend("my_attn", attention.AttnBackend())
    try:
        cfg = load_config(None, new)
        assert (cfg.grpo.loss_type, cfg.rewards.funcs, cfg.rollout.engine, cfg.model.attn_implementation) == (
            "seq_mean", ["length_bonus"], "scripted", "my_attn")
        assert "seq_mean" in describe() and "my_attn" in describe()
        # ... and the components use them: the loss type gives token weights, the reward loads by name
        lengths = torch.tensor([2, 3])
        w = losses.token_weights("seq_mean", lengths, losses.GlobalCounts(num_sequences=2, num_tokens=5,
                                                                          max_completion_length=4))
        assert w.tolist() == pytest.approx([0.25, 0.25, 1 / 6, 1 / 6, 1 / 6])
        assert rewards.load_reward_funcs(["length_bonus"])[0][1] is _length_bonus
        assert attention.choose_attn_implementation("my_attn", "cpu") == "my_attn"
    finally:
        losses.LOSS_TYPES.pop("seq_mean", None)
        rewards.REWARDS.pop("length_bonus", None)
        rollout.ENGINES.pop("scripted", None)
        attention.ATTN_BACKENDS.pop("my_attn", None)
