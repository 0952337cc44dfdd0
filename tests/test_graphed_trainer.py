"""The trainer with ``parallel.cuda_graphs`` on the CPU, the capture stood in by eager calls: what a GPU
run would go through around the graphs (the block graphs' dispatch, the head graphs, the parameters' own gradient
buffers, rollout and log-prob passes on the same modules, checkpoints, a resume, LoRA) trains bit-identically to
the same run without graphs. The captures themselves need CUDA: tests/test_cuda_graphs.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import fastgrpo.distributed.parallelize as parallelize
import fastgrpo.trainers.preflight as preflight
from fastgrpo.config import load_config
from fastgrpo.update import cuda_graphs
from test_trainer import TOY

# varlen_op: what cuda_graphs switches sdpa_varlen (the CPU's default) to, named for the plain run too
SETTINGS = ["parallel.master_weights=true", "grpo.prompts_per_step=4", "grpo.num_generations=4", "max_steps=2",
            "checkpoint.every=1", "model.attn_implementation=varlen_op",
            "grpo.shared_prefix=false",  # graphed blocks never share a prompt: the plain run must not either
            "parallel.lean_activations=false"]  # nor run lean norms and MLPs (their gradients round differently)
BUCKETS = "parallel.token_buckets=[256,512,1024]"  # what 'auto' resolves to at the CPU's budget of 1024 tokens


def fake_capture(callables, samples, num_warmup_iters=3, pool=None):
    """torch.cuda.make_graphed_callables' contract with eager calls: warm-up calls, then the callables themselves
    (fresh outputs per call, where the real ones are static buffers). The pool is the stood-in handle."""
    assert pool == "pool" and num_warmup_iters == 3
    one = not isinstance(callables, tuple)
    callables, samples = ((callables,), (samples,)) if one else (callables, samples)
    for _ in range(num_warmup_iters):
        for fn, args in zip(callables, samples):
            fn(*args)
    return callables[0] if one else callables


@pytest.fixture
def graphs_on_cpu(monkeypatch):
    check = parallelize.check_parallel

    def check_without_graphs(cfg, device, world_size):
        check(dataclasses.replace(cfg, cuda_graphs=False), device, world_size)

    for module in (parallelize, preflight):
        monkeypatch.setattr(module, "check_parallel", check_without_graphs)
    monkeypatch.setattr(cuda_graphs, "_require_cuda", lambda: None)
    monkeypatch.setattr(cuda_graphs, "DEVICE_TYPE", "cpu")
    monkeypatch.setattr(torch.cuda, "make_graphed_callables", fake_capture)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "pool")


def _run(tmp_path, name: str, *extra: str):
    from fastgrpo.trainers.grpo import Trainer

    trainer = Trainer(load_config(None, [*TOY, *SETTINGS, f"output_dir={tmp_path}", f"name={name}", *extra]))
    trainer.run()
    return trainer


def _state(trainer) -> dict[str, torch.Tensor]:
    """Weights and optimizer state of the policy, and of the critic where there is one."""
    out = {}
    for name, opt in (("model", "optimizer"), ("critic", "critic_optimizer")):
        if getattr(trainer, name, None) is None:
            continue
        out.update({f"{name}.{k}": v.detach().clone() for k, v in getattr(trainer, name).state_dict().items()})
        for i, (p, s) in enumerate(getattr(trainer, opt).state.items()):
            out.update({f"{opt}.{i}.{k}": v.clone() for k, v in s.items() if torch.is_tensor(v)})
    return out


@pytest.mark.parametrize("case", ["grpo", "grpo-lora", "ppo", "grpo-auto-buckets"])
def test_a_graphed_run_trains_as_the_plain_run_and_resumes(tmp_path, graphs_on_cpu, case):
    """``grpo-auto-buckets``: cuda_graphs without token_buckets pads to the budget's buckets and graphs those rows,
    as the plain run with those buckets listed."""
    extra = {"grpo": [], "grpo-lora": ["model.lora.rank=4"], "grpo-auto-buckets": [],
             "ppo": ["algorithm=ppo", "ppo.critic_lr=1e-2", "ppo.num_mini_batches=2"]}[case]
    graphed_extra = ["parallel.cuda_graphs=true", *([] if case == "grpo-auto-buckets" else [BUCKETS]), *extra]
    plain = _run(tmp_path, "plain", BUCKETS, *extra)
    graphed = _run(tmp_path, "graphed", *graphed_extra)
    blocks = graphed.runner.block_graphs
    heads = graphed.runner.head_graphs
    assert blocks.captures >= 1 and blocks.replays > 0, "the block graphs' path did not run"
    assert blocks.buckets == (None if case == "grpo-auto-buckets" else {256, 512, 1024})
    assert heads.captures >= 1 and heads.replays > 0, "the head graphs' path did not run"
    assert graphed.runner.gradient_buffers.params and plain.runner.gradient_buffers is None
    if case == "ppo":  # the critic trains through its own graphed blocks (its value head is no TokenHead: eager)
        critic = graphed.extras["critic"].runner
        assert critic.block_graphs.replays > 0 and critic.head_graphs.replays == 0
    a, b = _state(plain), _state(graphed)
    assert a.keys() == b.keys() and any(k.startswith("critic.") for k in a) == (case == "ppo")
    for k in a:
        assert torch.equal(a[k], b[k]), k
    # a resume from step 1's checkpoint of a graphed run ends where the straight run did
    _run(tmp_path, "resumed", *graphed_extra, "max_steps=1")
    resumed = _run(tmp_path, "resumed", *graphed_extra)
    assert resumed.step == 2
    c = _state(resumed)
    for k in a:
        assert torch.equal(a[k], c[k]), k
