"""CUDA graphs of the decoder blocks per token bucket and of the head loss per padded row count
(``parallel.cuda_graphs``): refused with one line on a machine without CUDA; on a GPU, a graphed update gives the
eager update's loss and gradients, a row that fits no bucket runs eagerly, and replays launch no capture again (these
skip without CUDA)."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from fastgrpo.config import ParallelConfig
from fastgrpo.distributed.runner import ModelRunner, prepare_model
from fastgrpo.models.attention import register_with_transformers
from fastgrpo.models.packing import pack
from fastgrpo.models.tiny import build_tiny
from fastgrpo.update.cuda_graphs import graph_blocks

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")


def _model(device: str, attn: str = "varlen_op", **parallel) -> ModelRunner:
    register_with_transformers()
    model = AutoModelForCausalLM.from_pretrained(build_tiny(), attn_implementation=attn).train()
    return prepare_model(model, ParallelConfig(**parallel), device=device, world_size=1)


def test_cuda_graphs_are_refused_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="parallel.cuda_graphs needs one plain CUDA device"):
        _model("cpu", cuda_graphs=True, token_buckets=[32])
    with pytest.raises(ValueError, match="parallel.cuda_graphs needs a CUDA device"):
        graph_blocks(_model("cpu").blocks, [32])


class _StaticGradient(torch.autograd.Function):
    """What a graph made by torch.cuda.make_graphed_callables does in backward: write the parameter's gradient into
    a static buffer (the replay) and return that buffer, detached."""

    @staticmethod
    def forward(ctx, x, p, static):
        ctx.static, ctx.x = static, x.detach()
        return (x * p).sum()

    @staticmethod
    def backward(ctx, g):
        ctx.static.copy_(g * ctx.x)  # the replay writes the buffer
        return None, ctx.static.detach(), None


def test_gradient_buffers_keep_a_graphs_static_gradient_out_of_grad():
    """pytorch/pytorch#181723: autograd makes the first static gradient the parameter's .grad, and the next replay
    overwrites it. With GradientBuffers installed (build_trained does it with cuda_graphs) three micro-batches sum."""
    from fastgrpo.update.cuda_graphs import GradientBuffers

    p = torch.nn.Parameter(torch.zeros(3))
    static = torch.zeros(3)
    xs = [torch.tensor([1.0, 2.0, 3.0]), torch.tensor([0.5, -1.0, 4.0]), torch.tensor([2.0, 0.0, -1.0])]
    buffers = GradientBuffers([p, p])  # tied parameters: one buffer
    assert len(buffers.params) == 1
    for update in range(2):
        p.grad = None  # optimizer.zero_grad(set_to_none=True)
        buffers.install()
        for x in xs:
            _StaticGradient.apply(x, p, static).backward()
        torch.testing.assert_close(p.grad, sum(xs), msg=f"update {update}")
        assert p.grad.data_ptr() != static.data_ptr()


def _loss_and_grads(runner, mbs):
    model = runner.module
    model.zero_grad(set_to_none=True)
    total = 0.0
    for mb in mbs:
        loss = runner.packed_forward(mb, lambda h, w, mb=mb: torch.log_softmax((h @ w.T).float(), -1).gather(
            1, mb.targets[:, None]).sum())
        loss.backward()
        total += loss.detach()
    return total, {n: p.grad.clone() for n, p in model.named_parameters()}


@needs_cuda
@pytest.mark.parametrize("weights", ["bf16", "float32+autocast"])
def test_a_graphed_update_gives_the_eager_loss_and_gradients_and_runs_other_rows_eagerly(weights):
    """bf16 weights without autocast (parallel.master_weights) and float32 weights under bf16 autocast (the one-GPU
    default; capture refuses autocast's weight-cast cache, the first H100 run's failure): graphed = eager."""
    prompts, completions = [[1, 2, 3, 4], [5, 6, 7], [9] * 40], [[8, 9], [10, 11, 12], [13] * 30]
    bins = [[0, 1], [2]]  # a 12-token row (bucket 16) and a 70-token row (no bucket: eager)
    parallel = {"master_weights": True} if weights == "bf16" else {}
    # torch_varlen: what an eager CUDA update runs (choose_attn_implementation's CUDA default without flash-attn)
    eager, graphed = _model("cuda", "torch_varlen", **parallel), _model("cuda", "torch_varlen", **parallel)
    assert (eager.autocast_dtype is None) == (weights == "bf16")
    blocks = graphed.blocks
    graphs = graph_blocks(blocks, [32, 16])
    graphed.block_graphs, graphed.block_forwards = graphs, graphs.block_forwards()
    for _ in range(3):  # replays after the first capture
        mbs = pack(prompts, completions, bins, "cuda", buckets=[16, 32])
        assert [mb.num_tokens for mb in mbs] == [16, 70]
        ref_loss, ref = _loss_and_grads(eager, mbs)
        loss, grads = _loss_and_grads(graphed, mbs)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-2, atol=1e-2)
        for name in ref:
            torch.testing.assert_close(grads[name].float(), ref[name].float(), rtol=2e-2, atol=2e-2, msg=name)
    layers = len(blocks)
    assert (graphs.captures, graphs.replays, graphs.eager_calls) == (1, 3 * layers, 3 * layers)


@needs_cuda
def test_the_graphed_grpo_update_trains_as_the_eager_one_and_captures_each_row_shape_once():
    """Through the trainer's own update (build_trained -> grpo_update -> plan_step's padded rows): bf16 weights with
    float32 masters, eager blocks against CUDA-graphed ones over three steps of one batch shape."""
    from fastgrpo.algorithms.grpo import GRPOBatch, grpo_update
    from fastgrpo.config import GRPOConfig, OptimConfig, RolloutConfig
    from fastgrpo.runtime.metrics import StepMetrics
    from fastgrpo.update.bundle import build_trained

    gen = torch.Generator().manual_seed(0)
    batches = [GRPOBatch(prompt_ids=torch.randint(3, 250, (6, 9), generator=gen).tolist(),
                         completion_ids=torch.randint(3, 250, (6, 14), generator=gen).tolist(),
                         advantages=torch.randn(6, generator=gen)) for _ in range(3)]
    losses = {}
    for name, graphs_on in (("eager", False), ("graphed", True)):
        register_with_transformers()
        model = AutoModelForCausalLM.from_pretrained(build_tiny(), attn_implementation="torch_varlen").train()
        parallel = ParallelConfig(master_weights=True, cuda_graphs=graphs_on, token_buckets=[32, 64])
        trained = build_trained(model, parallel=parallel, optim=OptimConfig(lr=1e-3), device="cuda", world_size=1,
                                total_steps=3)
        losses[name] = []
        for batch in batches:
            metrics = StepMetrics()
            grpo_update(trained.runner, batch, grpo=GRPOConfig(max_tokens_per_microbatch=64),
                        rollout=RolloutConfig(max_completion_length=14), optimizer=trained.optimizer,
                        scheduler=trained.scheduler, max_grad_norm=1.0, metrics=metrics, device="cuda")
            losses[name].append(metrics.reduce()["loss"])
        if graphs_on:
            graphs = trained.runner.block_graphs
            # 6 sequences of 23 tokens: rows of 2 (46 -> bucket 64) and the same row shapes at every step
            assert graphs.captures == len({(s.tokens, s.boundaries, s.max_seqlen) for s in graphs.graphed})
            assert 1 <= graphs.captures <= 2 and graphs.replays > 0
            heads = trained.runner.head_graphs  # parallel.cuda_graphs_head (on by default): 2 x 14 = 28 -> 32 rows
            assert (heads.captures, heads.eager_calls) == (1, 0) and heads.replays == 3 * len(batches)
    assert losses["graphed"] == pytest.approx(losses["eager"], rel=2e-2, abs=2e-3)


@needs_cuda
@pytest.mark.parametrize("weights", ["bf16", "float32+autocast"])
@pytest.mark.parametrize("backend", ["cublas", "triton"])
def test_the_graphed_head_gives_the_eager_heads_loss_stats_and_gradients(weights, backend):
    """The head loss replayed from CUDA graphs (fastgrpo.update.cuda_graphs.HeadGraphs: rows padded with zero rows
    to a few counts) against the same model's eager head: loss, stats, every gradient, over four steps whose target
    rows (24, 30, 30, 48) pad to two counts (32, 48): two captures, four replays. tests/test_token_head.py checks the
    same plumbing on the CPU with the capture stood in."""
    from fastgrpo.algorithms.tokens import PolicyObjective, TokenInputs
    from fastgrpo.config import GRPOConfig, RolloutConfig
    from fastgrpo.models.loading import get_trunk_and_head
    from fastgrpo.runtime.metrics import StepMetrics
    from fastgrpo.update.cuda_graphs import GradientBuffers, graph_head
    from fastgrpo.update.step import optimizer_update, plan_step

    runner = _model("cuda", "torch_varlen", **({"master_weights": True} if weights == "bf16" else {}))
    model = runner.module
    runner.gradient_buffers = GradientBuffers(model.parameters())  # as build_trained sets it with cuda_graphs
    objective = PolicyObjective.from_config(GRPOConfig(loss_type="dr_grpo", beta=0.04, head_backend=backend),
                                            RolloutConfig(), "cuda")
    g = torch.Generator().manual_seed(0)
    graphs = None
    for completion_len in (4, 5, 5, 8):  # 6 / 6 sequences: 24, 30, 30 and 48 -> 32, 32, 32, 48 rows
        prompts = torch.randint(3, 250, (6, 5), generator=g).tolist()
        completions = torch.randint(3, 250, (6, completion_len), generator=g).tolist()
        plan = plan_step(prompts, completions, 4096, device="cuda")
        n = 6 * completion_len
        inputs = TokenInputs.build(torch.rand(n, generator=g).cuda(), torch.randn(n, generator=g).cuda(),
                                   old_logprobs=-torch.rand(n, generator=g).cuda(),
                                   ref_logprobs=-torch.rand(n, generator=g).cuda(), separate_kl=True)
        head = objective.head_loss(inputs)
        results = []
        for graphed in (False, True):
            if graphed and graphs is None:
                graphs = graph_head(get_trunk_and_head(model)[1])
            runner.head_graphs = graphs if graphed else None
            metrics = StepMetrics()
            opt = torch.optim.SGD(model.parameters(), lr=0.0)  # the weights stay; the gradients are compared
            optimizer_update(runner, plan.mbs, head, optimizer=opt, max_grad_norm=0.0, metrics=metrics)
            results.append((metrics.reduce(), {k: p.grad.float().clone() for k, p in model.named_parameters()}))
        (me, ge), (mg, gg) = results
        for k in me:
            assert mg[k] == pytest.approx(me[k], rel=1e-3, abs=1e-5), k
        for k in ge:  # the same kernels on the same inputs: equal up to the order of float32 sums
            torch.testing.assert_close(gg[k], ge[k], rtol=1e-3, atol=1e-5, msg=k)
    assert (graphs.captures, graphs.replays, graphs.eager_calls) == (2, 4, 0)


@needs_cuda
def test_micro_batches_sharing_a_graph_sum_their_gradients():
    """Three rows of one bucket in one update (each replays the same graphs): the graphed update's gradients are the
    eager update's sum, over two updates (the first H200 figures at 64 sequences had twice the last row's instead:
    pytorch/pytorch#181723, fixed by GradientBuffers)."""
    from fastgrpo.algorithms.tokens import PolicyObjective, TokenInputs
    from fastgrpo.config import GRPOConfig, OptimConfig, RolloutConfig
    from fastgrpo.runtime.metrics import StepMetrics
    from fastgrpo.update.bundle import build_trained
    from fastgrpo.update.step import optimizer_update, plan_step

    gen = torch.Generator().manual_seed(1)
    prompts = torch.randint(3, 250, (6, 9), generator=gen).tolist()
    completions = torch.randint(3, 250, (6, 14), generator=gen).tolist()
    advantages = torch.randn(84, generator=gen).cuda()
    grads = {}
    for name, graphs_on in (("eager", False), ("graphed", True)):
        register_with_transformers()
        model = AutoModelForCausalLM.from_pretrained(build_tiny(), attn_implementation="torch_varlen").train()
        parallel = ParallelConfig(master_weights=True, cuda_graphs=graphs_on, token_buckets=[64])
        trained = build_trained(model, parallel=parallel, optim=OptimConfig(lr=1e-3), device="cuda", world_size=1,
                                total_steps=2)
        plan = plan_step(prompts, completions, 48, device="cuda", buckets=[64])
        assert [mb.num_tokens for mb in plan.mbs] == [64, 64, 64]  # 2 sequences of 23 tokens each
        objective = PolicyObjective.from_config(GRPOConfig(loss_type="dapo"), RolloutConfig(), "cuda")
        inputs = TokenInputs.build(torch.full((84,), 1 / 84, device="cuda"), advantages)
        grads[name] = []
        for _ in range(2):
            opt = torch.optim.SGD(trained.model.parameters(), lr=0.0)  # the weights stay; gradients compared
            optimizer_update(trained.runner, plan.mbs, objective.head_loss(inputs), optimizer=opt, max_grad_norm=0.0,
                             metrics=StepMetrics())
            grads[name].append({k: p.grad.float().clone() for k, p in trained.model.named_parameters()})
    for eager, graphed in zip(grads["eager"], grads["graphed"]):
        for k in eager:
            torch.testing.assert_close(graphed[k], eager[k], rtol=2e-2, atol=1e-4, msg=k)


