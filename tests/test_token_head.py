"""The head losses as ``TokenHead`` (fastgrpo.update.head): what a CUDA graph of the head
(``parallel.cuda_graphs_head``) relies on, checked on the CPU. Every head the trainer builds (the GRPO-family policy
losses, SFT's) gives on its rows padded with zero rows the loss, the gradients and the stats of the real rows; the
padded row counts are few; and the head graphs' plumbing (gather, pad, capture per shape, replay, stats) gives the
eager update, with the capture itself replaced by an eager stand-in (the real capture: tests/test_cuda_graphs.py,
CUDA only)."""

from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM

from fastgrpo.algorithms.sft import sft_update
from fastgrpo.algorithms.tokens import PolicyObjective, TokenInputs
from fastgrpo.config import GRPOConfig, ParallelConfig, RolloutConfig
from fastgrpo.distributed.runner import prepare_model
from fastgrpo.models.loading import get_trunk_and_head
from fastgrpo.models.tiny import build_tiny
from fastgrpo.runtime.metrics import StepMetrics
from fastgrpo.update import cuda_graphs
from fastgrpo.update.head import BoundHead, TokenHead, pad_rows, padded_rows
from fastgrpo.update.step import optimizer_update, plan_step
from test_graphed_trainer import fake_capture

H, V = 24, 50


def test_padded_row_counts_are_few_and_pad_little():
    counts = [padded_rows(n) for n in range(1, 5000)]
    assert all(c >= n for n, c in zip(range(1, 5000), counts))
    # a multiple of 16 below 128 rows, at most 25% of padding from there on
    assert all(c <= max(n + 15, 1.25 * n) for n, c in zip(range(1, 5000), counts)), "too much padding"
    assert counts == sorted(counts)
    assert len(set(counts)) <= 4 * 13  # at most four per octave
    assert [padded_rows(n) for n in (1, 16, 17, 256, 257, 3000)] == [16, 16, 32, 256, 320, 3072]
    with pytest.raises(ValueError, match="at least one row"):
        padded_rows(0)


def test_pad_rows_appends_zero_rows_and_passes_gradients_to_the_real_ones():
    x = torch.randn(3, 2, requires_grad=True)
    y = pad_rows(x, 5)
    assert y.shape == (5, 2) and torch.equal(y[3:], torch.zeros(2, 2)) and torch.equal(y[:3], x)
    y.sum().backward()
    assert torch.equal(x.grad, torch.ones(3, 2))
    assert pad_rows(x, 3) is x
    with pytest.raises(ValueError, match="cannot pad 3 rows down to 2"):
        pad_rows(x, 2)


