"""Chunked torch backend (what the trainer runs on CPU) against the float64 reference, fp32 inputs."""

import pytest
import torch
import torch.utils._python_dispatch
from _cases import (FROZEN, assert_frozen_skips_its_gradient, assert_second_backward_refused, assert_small,
                    grpo_errors, logprobs_errors)

from benchmarks.harness import Shape, make_inputs, peak_cpu_alloc_mb, rel_err
from fastgrpo.kernels import linear_grpo_loss, linear_logprobs, reference_linear_grpo_loss

TOL = 1e-5
ODD = Shape(n=37, h=72, v=4231)  # neither H nor V a multiple of any block size
SMALL = Shape(n=23, h=40, v=301)


@pytest.mark.parametrize("shape", [ODD, SMALL, Shape(n=1, h=16, v=97)], ids=["odd", "small", "n1"])
@pytest.mark.parametrize("chunk_size", [None, 5])
def test_logprobs_match_reference(shape, chunk_size):
    assert_small(logprobs_errors(shape, dtype=torch.float32, backend="torch", chunk_size=chunk_size), TOL)


@pytest.mark.parametrize("temperature", [0.6, 1.7])
def test_logprobs_and_entropy_with_temperature(temperature):
    errs = logprobs_errors(SMALL, dtype=torch.float32, backend="torch", temperature=temperature, entropy=True,
                           chunk_size=4, seed=3)
    assert_small(errs, TOL)


def test_bf16_inputs_run_in_float32():
    # Upcast chunk by chunk: values are fp32-exact for the rounded inputs; gradients are rounded to bf16.
    errs = logprobs_errors(SMALL, dtype=torch.bfloat16, backend="torch", entropy=True, seed=4)
    assert_small(errs, TOL, grad_tol=1e-2)


@pytest.mark.parametrize(
    "case",
    [
        dict(),
        dict(old=False),
        dict(delta=1.25, epsilon_high=0.1),
        dict(beta=0.05),
        dict(beta=0.1, delta=1.5, temperature=0.8, entropy=True),
        dict(zero_weight_frac=0.0, chunk_size=3),
    ],
    ids=["old", "old_none", "delta", "beta", "all", "dense_chunked"],
)
def test_grpo_loss_matches_reference(case):
    assert_small(grpo_errors(SMALL, dtype=torch.float32, backend="torch", seed=5, **case), TOL)


def test_grpo_loss_odd_shape():
    assert_small(grpo_errors(ODD, dtype=torch.float32, backend="torch", beta=0.04, seed=6), TOL)


def test_grpo_all_zero_weights_give_zero_loss_and_grads():
    inp = make_inputs(SMALL, dtype=torch.float32, seed=7)
    zeros = torch.zeros(SMALL.n)
    loss, stats = linear_grpo_loss(inp["hidden"], inp["weight"], inp["targets"], inp["advantages"], zeros,
                                   old_logprobs=torch.full((SMALL.n,), -80.0), backend="torch")
    loss.backward()
    assert loss.item() == 0.0
    assert torch.count_nonzero(inp["hidden"].grad) == 0 and torch.count_nonzero(inp["weight"].grad) == 0
    assert all(torch.isfinite(v).all() for v in stats.values())
    assert stats["clip_low_frac"].item() == 0.0


def test_tied_embedding_gradients_accumulate_into_shared_weight():
    # The lm_head weight is also the input embedding: the gradient reaching it is the sum of both uses.
    torch.manual_seed(8)
    n, h, v = 29, 24, 157
    ids, targets = torch.randint(0, v, (n,)), torch.randint(0, v, (n,))
    mix = torch.randn(h, h) / h**0.5
    adv, tw = torch.randn(n), torch.full((n,), 1.0 / n)

    def grads(loss_fn):
        emb = torch.nn.Embedding(v, h)
        with torch.no_grad():
            emb.weight.copy_(torch.randn(v, h, generator=torch.Generator().manual_seed(9)))
        hidden = torch.tanh(emb(ids) @ mix)  # a stand-in trunk
        loss, _ = loss_fn(hidden, emb.weight, targets, adv, tw, beta=0.0)
        loss.backward()
        return emb.weight.grad

    ours = grads(lambda *a, **k: linear_grpo_loss(*a, backend="torch", chunk_size=4, **k))
    ref = grads(reference_linear_grpo_loss)
    assert rel_err(ours, ref) <= TOL
    assert ours[ids].abs().sum() > 0  # the embedding path contributed too