def test_the_decode_copy_of_a_graphed_policy_runs_its_own_bf16_blocks(monkeypatch):
    """The hf engine decodes a float32 + autocast policy (one GPU, no master weights) from a bf16 deepcopy of it.
    With parallel.cuda_graphs the graphs live in the policy's runner and stand in for the blocks' forwards during
    its packed passes only: the module the copy is made from is plain, so the copy's blocks run their own bf16
    forward. Built on the CPU with the CUDA check stood in (nothing is captured: graphs capture on the first
    training forward)."""
    from fastgrpo.models.loading import get_trunk_and_head
    from fastgrpo.rollout.hf import decode_copy
    from fastgrpo.update.cuda_graphs import GradientBuffers, graph_head

    policy, plain = _model("cpu", "sdpa"), _model("cpu", "sdpa")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    graphs = graph_blocks(policy.blocks, [32])
    policy.block_graphs, policy.block_forwards = graphs, graphs.block_forwards()
    policy.head_graphs = graph_head(get_trunk_and_head(policy.module)[1])
    policy.gradient_buffers = GradientBuffers(policy.module.parameters())
    copy, copy_params, policy_params = decode_copy(policy.module, torch.bfloat16)
    reference = decode_copy(plain.module, torch.bfloat16)[0]
    assert not any("forward" in vars(m) for m in (*policy.module.modules(), *copy.modules()))
    assert all(p.dtype == torch.bfloat16 for p in copy.parameters())
    assert graphs.captures == 0
    ids = torch.tensor([[5, 9, 17, 33, 2, 7]])
    with torch.no_grad():
        torch.testing.assert_close(copy(ids).logits, reference(ids).logits, rtol=0, atol=0)
