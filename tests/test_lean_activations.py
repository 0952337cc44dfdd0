"""Lean saved activations (fastgrpo.models.lean_activations): during packed passes the RMSNorms and SwiGLU MLPs keep
only their inputs for backward. The forward must be bitwise the modules' own, the gradients autograd's within float
rounding, the saved bytes fewer, and a module the lean forward does not reproduce must keep its own."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fastgrpo.config import ModelConfig, ParallelConfig
from fastgrpo.distributed.runner import prepare_model
from fastgrpo.kernels import linear_logprobs
from fastgrpo.models.lean_activations import RMSNormFunction, SwiGLUFunction, lean_forwards
from fastgrpo.models.loading import load_model
from fastgrpo.models.lora import apply_lora
from fastgrpo.update.step import plan_step
from test_shared_prefix import _assert_same, grouped_batch

transformers = pytest.importorskip("transformers")


def _model(preset: str = "", lora: int = 0) -> nn.Module:
    from fastgrpo.config import LoraConfig

    model = load_model(ModelConfig(name_or_path="tiny" + (f":{preset}" if preset else "")), device="cpu", seed=0)
    if lora:
        model = apply_lora(model, LoraConfig(rank=lora, alpha=float(2 * lora)))
    return model.train()


def _pass(model: nn.Module, lean: bool, *, autocast: torch.dtype | None = None, **parallel):
    """Log-probs, every trainable parameter's gradient and the bytes autograd saved, for one packed micro-batch
    with shared prefixes (groups of different prompt lengths) under a runner with or without lean forwards."""
    runner = prepare_model(model, ParallelConfig(lean_activations=lean, **parallel), device="cpu", world_size=1)
    assert bool(runner.lean_forwards) == lean
    prompts, completions = grouped_batch(3, groups=2, size=3, prompt=(5, 12), completion=(3, 8))
    (mb,) = plan_step(prompts, completions, 4096, device="cpu", shared_prefix=True).mbs
    model.zero_grad(set_to_none=True)
    saved = {p.untyped_storage().data_ptr() for p in model.parameters()}
    nbytes = [0]

    def pack_hook(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in saved:
            saved.add(ptr)
            nbytes[0] += t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack_hook, lambda t: t), \
            torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        logp = runner.packed_forward(mb, lambda h, w: linear_logprobs(h.float(), w.float(), mb.targets))
    weights = torch.linspace(-1, 1, logp.numel())
    (logp * weights).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    assert not any("forward" in vars(m) for m in model.modules())  # installed for the pass only
    return logp.detach(), grads, nbytes[0]


# LoRA: the adapters keep their own inputs, and a down projection with adapters is not fused
@pytest.mark.parametrize("preset,lora,most", [("", 0, 0.85), ("llama", 0, 0.85), ("", 4, 0.95)],
                         ids=["qwen2", "llama", "qwen2-lora"])
def test_the_same_logprobs_and_gradients_with_fewer_saved_bytes(preset, lora, most):
    model = _model(preset, lora)
    logp, grads, plain = _pass(model, lean=False)
    logp_lean, grads_lean, lean = _pass(model, lean=True)
    assert torch.equal(logp_lean, logp)  # the forward is the modules' own, bit for bit
    assert grads.keys() == grads_lean.keys() and grads
    for name, g in grads.items():
        _assert_same(grads_lean[name], g, name)
    assert lean < most * plain, (lean, plain)


@pytest.mark.parametrize("case", ["autocast", "master-weights"])
def test_in_bf16_the_forward_is_the_modules_own(case):
    """bf16 compute either way a run gets it: autocast over float32 weights (one GPU), or bf16 weights cast after the
    lean forwards were probed in float32 (parallel.master_weights)."""
    model = _model()
    kw = {"autocast": torch.bfloat16} if case == "autocast" else {"master_weights": True}
    logp, grads, _ = _pass(model, lean=False, **kw)
    logp_lean, grads_lean, _ = _pass(model, lean=True, **kw)
    assert next(model.parameters()).dtype == (torch.float32 if case == "autocast" else torch.bfloat16)
    assert torch.equal(logp_lean, logp)
    for name, g in grads.items():
        assert grads_lean[name].dtype == g.dtype
        _assert_same(grads_lean[name], g, name, rtol=2e-2)  # bf16 products: autograd's order differs


def _reference_norm(x, w, eps):
    x32 = x.float()
    return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@pytest.mark.parametrize("x_dtype,w_dtype,rtol", [(torch.float32, torch.float32, 1e-5),
                                                  (torch.bfloat16, torch.float32, 1e-2),
                                                  (torch.bfloat16, torch.bfloat16, 1e-2)])
def test_the_norm_matches_autograd_of_its_formula(x_dtype, w_dtype, rtol):
    """The norm upcasts to float32 as the modules do, so it is compared with autograd rather than gradchecked."""
    torch.manual_seed(0)
    x0, w0, up = torch.randn(2, 5, 16) * 3, torch.randn(16), torch.randn(2, 5, 16)
    got, want = [], []
    for fn, out in ((lambda x, w: RMSNormFunction.apply(x, w, 1e-6), got), (lambda x, w: _reference_norm(x, w, 1e-6),
                                                                            want)):
        x, w = x0.to(x_dtype).requires_grad_(), w0.to(w_dtype).requires_grad_()
        y = fn(x, w)
        (y.float() * up).sum().backward()
        out += [y.detach(), x.grad, w.grad]
    assert torch.equal(got[0], want[0])
    for a, b, what in zip(got[1:], want[1:], ("x", "weight")):
        assert a.dtype == b.dtype
        _assert_same(a.float(), b.float(), what, rtol=rtol)


def test_swiglu_passes_gradcheck_in_float64():
    torch.manual_seed(0)
    g, u = (torch.randn(2, 5, 6, dtype=torch.float64, requires_grad=True) for _ in range(2))
    down, bias = torch.randn(4, 6, dtype=torch.float64, requires_grad=True), torch.randn(4, dtype=torch.float64,
                                                                                         requires_grad=True)
    assert torch.autograd.gradcheck(lambda *a: SwiGLUFunction.apply(*a), (g, u, down, bias))
    assert torch.autograd.gradcheck(lambda g, u: SwiGLUFunction.apply(g, u, None, None), (g, u))


class _GemmaLikeNorm(nn.Module):
    """An RMSNorm that scales by ``1 + weight``: the lean forward (``weight * x``) would be wrong for it."""

    def __init__(self, width: int):
        super().__init__()
        self.weight, self.variance_epsilon = nn.Parameter(torch.randn(width)), 1e-6

    def forward(self, x):
        x32 = x.float()
        return (1 + self.weight) * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


class _GeluMLP(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = nn.Linear(width, 12), nn.Linear(width, 12), nn.Linear(12, width)
        self.act_fn = nn.SiLU()

    def forward(self, x):  # a structure like SwiGLU's, another function (an extra term)
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x) + self.gate_proj(x))


class _SwiGLU(_GeluMLP):
    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def test_only_modules_the_lean_forward_reproduces_are_taken():
    class LlamaRMSNorm(_GemmaLikeNorm):  # the right forward under a matching name
        def forward(self, x):
            x32 = x.float()
            return self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    class GemmaRMSNorm(_GemmaLikeNorm):
        pass

    model = nn.ModuleList([LlamaRMSNorm(8), GemmaRMSNorm(8), _GeluMLP(8), _SwiGLU(8)])
    taken = [m for m, _ in lean_forwards(model)]
    assert taken == [model[0], model[3]]
    # and the planted fault is seen: the Gemma-like norm through the lean forward differs from its own
    x = torch.randn(1, 3, 8)
    assert not torch.equal(RMSNormFunction.apply(x, model[1].weight, 1e-6), model[1](x))


@pytest.mark.parametrize("setting", ["parallel.activation_checkpointing", "parallel.lean_activations"])
def test_off_where_it_cannot_stand_in(setting):
    cfg = ParallelConfig(**{setting.split(".")[1]: setting.endswith("checkpointing")})
    runner = prepare_model(_model(), cfg, device="cpu", world_size=1)
    assert runner.lean_forwards == []


def test_the_census_benchmark_reports_fewer_saved_bytes(capsys):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import saved_activations

    saved_activations.main(["--model", "tiny", "--reps", "2", "--groups", "2", "--generations", "3", "--prompt", "9",
                            "--completion", "4"])
    out = capsys.readouterr().out
    total = next(line for line in out.splitlines() if line.startswith("| total |"))
    autograd_mb, lean_mb = (float(x) for x in total.split("|")[2:4])
    assert 0 < lean_mb < autograd_mb
    assert "lean: forward" in out and "autograd: forward" in out
