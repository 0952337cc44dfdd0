"""Target ids outside ``[0, V)``: one check, called by every path of the fused ops (torch, triton, cublas).

An id outside the vocabulary (an ignore index such as -100, a tokenizer that does not match the head) has no
log-prob. Unchecked, the paths disagree: the chunked torch path's ``gather`` raises on the CPU and trips a
device assert on CUDA, the Triton forward returns ``-lse`` (no vocabulary split holds the target), and the
cublas path reads a neighbouring row's logit (row 0 reads before its buffer). So ``logprobs.check_inputs``
calls ``check_targets`` before any work, for every backend:

* tensors on the CPU (the torch path, the Triton interpreter): checked here; a ``ValueError`` names the first
  bad position. Free: nothing waits for a device.
* CUDA tensors: checked on the device, without a host sync. A host check (``.any()`` then ``if``) would make the
  CPU wait for every queued kernel, i.e. the whole model forward before the lm_head, once per micro-batch,
  and stall the CPU's run-ahead; the fused paths avoid host syncs for that reason. A one-pass Triton kernel
  with ``tl.device_assert`` (this kernel alone is compiled in debug mode) reads the ``[N]`` ids; a bad id
  stops the CUDA context with "device-side assert triggered", our message printed on stderr, reported at the
  next synchronisation (``loss.item()``), as torch's own index kernels (gather, embedding, cross_entropy) do.
  The error is sticky, so no later kernel of the op runs on the bad id. Without Triton, ``torch._assert_async``
  does the same with torch's generic message.
  Alternatives weighed: a NaN log-prob plus a flag read later (no error where the mistake is made, and every
  caller would have to read the flag), and a check where a sync already happens (the cublas and Triton paths
  have none; only the torch path's ``nonzero`` syncs).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the environment
    triton = None

MESSAGE = "targets must lie in [0, V)"


def check_targets(targets: torch.Tensor, vocab: int) -> None:
    """Raise (CPU) or device-assert (CUDA, no host sync) unless every target id lies in ``[0, vocab)``."""
    n = targets.numel()
    if n == 0:
        return
    if targets.device.type != "cuda":
        bad = (targets < 0) | (targets >= vocab)
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 0])
            raise ValueError(f"{MESSAGE} = [0, {vocab}): targets[{i}] = {int(targets[i])} (to drop a position, e.g. "
                             "an ignore index, give it token weight 0 and any valid id)")
    elif triton is not None:
        _check_targets_kernel[(triton.cdiv(n, _BLOCK),)](targets, n, vocab, BLOCK=_BLOCK, num_warps=4)
    else:  # pragma: no cover - CUDA without Triton
        torch._assert_async(((targets >= 0) & (targets < vocab)).all(), MESSAGE)


if triton is not None:
    _BLOCK = 1024

    @triton.jit(debug=True)  # tl.device_assert is compiled only in debug mode
    def _check_targets_kernel(t_ptr, n, vocab, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        t = tl.load(t_ptr + offs, mask=offs < n, other=0)
        tl.device_assert((t >= 0) & (t < vocab), "fastgrpo: targets must lie in [0, V)")