def test_no_tokens_by_vocab_tensor_is_ever_created():
    # Every tensor produced by any op (forward and backward) is recorded; the chunked path stays at
    # chunk x V and the weight-sized buffers, while the reference builds N x V.
    dispatch = pytest.importorskip("torch.utils._python_dispatch")
    from torch.utils._pytree import tree_flatten

    class LargestTensor(dispatch.TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.numel = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            sizes = [x.numel() for x in tree_flatten(out)[0] if isinstance(x, torch.Tensor)]
            self.numel = max([self.numel, *sizes])
            return out

    shape, chunk = Shape(n=128, h=16, v=2048), 16
    inp = make_inputs(shape, dtype=torch.float32, seed=10)
    with LargestTensor() as seen:
        linear_logprobs(inp["hidden"], inp["weight"], inp["targets"], chunk_size=chunk).sum().backward()
    assert seen.numel <= max(chunk * shape.v, shape.v * shape.h, shape.n * shape.h)
    assert seen.numel < shape.n * shape.v // 4


def test_grpo_loss_bf16_inputs():
    # The loss path upcasts too: fp32-exact values for the rounded inputs, gradients rounded to bf16.
    errs = grpo_errors(SMALL, dtype=torch.bfloat16, backend="torch", beta=0.04, entropy=True, seed=11)
    assert_small(errs, TOL, grad_tol=1e-2)


class _Products(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the multiply-adds of every matrix product (mm / addmm) run inside the mode, and the largest tensor."""

    def __init__(self):
        super().__init__()
        self.macs = 0
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (torch.ops.aten.mm.default, torch.ops.aten.mm.out, torch.ops.aten.addmm.default,
                    torch.ops.aten.addmm_.default, torch.ops.aten.addmm.out):
            a, b = (args[1], args[2]) if "addmm" in str(func) else (args[0], args[1])
            self.macs += a.shape[0] * a.shape[1] * b.shape[1]
        from torch.utils._pytree import tree_flatten

        sizes = [x.numel() for x in tree_flatten(out)[0] if isinstance(x, torch.Tensor)]
        self.largest = max([self.largest, *sizes])
        return out


def _loss_products(shape, *, zero_adv_frac=0.0, zero_weight_frac=0.0, beta=0.0, seed=12):
    inp = make_inputs(shape, dtype=torch.float32, seed=seed, zero_weight_frac=zero_weight_frac)
    adv = inp["advantages"].clone()
    adv[torch.rand(shape.n, generator=torch.Generator().manual_seed(seed)) < zero_adv_frac] = 0.0
    ref = torch.zeros(shape.n) - 3.0 if beta else None
    with _Products() as seen:
        loss, _ = linear_grpo_loss(inp["hidden"], inp["weight"], inp["targets"], adv, inp["token_weights"],
                                   beta=beta, ref_logprobs=ref, backend="torch")
        loss.backward()
    moving = (inp["token_weights"] != 0) & ((adv != 0) | (beta != 0))
    return seen, int((inp["token_weights"] != 0).sum()), int(moving.sum())


def test_loss_path_runs_exactly_three_products():
    # The gradient is formed in forward: one N x V x H product forward, two for the gradients, none recomputed.
    shape = Shape(n=300, h=24, v=509)
    seen, counted, moving = _loss_products(shape)
    assert counted == moving == shape.n
    assert seen.macs == 3 * shape.n * shape.v * shape.h


def test_loss_path_skips_rows_without_gradient():
    # Weight-0 rows run no product; advantage-0 rows (beta 0) run only the forward one; with beta != 0 they move.
    shape = Shape(n=300, h=24, v=509)
    seen, counted, moving = _loss_products(shape, zero_adv_frac=0.4, zero_weight_frac=0.2)
    assert 0 < moving < counted < shape.n
    assert seen.macs == (counted + 2 * moving) * shape.v * shape.h
    seen, counted, moving = _loss_products(shape, zero_adv_frac=0.4, zero_weight_frac=0.2, beta=0.1)
    assert seen.macs == 3 * counted * shape.v * shape.h


def test_loss_path_second_backward_is_refused_clearly():
    assert_second_backward_refused(SMALL, backend="torch", seed=13)


def test_loss_path_scales_by_upstream_gradient_and_skips_frozen_weight():
    inp = make_inputs(SMALL, dtype=torch.float32, seed=14)
    args = [inp[k] for k in ("hidden", "weight", "targets", "advantages", "token_weights")]
    loss, _ = linear_grpo_loss(*args, backend="torch")
    g1 = torch.autograd.grad(loss, (inp["hidden"], inp["weight"]))
    loss, _ = linear_grpo_loss(*args, backend="torch")
    g3 = torch.autograd.grad(-3.0 * loss, (inp["hidden"], inp["weight"]))
    for a, b in zip(g1, g3):
        torch.testing.assert_close(b, -3.0 * a)
    frozen = inp["weight"].detach()  # a frozen head (e.g. LoRA): no weight gradient is formed
    with _Products() as seen:
        loss, _ = linear_grpo_loss(args[0], frozen, *args[2:], backend="torch")
        (gh,) = torch.autograd.grad(loss, args[0])
    torch.testing.assert_close(gh, g1[0])
    assert seen.macs == 2 * SMALL.n * SMALL.v * SMALL.h


def test_loss_logprobs_equal_linear_logprobs_bitwise():
    # Old log-probs from linear_logprobs and the loss's own log-probs share the chunk step, so a policy that has
    # not moved gives a ratio of exactly 1.
    shape = Shape(n=600, h=40, v=301)
    inp = make_inputs(shape, dtype=torch.float32, seed=15)
    with torch.no_grad():
        old = linear_logprobs(inp["hidden"], inp["weight"], inp["targets"], temperature=0.7, backend="torch")
    _, stats = linear_grpo_loss(inp["hidden"], inp["weight"], inp["targets"], inp["advantages"],
                                inp["token_weights"], old_logprobs=old, temperature=0.7, backend="torch")
    assert torch.equal(stats["logprobs"], old)


@pytest.mark.parametrize("fn", ["logprobs", "loss"])
def test_default_chunks_stay_within_a_fifth_of_the_logits(fn):
    # Enough rows that the fifth of [N, V] (not the minimum chunk) decides; every tensor created is recorded.
    from fastgrpo.kernels import _chunked

    shape = Shape(n=3000, h=16, v=331)
    assert _chunked._chunk_rows(shape.n, shape.v, torch.device("cpu"), None) > _chunked._MIN_ROWS
    inp = make_inputs(shape, dtype=torch.float32, seed=16)
    with _Products() as seen:
        if fn == "logprobs":
            linear_logprobs(inp["hidden"], inp["weight"], inp["targets"], backend="torch").sum().backward()
        else:
            linear_grpo_loss(*(inp[k] for k in ("hidden", "weight", "targets", "advantages", "token_weights")),
                             backend="torch")[0].backward()
    assert seen.largest <= max(shape.n * shape.v // 5, shape.n * shape.h, shape.v * shape.h)


def test_chunk_rows_rule():
    from fastgrpo.kernels import _chunked

    cpu = torch.device("cpu")
    v = 151936
    budget_rows = _chunked._budget_bytes("cpu", None) // (4 * v)
    assert _chunked._chunk_rows(4096, v, cpu, None) == 820  # a fifth of N, evened: 5 x 820 >= 4096
    assert _chunked._chunk_rows(100_000, v, cpu, None) <= budget_rows  # the device budget caps it
    assert _chunked._chunk_rows(700, v, cpu, None) == 234  # 3 chunks of at most _MIN_ROWS, evened out
    assert _chunked._chunk_rows(100, v, cpu, None) == 100
    assert _chunked._chunk_rows(100, v, cpu, 7) == 7
    with pytest.raises(ValueError, match="chunk_size"):
        _chunked._chunk_rows(100, v, cpu, 0)


def test_precise_at_a_large_vocabulary():
    # Qwen2.5's vocabulary: a row sum of 150k terms in order would lose about 1e-5; the path adds pairwise, so
    # log-probs, entropy and loss hold 1e-6. The gradients go through grad_hidden = dX @ W, a BLAS product with
    # K = V whose summation order is the library's: on this 2-core machine the same code gave 7e-7 with one thread
    # and 3.1e-5 with two (MKL picks another kernel), about sqrt(V) float32 roundings (2.3e-5). Their bound
    # allows that and stays over 20x below a bf16 computation's gradient error (2.5e-3 in tests/kernels/test_gpu.py).
    shape = Shape(n=16, h=32, v=151936)
    assert_small(logprobs_errors(shape, dtype=torch.float32, backend="torch", entropy=True, seed=17), 1e-6,
                 grad_tol=1e-4)
    assert_small(grpo_errors(shape, dtype=torch.float32, backend="torch", entropy=True, seed=17), 1e-6,
                 grad_tol=1e-4)


# ------------------------------------------- a frozen head (LoRA) or a frozen trunk: only the gradient taken is formed
FROZEN_SHAPE = Shape(n=64, h=48, v=509)  # [V, H] larger than any chunk buffer or [N, H] tensor


@pytest.mark.parametrize("frozen", FROZEN)
@pytest.mark.parametrize("fn", ["logprobs", "loss"])
def test_frozen_input_gets_no_gradient_and_the_other_is_bit_identical(fn, frozen):
    assert_frozen_skips_its_gradient(FROZEN_SHAPE, fn=fn, frozen=frozen, backend="torch", chunk_size=16, seed=20,
                                     beta=0.1)


@pytest.mark.parametrize("frozen", [None, *FROZEN])
@pytest.mark.parametrize("fn", ["logprobs", "loss"])
def test_frozen_input_skips_its_product(fn, frozen):
    # Recompute path: 4 products (forward, recomputed logits, one per gradient); loss path: 3. A frozen input drops
    # the product that forms its gradient.
    shape = FROZEN_SHAPE
    inp = make_inputs(shape, dtype=torch.float32, seed=21)
    hidden = inp["hidden"].detach().requires_grad_(frozen != "trunk")
    weight = inp["weight"].detach().requires_grad_(frozen != "head")
    with _Products() as seen:
        if fn == "logprobs":
            linear_logprobs(hidden, weight, inp["targets"], backend="torch").sum().backward()
        else:
            linear_grpo_loss(hidden, weight, inp["targets"], inp["advantages"], inp["token_weights"],
                             backend="torch")[0].backward()
    products = (4 if fn == "logprobs" else 3) - (frozen is not None)
    assert seen.macs == products * shape.n * shape.v * shape.h


@pytest.mark.parametrize("fn", ["logprobs", "loss"])
def test_frozen_head_peak_memory_is_smaller_by_the_weight_gradient(fn):
    # The allocator's own events (harness.peak_cpu_alloc_mb, the figure bench_lora.py head reports): a frozen head
    # saves the float32 [V, H] gradient and holds nothing of that size. Each peak starts with no .grad to free.
    shape = Shape(n=128, h=64, v=4096)
    inp = make_inputs(shape, dtype=torch.float32, seed=22)
    vh_mb = shape.v * shape.h * 4 / 2**20

    def peak(weight):
        def step():
            if fn == "logprobs":
                linear_logprobs(inp["hidden"], weight, inp["targets"], backend="torch", chunk_size=32).sum().backward()
            else:
                linear_grpo_loss(inp["hidden"], weight, inp["targets"], inp["advantages"], inp["token_weights"],
                                 backend="torch", chunk_size=32)[0].backward()
        inp["hidden"].grad = inp["weight"].grad = None
        return peak_cpu_alloc_mb(step)

    trainable, frozen = peak(inp["weight"]), peak(inp["weight"].detach())
    assert trainable >= vh_mb and frozen <= trainable - 0.99 * vh_mb, (trainable, frozen)
    assert frozen < vh_mb
    # The loss path's gradient, formed in forward, is moved into weight.grad, not cloned: one [V, H] at the peak.
    assert trainable < 2 * vh_mb, trainable