def _policy_head(grpo: GRPOConfig, n: int, *, old: bool, ref: bool, factor: bool, g: torch.Generator):
    """A GRPO-family TokenHead over n flat tokens (two sequences), as grpo_update builds it."""
    objective = PolicyObjective.from_config(grpo, RolloutConfig(temperature=0.9), "cpu")
    weights = torch.rand(n, generator=g) + 0.1
    weights[1] = 0.0  # a masked real token: it keeps weight 0 and stays out of the stats
    inputs = TokenInputs.build(
        weights, torch.randn(n, generator=g),
        old_logprobs=-torch.rand(n, generator=g) * 4 if old else None,
        ref_logprobs=-torch.rand(n, generator=g) * 4 if ref else None,
        policy_factors=(torch.rand(n, generator=g) + 0.5 if factor else None,), separate_kl=objective.separate_kl)
    mb = SimpleNamespace(flat_index=torch.randperm(n, generator=g), targets=torch.randint(0, V, (n,), generator=g))
    numbers = {id(mb): torch.tensor([0] * (n // 2) + [1] * (n - n // 2))} if objective.sequence_level else None
    return objective.head_loss(inputs, numbers), mb


def _sft_head(n: int, g: torch.Generator):
    """SFT's TokenHead, as sft_update builds it (captured from its call to optimizer_update)."""
    seen = {}

    def fake_update(model, mbs, head_loss, **kw):
        seen["head"] = head_loss

    import fastgrpo.algorithms.sft as sft
    real = sft.optimizer_update
    sft.optimizer_update = fake_update
    try:
        sft_update(SimpleNamespace(train=lambda: None, token_buckets=()), [[1, 2]], [list(range(3, 3 + n))], normalization="token",
                   max_tokens_per_microbatch=4096, head_backend="torch", optimizer=None, max_grad_norm=1.0,
                   metrics=StepMetrics(), device="cpu")
    finally:
        sft.optimizer_update = real
    return seen["head"], SimpleNamespace(flat_index=torch.arange(n), targets=torch.randint(0, V, (n,), generator=g))


CASES = {
    "dapo, ratio 1": dict(grpo=GRPOConfig(loss_type="dapo"), old=False, ref=False, factor=False),
    "grpo, old log-probs, delta": dict(grpo=GRPOConfig(loss_type="grpo", delta=1.5), old=True, ref=False,
                                       factor=False),
    "dr_grpo, KL, importance weights": dict(grpo=GRPOConfig(loss_type="dr_grpo", beta=0.05), old=True, ref=True,
                                            factor=True),
    "cispo": dict(grpo=GRPOConfig(loss_type="cispo"), old=True, ref=False, factor=False),
    "sapo": dict(grpo=GRPOConfig(loss_type="sapo"), old=True, ref=False, factor=False),
    "gspo (sequence level)": dict(grpo=GRPOConfig(loss_type="grpo", importance_sampling_level="sequence"),
                                  old=True, ref=False, factor=True),
    "sft": None,
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_head_on_rows_padded_with_zero_rows_gives_the_real_rows_loss_gradients_and_stats(case):
    """The torch path here (gradient in forward at token level, autograd at sequence level); the triton and cublas
    paths: tests/kernels/interpret_cases.py, test_zero_rows_appended_change_nothing."""
    g = torch.Generator().manual_seed(len(case))
    n = 13
    if case == "sft":
        head, mb = _sft_head(n, g)
    else:
        spec = dict(CASES[case])
        grpo = spec.pop("grpo")
        grpo.head_backend = "torch"
        head, mb = _policy_head(grpo, n, g=g, **spec)
    assert isinstance(head, TokenHead)
    hidden = torch.randn(n, H, generator=g)
    weight = torch.randn(V, H, generator=g) * 0.3

    def run(rows: int):
        h = hidden.clone().requires_grad_(True)
        w = weight.clone().requires_grad_(True)
        tensors = {k: pad_rows(t, rows) for k, t in head.gather(mb).items()}
        loss, stats = head.compute(pad_rows(h, rows), w, **tensors)
        loss.backward()
        return loss.detach(), {k: v.detach() for k, v in stats.items()}, h.grad, w.grad

    plain = run(n)
    bound = BoundHead(head, mb)(hidden, weight)  # the eager call optimizer_update makes
    torch.testing.assert_close(bound[0], plain[0], rtol=0, atol=0)
    for rows in (padded_rows(n), 40):
        loss, stats, gh, gw = run(rows)
        torch.testing.assert_close(loss, plain[0], rtol=1e-6, atol=1e-7)
        assert stats.keys() == plain[1].keys()
        for k in stats:
            torch.testing.assert_close(stats[k], plain[1][k], rtol=1e-6, atol=1e-7, msg=k)
        torch.testing.assert_close(gh, plain[2], rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(gw, plain[3], rtol=1e-5, atol=1e-7)
    assert plain[2].abs().sum() > 0 and plain[3].abs().sum() > 0


def test_heads_of_equal_settings_share_a_key_and_others_do_not():
    g = torch.Generator().manual_seed(0)
    a, _ = _policy_head(GRPOConfig(loss_type="dapo"), 8, old=False, ref=False, factor=False, g=g)
    b, _ = _policy_head(GRPOConfig(loss_type="dapo"), 8, old=True, ref=False, factor=False, g=g)
    c, _ = _policy_head(GRPOConfig(loss_type="dapo", epsilon_high=0.28), 8, old=False, ref=False, factor=False, g=g)
    assert a.key == b.key and hash(a.key) == hash(b.key)  # the same function (the tensors differ: old log-probs)
    assert a.key != c.key


@pytest.mark.parametrize("autocast", [None, torch.bfloat16], ids=["plain", "autocast-bf16"])
def test_the_head_graphs_plumbing_gives_the_eager_update(monkeypatch, autocast):
    """An update through HeadGraphs (capture stood in by an eager call, device checks off) equals the plain
    update: loss, stats, every gradient; one capture per padded row count, replays after. ``autocast``: the trunk
    under autocast and the head cast inside the graph's module (float32 weights on one GPU; here on the CPU)."""
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "pool")
    monkeypatch.setattr(torch.cuda, "make_graphed_callables", fake_capture)
    monkeypatch.setattr(cuda_graphs, "DEVICE_TYPE", "cpu")  # the graphs take CPU rows
    grpo = GRPOConfig(loss_type="dr_grpo", beta=0.04, head_backend="torch")
    objective = PolicyObjective.from_config(grpo, RolloutConfig(), "cpu")

    def runner():
        m = AutoModelForCausalLM.from_pretrained(build_tiny(), attn_implementation="sdpa").train()
        r = prepare_model(m, ParallelConfig(), device="cpu", world_size=1)
        r.autocast_dtype = autocast
        return r

    plain, graphed = runner(), runner()
    graphs = cuda_graphs.HeadGraphs(get_trunk_and_head(graphed.module)[1])
    graphed.head_graphs = graphs
    g = torch.Generator().manual_seed(0)
    steps = [([[1, 2, 3]] * 3, [[4, 5, 6, 7]] * 3), ([[1, 2, 3]] * 3, [[4, 5, 6, 7, 8]] * 3),
             ([[1, 2]] * 5, [[4, 5, 6, 7]] * 5)]  # 12, 15 (both 16 padded rows) and 20 (32) target rows
    for prompts, completions in steps:
        plan = plan_step(prompts, completions, 4096, device="cpu")
        n = sum(len(c) for c in completions)
        inputs = TokenInputs.build(torch.rand(n, generator=g), torch.randn(n, generator=g),
                                   ref_logprobs=-torch.rand(n, generator=g), separate_kl=objective.separate_kl)
        head = objective.head_loss(inputs)
        results = []
        for m in (plain, graphed):
            metrics = StepMetrics()
            opt = torch.optim.SGD(m.module.parameters(), lr=0.0)  # lr 0: the weights stay equal, the gradients compared
            optimizer_update(m, plan.mbs, head, optimizer=opt, max_grad_norm=0.0, metrics=metrics)
            results.append((metrics.reduce(), {k: p.grad.clone() for k, p in m.module.named_parameters()}))
        (ms, gs), (mg, gg) = results
        assert ms.keys() == mg.keys() and "policy/kl_mean" in ms
        for k in ms:
            assert mg[k] == pytest.approx(ms[k], rel=1e-5, abs=1e-7), k
        for k in gs:
            torch.testing.assert_close(gg[k], gs[k], rtol=1e-4, atol=1e-7, msg=k)
            assert gs[k].dtype == torch.float32  # the cast is differentiable: float32 weights get float32 grads
    assert (graphs.captures, graphs.replays, graphs.eager_calls) == (2, 3, 0)
    assert sorted(s.rows for s in graphs.graphed) == [16, 32] and {s.cast for s in graphs.graphed} == {autocast}
    with torch.no_grad():  # the log-prob passes: eager
        graphed.packed_forward(plan.mbs[0], head.bind(plan.mbs[0]))
    assert graphs.eager_calls == 1
