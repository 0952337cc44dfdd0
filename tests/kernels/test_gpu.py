"""CUDA-only checks of the Triton path (skipped without a GPU): bf16 accuracy against float64 relative to the
plain bf16 torch computation, and the peak memory bound."""

import pytest
import torch
from _cases import assert_bf16_loss_error_at_most_twice_plain

from benchmarks.harness import Shape, make_inputs, perturbed, rel_err
from fastgrpo.kernels import (
    linear_grpo_loss,
    linear_logprobs,
    reference_linear_grpo_loss,
    reference_linear_logprobs,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

SHAPES = [Shape(n=1, h=72, v=4231), Shape(n=300, h=72, v=4231), Shape(n=1024, h=512, v=32000)]


def _grads(out, upstream, leaves):
    return torch.autograd.grad((out * upstream).sum(), leaves)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s.n}x{s.h}x{s.v}")
def test_bf16_error_at_most_twice_torch_bf16(shape):
    inp = make_inputs(shape, dtype=torch.bfloat16, device="cuda", seed=11)
    h, w, t = inp["hidden"], inp["weight"], inp["targets"]
    upstream = torch.randn(shape.n, device="cuda")
    h64, w64 = (x.detach().double().requires_grad_() for x in (h, w))
    exact = reference_linear_logprobs(h64, w64, t)
    exact_g = _grads(exact, upstream.double(), (h64, w64))
    ours = linear_logprobs(h, w, t)
    ours_g = _grads(ours, upstream, (h, w))
    torch_bf16 = reference_linear_logprobs(h, w, t)  # bf16 matmul, fp32 log_softmax (TRL)
    torch_g = _grads(torch_bf16, upstream, (h, w))
    assert rel_err(ours, exact) <= 2 * rel_err(torch_bf16, exact) + 1e-6
    for a, b, e in zip(ours_g, torch_g, exact_g):
        assert rel_err(a, e) <= 2 * rel_err(b, e) + 1e-6


def test_grpo_loss_matches_torch_path_on_cuda():
    shape = Shape(n=700, h=256, v=5000)
    inp = make_inputs(shape, dtype=torch.float32, device="cuda", seed=12, zero_weight_frac=0.3)
    args = [inp[k] for k in ("hidden", "weight", "targets", "advantages", "token_weights")]
    old = perturbed(reference_linear_logprobs(*args[:3]), std=0.3)
    loss_t, _ = linear_grpo_loss(*args, old_logprobs=old, backend="triton")
    g_t = torch.autograd.grad(loss_t, args[:2])
    loss_c, _ = linear_grpo_loss(*args, old_logprobs=old, backend="torch")
    g_c = torch.autograd.grad(loss_c, args[:2])
    assert rel_err(loss_t, loss_c) < 1e-4  # float32 inputs: IEEE dots unless allow_tf32
    assert all(rel_err(a, b) < 1e-4 for a, b in zip(g_t, g_c))


def test_peak_memory_has_no_tokens_by_vocab_buffer():
    shape = Shape(n=4096, h=256, v=65536)
    inp = make_inputs(shape, dtype=torch.bfloat16, device="cuda", seed=13)
    h, w, t = inp["hidden"], inp["weight"], inp["targets"]
    chunk = 256
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    linear_logprobs(h, w, t, chunk_size=chunk).sum().backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    full_logits = shape.n * shape.v * 2
    # dx chunk (C x V bf16) + fp32 grad_weight + grads + O(N) vectors; far below one N x V bf16 tensor.
    bound = chunk * shape.v * 2 + shape.v * shape.h * (4 + 2) + shape.n * shape.h * 2 + 64 * shape.n * 4 + (8 << 20)
    assert extra < bound < full_logits / 2, (extra, bound, full_logits)


@pytest.mark.parametrize("shape", SHAPES[1:], ids=lambda s: f"{s.n}x{s.h}x{s.v}")
@pytest.mark.parametrize("backend", ["cublas", "triton"])
def test_grpo_loss_bf16_error_at_most_twice_torch_bf16(shape, backend):
    assert_bf16_loss_error_at_most_twice_plain(shape, device="cuda", backend=backend, chunk_size=128, seed=14)


