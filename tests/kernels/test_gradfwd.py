"""The "cublas" loss path's pieces that run without Triton's interpreter: backend selection and errors. (Its kernels
run in interpret_cases.py and test_gpu.py; the closed-form token-loss gradient it uses is tested in
test_objective.py.)"""

import pytest
import torch

from benchmarks.harness import Shape, make_inputs
from fastgrpo.kernels import linear_grpo_loss, linear_logprobs, resolve_backend

_gradfwd = pytest.importorskip("fastgrpo.kernels._gradfwd", reason="needs triton")


def test_backend_selection_and_errors():
    inp = make_inputs(Shape(n=8, h=16, v=40), dtype=torch.float32, seed=1)
    h, w = inp["hidden"], inp["weight"]
    assert resolve_backend("auto", h.device, needs_grad=True) == "torch"  # CPU
    assert resolve_backend("auto", h.device, needs_grad=False) == "torch"
    args = [inp[k] for k in ("hidden", "weight", "targets", "advantages", "token_weights")]
    if not _gradfwd.INTERPRET:
        with pytest.raises(ValueError, match="cublas.*CUDA"):
            linear_grpo_loss(*args, backend="cublas")
    with pytest.raises(ValueError, match="backend must be one of"):
        linear_grpo_loss(*args, backend="cuda")
    with pytest.raises(ValueError, match="no backward"):
        linear_logprobs(h, w, inp["targets"], backend="cublas")  # differentiable inputs
    if not _gradfwd.INTERPRET:
        with torch.no_grad(), pytest.raises(ValueError, match="cublas.*CUDA"):
            linear_logprobs(h, w, inp["targets"], backend="cublas")
