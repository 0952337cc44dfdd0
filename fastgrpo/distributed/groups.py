"""torch.distributed helpers: process-group set-up from the torchrun environment, rank queries, reductions.

Every helper also works in a single process without a process group (world size 1), so library code calls
them unconditionally instead of branching on "are we distributed?".

``torchrun`` sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT; ``init_distributed`` reads them.
NCCL is the backend on CUDA, gloo on CPU (NCCL has no CPU tensors, gloo is slow on GPUs).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True, kw_only=True)
class DistInfo:
    rank: int
    """Global rank of this process."""
    local_rank: int
    """Rank within this node (selects the CUDA device)."""
    world_size: int
    """Number of processes in the job."""
    device: torch.device
    """The device this process computes on."""


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(device: str = "auto", *, timeout_s: float = 1800.0) -> DistInfo:
    """Initialise the default process group from torchrun's environment and pick this rank's device.

    device: 'auto' (CUDA if available), 'cuda' or 'cpu'. With WORLD_SIZE > 1 (or a torchrun launch of one
    process, which sets MASTER_ADDR) a process group is created: NCCL for CUDA, gloo for CPU. Calling it twice
    is harmless: an existing group is kept.
    """
    if device not in ("auto", "cuda", "cpu"):
        raise ValueError(f"device must be auto, cuda or cpu, got {device!r}")
    use_cuda = torch.cuda.is_available() if device == "auto" else device == "cuda"
    if use_cuda and not torch.cuda.is_available():
        raise ValueError("device='cuda' but CUDA is not available")
    rank, world = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)
    local_rank = _env_int("LOCAL_RANK", 0)
    if use_cuda:
        # Each rank owns one GPU; setting it before init lets NCCL bind the right device.
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
    else:
        dev = torch.device("cpu")
    launched = world > 1 or "MASTER_ADDR" in os.environ
    # A single process on CUDA also gets a (world-size-1) group: FSDP2 then applies there too, which is what gives
    # float32 master weights with bfloat16 compute (MixedPrecisionPolicy) on one GPU.
    if (launched or use_cuda) and dist.is_available() and not dist.is_initialized():
        dist.init_process_group(
            # CUDA: NCCL for tensors on the GPU, and gloo beside it for the few CPU tensors that ranks agree on
            # (reward failure counts, dynamic-sampling rounds, the stop flag); NCCL alone refuses those.
            backend="cpu:gloo,cuda:nccl" if use_cuda else "gloo",
            init_method=None if launched else f"tcp://127.0.0.1:{_free_port()}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=timeout_s),
            device_id=dev if use_cuda else None,
        )
    return DistInfo(rank=get_rank(), local_rank=local_rank, world_size=get_world_size(), device=dev)


def is_distributed() -> bool:
    """True when a default process group exists."""
    return dist.is_available() and dist.is_initialized()


def get_rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def get_world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def is_main() -> bool:
    """Rank 0: the process that logs, evaluates and writes files."""
    return get_rank() == 0


def barrier() -> None:
    if is_distributed():
        dist.barrier()


def all_reduce_(tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """In-place all-reduce ('sum', 'max', 'min' or 'avg') of a device tensor; identity in one process.

    'avg' is a sum followed by a division so it also works on gloo, which has no AVG op.
    """
    ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN, "avg": dist.ReduceOp.SUM}
    if op not in ops:
        raise ValueError(f"op must be one of {sorted(ops)}, got {op!r}")
    if is_distributed():
        dist.all_reduce(tensor, op=ops[op])
        if op == "avg":
            tensor.div_(get_world_size())
    return tensor


def all_reduce_int(value: int, op: str = "max", *, device: torch.device | str = "cpu") -> int:
    """All-reduce a Python int (e.g. the number of micro-batches) and return it; a host sync, once per step.

    device must be one the process group's backend can reduce on (CUDA for NCCL). In a single process the value is
    returned as it is: no tensor, no host sync.
    """
    if not is_distributed():
        return int(value)
    t = torch.tensor([value], dtype=torch.int64, device=device)
    return int(all_reduce_(t, op).item())


def destroy_distributed(*, barrier: bool = True) -> None:
    """Tear the process group down, once every rank is here when ``barrier`` (a run that ended normally).

    The barrier keeps a rank that finished first from closing its gloo connections while a peer is still in (or
    entering) its last collective: on the CPU that races the peer's gloo threads, and the process dies at exit with
    "terminate called without an active exception" after its work is done (as seen in CI). A run that
    ends in an error skips it: a peer that died would leave it waiting forever.
    """
    if is_distributed():
        if barrier:
            dist.barrier()
        dist.destroy_process_group()