def test_cublas_path_is_the_cuda_default_and_matches_torch_path_in_fp32():
    from fastgrpo.kernels import resolve_backend

    shape = Shape(n=700, h=256, v=5000)
    inp = make_inputs(shape, dtype=torch.float32, device="cuda", seed=15, zero_weight_frac=0.3)
    args = [inp[k] for k in ("hidden", "weight", "targets", "advantages", "token_weights")]
    assert resolve_backend("auto", "cuda", needs_grad=True) == "cublas"
    assert resolve_backend("auto", "cuda", needs_grad=False) == "triton"
    old = perturbed(reference_linear_logprobs(*args[:3]), std=0.3)
    loss_a, _ = linear_grpo_loss(*args, old_logprobs=old, beta=0.05, ref_logprobs=old, chunk_size=300)
    g_a = torch.autograd.grad(loss_a, args[:2])
    loss_c, _ = linear_grpo_loss(*args, old_logprobs=old, beta=0.05, ref_logprobs=old, backend="torch")
    g_c = torch.autograd.grad(loss_c, args[:2])
    assert rel_err(loss_a, loss_c) < 1e-4
    assert all(rel_err(a, b) < 1e-4 for a, b in zip(g_a, g_c))


@pytest.mark.parametrize("chunk_size", [128, 64], ids=["16-chunks-bf16-sum", "32-chunks-float32-sum"])
def test_cublas_grad_weight_summed_over_many_chunks_stays_within_the_bf16_criterion(chunk_size):
    # grad_weight is summed over chunks in bf16 (one rounding per chunk) up to _BF16_SUM_MAX_CHUNKS = 16 chunks,
    # in a float32 [V, H] buffer beyond: either way its error must be at most 2x that of the plain bf16 torch
    # computation. (The bf16 sum over 32 chunks measured 2.01x on an H100: the reason for the float32 buffer.)
    shape = Shape(n=2048, h=256, v=8192)
    inp = make_inputs(shape, dtype=torch.bfloat16, device="cuda", seed=16)
    args = [inp[k] for k in ("hidden", "weight", "targets", "advantages", "token_weights")]
    h64, w64 = (x.detach().double().requires_grad_() for x in args[:2])
    exact_g = torch.autograd.grad(reference_linear_grpo_loss(h64, w64, *args[2:])[0], (h64, w64))
    plain_g = torch.autograd.grad(reference_linear_grpo_loss(*args)[0], args[:2])
    many = torch.autograd.grad(linear_grpo_loss(*args, backend="cublas", chunk_size=chunk_size)[0], args[:2])
    assert rel_err(many[1], exact_g[1]) <= 2 * rel_err(plain_g[1], exact_g[1]) + 1e-6


def test_cublas_peak_memory_is_one_buffer_plus_gradients():
    # The "extra memory": above the inputs and the two gradients, only the [C, V] buffer and vectors
    # (16 chunks: grad_weight summed in bf16, no float32 [V, H] buffer).
    shape = Shape(n=4096, h=256, v=65536)
    inp = make_inputs(shape, dtype=torch.bfloat16, device="cuda", seed=17)
    args = [inp[k] for k in ("hidden", "weight", "targets", "advantages", "token_weights")]
    chunk = 256
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    linear_grpo_loss(*args, backend="cublas", chunk_size=chunk)[0].backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    full_logits = shape.n * shape.v * 2
    grads = (shape.v + shape.n) * shape.h * 2
    bound = grads + chunk * shape.v * 2 + 64 * shape.n * 4 + (4 << 20)
    assert extra < bound < full_logits / 2, (extra, bound, full_logits)


@pytest.mark.parametrize("backend", ["cublas", "triton"])
def test_loss_forward_and_backward_make_no_host_sync(backend):
    shape = Shape(n=1000, h=128, v=3000)
    inp = make_inputs(shape, dtype=torch.bfloat16, device="cuda", seed=18, zero_weight_frac=0.2)
    args = [inp[k] for k in ("hidden", "weight", "targets", "advantages", "token_weights")]
    linear_grpo_loss(*args, backend=backend, chunk_size=256)[0].backward()  # warm-up: compile, capability probe
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss, stats = linear_grpo_loss(*args, backend=backend, chunk_size=256)
        (2.0 * loss).backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(loss) and torch.isfinite(args[1].grad).all()
