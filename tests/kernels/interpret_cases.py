"""Triton kernels under the CPU interpreter. Not collected by default (no ``test_`` prefix): test_triton_interpret.py
runs this file in a subprocess with ``TRITON_INTERPRET=1``, which must be set before Triton kernels are defined.

Interpreter tiles are 16 x 32 x 16 (``_triton.INTERPRET_BLOCKS``), so these tiny shapes still cover several
row / vocabulary / K tiles, ragged edges, several vocabulary splits and several backward chunks.
"""

import os

import pytest
import torch
from _cases import assert_small, grpo_errors, logprobs_errors

from benchmarks.harness import Shape, make_inputs
from fastgrpo.kernels import linear_grpo_loss

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")

SHAPE = Shape(n=37, h=24, v=75)  # 3 row tiles, 3 vocabulary tiles, 2 K tiles, all ragged
TOL = 1e-5
BF16_GRAD_TOL = 1e-2  # dx and grad_hidden are stored in bf16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_logprobs_entropy_temperature(dtype):
    errs = logprobs_errors(SHAPE, dtype=dtype, backend="triton", temperature=0.7, entropy=True, chunk_size=16)
    assert_small(errs, TOL, grad_tol=TOL if dtype == torch.float32 else BF16_GRAD_TOL)


def test_triton_logprobs_single_row():
    assert_small(logprobs_errors(Shape(n=1, h=24, v=75), dtype=torch.float32, backend="triton", seed=1), TOL)


@pytest.mark.parametrize(
    "dtype, case",
    [(torch.float32, dict(beta=0.1, delta=1.3)), (torch.bfloat16, dict(old=False, entropy=True))],
    ids=["fp32-old-beta-delta", "bf16-old-none"],
)
def test_triton_grpo_loss_skips_zero_weight_rows(dtype, case):
    errs = grpo_errors(SHAPE, dtype=dtype, backend="triton", zero_weight_frac=0.3, chunk_size=16, seed=2, **case)
    assert_small(errs, TOL, grad_tol=TOL if dtype == torch.float32 else BF16_GRAD_TOL)


def test_triton_grpo_all_zero_weights():
    inp = make_inputs(SHAPE, dtype=torch.float32, seed=3)
    loss, stats = linear_grpo_loss(inp["hidden"], inp["weight"], inp["targets"], inp["advantages"],
                                   torch.zeros(SHAPE.n), backend="triton")
    loss.backward()
    assert loss.item() == 0.0 and torch.count_nonzero(inp["weight"].grad) == 0
    assert torch.count_nonzero(stats["logprobs"]) == 0
