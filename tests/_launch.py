"""Run a test worker as 2 (or K) gloo ranks with torchrun's environment, the way the FSDP/vLLM tests need."""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path

import pytest
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(argv: list[str], *, what: str, timeout: float, world_size: int = 2) -> list[str]:
    """Start ``argv`` once per rank (RANK/WORLD_SIZE/MASTER_* set, CPU only, 1 thread); return each rank's output.

    Skips when gloo is unavailable; fails the test, with the ranks' output, on a non-zero exit or a hang (a
    collective that one rank never reaches hangs the others, hence the timeout).
    """
    if not (dist.is_available() and dist.is_gloo_available()):
        pytest.skip("torch.distributed with gloo is not available on this platform")
    port = free_port()
    procs = []
    for rank in range(world_size):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
               "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "",
               "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
        procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=timeout)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"{what}: timed out after {timeout:.0f} s (ranks out of step in a collective?)")
    if any(p.returncode for p in procs):
        pytest.fail(f"{what} failed:\n" + "\n----\n".join(logs)[-6000:])
    return logs


def run_cli(module: str, args: list[str], env_extra: dict | None = None,
            timeout: float = 300) -> subprocess.CompletedProcess:
    """``python -m module args...`` (an entry point: fastgrpo.train, fastgrpo.sft) with captured output."""
    import sys

    env = dict(os.environ, **(env_extra or {}))
    # An ignored SIGINT is inherited across exec, and a Python started with it ignored never raises
    # KeyboardInterrupt: if anything earlier in this pytest process set SIG_IGN (an in-process engine's or worker's
    # set-up), the SIGINT tests of the child would see it exit 0. The child starts with the default disposition.
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, env=env,
                          timeout=timeout, preexec_fn=_default_sigint)


def _default_sigint() -> None:
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # a blocked signal is inherited too


def assert_same_weights(folder_a: Path, folder_b: Path) -> None:
    """Two Hugging Face exports hold bit-identical tensors under the same names."""
    import torch
    from safetensors.torch import load_file

    a, b = load_file(folder_a / "model.safetensors"), load_file(folder_b / "model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
