"""optim.implementation: fused AdamW on CUDA by default, foreach elsewhere, either by choice; a config key."""

import pytest
import torch

from fastgrpo.config import ConfigError, OptimConfig, RESUMABLE_KEYS, load_config
from fastgrpo.update.optim import adamw_implementation, build_adamw


def test_auto_is_fused_on_cuda_and_foreach_on_a_cpu():
    assert adamw_implementation("auto", "cuda") == "fused"
    assert adamw_implementation("auto", torch.device("cuda", 0)) == "fused"
    assert adamw_implementation("auto", "cpu") == "foreach"
    assert adamw_implementation("fused", "cpu") == "fused"
    assert adamw_implementation("foreach", "cuda") == "foreach"
    with pytest.raises(ValueError, match="optim.implementation"):
        adamw_implementation("apex", "cpu")


def test_build_adamw_takes_the_optim_settings():
    p = torch.nn.Parameter(torch.ones(3))
    opt = build_adamw([p], OptimConfig(lr=0.1, betas=[0.8, 0.9], weight_decay=0.01, implementation="fused"), "cpu",
                      lr=0.2)
    g = opt.param_groups[0]
    assert (g["lr"], g["betas"], g["weight_decay"], g["fused"], g["foreach"]) == (0.2, (0.8, 0.9), 0.01, True, False)
    opt = build_adamw([p], OptimConfig(), "cpu")
    assert opt.param_groups[0]["foreach"] is True and not opt.param_groups[0]["fused"]


def test_the_config_key_is_checked_and_resumable():
    assert "optim.implementation" in RESUMABLE_KEYS
    assert load_config(None, ["optim.implementation=fused"]).optim.implementation == "fused"
    with pytest.raises(ConfigError, match="optim.implementation"):
        load_config(None, ["optim.implementation=apex"])
