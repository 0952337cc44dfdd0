"""optim.implementation: fused AdamW on CUDA by default, foreach elsewhere, either by choice; a config key."""

import pytest
import torch

from fastgrpo.config import ConfigError, OptimConfig, RESUMABLE_KEYS, load_config
from fastgrpo.update.optim import FOREACH_CHUNK_BYTES, ChunkedAdamW, adamw_implementation, build_adamw


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


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(40, 16), (16,), (64, 16), (3, 5), (16, 16), (7,)]
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]


@pytest.mark.parametrize("chunk_bytes", [1, 4 * 16 * 16, 10**9])
def test_chunked_foreach_steps_are_torchs_bitwise(chunk_bytes):
    """Chunks of one tensor each, a few tensors, or all: every step equals torch's foreach AdamW bit for bit, and
    between steps the optimizer shows torch's one param group (what schedulers and checkpoints read)."""
    ours, ref = _params(), _params()
    kw = dict(lr=0.05, betas=(0.8, 0.9), weight_decay=0.1, foreach=True)
    a = ChunkedAdamW([{"params": ours[:4]}, {"params": ours[4:], "lr": 0.02}], chunk_bytes=chunk_bytes, **kw)
    b = torch.optim.AdamW([{"params": ref[:4]}, {"params": ref[4:], "lr": 0.02}], **kw)
    if chunk_bytes == 1:
        assert len(a._chunks()) == len(ours)  # the planted split: one tensor per call
    calls = []
    a.register_step_post_hook(lambda *_: calls.append(1))
    for step in range(4):
        g = torch.Generator().manual_seed(100 + step)
        for p, q in zip(ours, ref):
            p.grad = torch.randn(p.shape, generator=g)
            q.grad = p.grad.clone()
        a.step()
        b.step()
        for p, q in zip(ours, ref):
            assert torch.equal(p, q)
        assert [len(gr["params"]) for gr in a.param_groups] == [4, 2]
    assert len(calls) == 4  # the optimizer hooks run once per step
    sa, sb = a.state_dict(), b.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    for k in sb["state"]:
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(sa["state"][k][name], sb["state"][k][name])
    b.load_state_dict(sa)  # a checkpoint of one loads into the other


def test_chunked_foreach_is_what_the_cpu_builds_and_a_bad_chunk_is_refused():
    opt = build_adamw(_params(), OptimConfig(), "cpu")
    assert isinstance(opt, ChunkedAdamW) and opt.chunk_bytes == FOREACH_CHUNK_BYTES
    assert not isinstance(build_adamw(_params(), OptimConfig(implementation="fused"), "cpu"), ChunkedAdamW)
    with pytest.raises(ValueError, match="chunk_bytes"):
        ChunkedAdamW(_params(), chunk_bytes=0)
