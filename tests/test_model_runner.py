"""What the trainer adds to a model lives in its runner (``fastgrpo.distributed.runner.ModelRunner``), never on the
module: after a run with every option the CPU can take (LoRA, master weights, token
buckets, CUDA graphs with the capture stood in, compiled blocks), every module of the policy has exactly the
attributes a freshly loaded one has, and a compiled run's rollout decodes with the plain blocks (no compile, no
recompile) while its update replays the compiled ones."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from fastgrpo.config import load_config
from fastgrpo.distributed.parallelize import parallelize_model
from fastgrpo.distributed.runner import ModelRunner, prepare_model
from fastgrpo.models.loading import load_model
from fastgrpo.models.lora import apply_lora
from fastgrpo.models.packing import pack
from test_graphed_trainer import SETTINGS, graphs_on_cpu  # noqa: F401 (a fixture)
from test_trainer import TOY


def _attributes(model: torch.nn.Module) -> dict[str, set[str]]:
    """Instance attributes of each module, by its state-dict path (the checkpoint wrapper's level left out)."""
    out = {}
    for name, m in model.named_modules():
        if type(m).__name__ == "CheckpointWrapper":
            continue
        out[name.replace("._checkpoint_wrapped_module", "")] = set(vars(m))
    return out


def _trainer(tmp_path, name: str, *extra: str):
    from fastgrpo.trainers.grpo import Trainer

    return Trainer(load_config(None, [*TOY, *SETTINGS, f"output_dir={tmp_path}", f"name={name}", *extra]))


def test_a_trained_policy_carries_no_trainer_state(tmp_path, graphs_on_cpu):  # noqa: F811 (the fixture)
    trainer = _trainer(tmp_path, "graphed", "parallel.cuda_graphs=true",
                       "model.lora.rank=4", "max_steps=1")
    trainer.run()
    assert trainer.runner.block_graphs.replays > 0 and trainer.runner.head_graphs.replays > 0
    assert trainer.runner.gradient_buffers is not None
    # the same module loaded and parallelized the same way, never run by a runner
    cfg = trainer.cfg
    reference = apply_lora(load_model(cfg.model, device="cpu", seed=cfg.seed), cfg.model.lora)
    reference = parallelize_model(reference, cfg.parallel, device="cpu", world_size=1)
    assert _attributes(trainer.model) == _attributes(reference)
    assert not any("forward" in vars(m) for m in trainer.model.modules())  # graphed forwards: in passes only


def test_a_planted_attribute_is_seen():
    """The comparison above fails on a module that carries one trainer attribute."""
    cfg = load_config(None, [*TOY])
    a, b = (load_model(cfg.model, device="cpu", seed=0) for _ in range(2))
    assert _attributes(a) == _attributes(b)
    b.model.layers[0].token_buckets = [64]
    assert _attributes(a) != _attributes(b)


def test_block_forwards_stand_in_during_packed_passes_only():
    cfg = load_config(None, [*TOY])
    runner = prepare_model(load_model(cfg.model, device="cpu", seed=0), cfg.parallel, device="cpu", world_size=1)
    calls = []

    def forward_of(block):
        def forward(*args, **kwargs):
            calls.append(block)
            return type(block).forward(block, *args, **kwargs)
        return forward

    runner.block_forwards = [forward_of(b) for b in runner.blocks]
    mb = pack([[1, 2, 3]], [[4, 5]], [[0]], "cpu")[0]
    with torch.no_grad():
        runner.packed_forward(mb, lambda h, w: h @ w.T)
        assert calls == runner.blocks
        assert not any("forward" in vars(b) for b in runner.blocks)
        runner.module(torch.tensor([[1, 2, 3]]))  # a plain forward (decoding): the blocks' own
    assert calls == runner.blocks
    assert isinstance(runner, ModelRunner) and runner.token_buckets == ()


def test_a_compiled_runs_rollout_decodes_with_plain_blocks_and_its_update_reuses_its_graphs(tmp_path):
    """parallel.compile: the compiled blocks serve the update's static buckets only. The rollout (the hf engine's
    decode, with its KV cache and per-layer indices) compiles nothing and recompiles nothing; the update compiles
    once per row shape and grad mode, and a second step of the same shapes compiles nothing new."""
    pytest.importorskip("torch._inductor")
    torch._dynamo.reset()
    counters.clear()
    trainer = _trainer(tmp_path, "compiled", "parallel.compile=true", "parallel.token_buckets=[1024]", "max_steps=2")
    generate = trainer.engine.generate
    seen = {"rollout": [], "step": []}

    def counted_generate(*args, **kwargs):
        before = (counters["stats"]["unique_graphs"], sum(counters["recompiles"].values()))
        out = generate(*args, **kwargs)
        after = (counters["stats"]["unique_graphs"], sum(counters["recompiles"].values()))
        seen["rollout"].append((after[0] - before[0], after[1] - before[1]))
        return out

    packed_forward = trainer.runner.packed_forward
    shapes = set()

    def counted_forward(mb, head):
        shapes.add((mb.num_tokens, mb.cu_seqlens.numel(), mb.max_seqlen, torch.is_grad_enabled()))
        return packed_forward(mb, head)

    trainer.engine.generate = counted_generate
    trainer.runner.packed_forward = counted_forward
    trainer.run()
    assert seen["rollout"] and all(d == (0, 0) for d in seen["rollout"]), seen["rollout"]
    # the update: one graph per row shape (bucket, boundaries, max_seqlen) and grad mode, whatever the step count
    assert {s[0] for s in shapes} == {1024}
    assert counters["stats"]["unique_graphs"] == len(shapes), (dict(counters["stats"]), shapes)
    assert dict(counters["graph_break"]) == {}
