"""Peak figures of GPUs by device name: the denominators of MFU and of the decode step's bandwidth floor.

Vendor data sheets, dense (no sparsity). Off CUDA, or for a GPU not listed, a lookup is None and no such ratio is
reported.
"""

from __future__ import annotations

import torch

__all__ = ["PEAK_BANDWIDTH", "PEAK_BF16", "device_peak_bandwidth", "device_peak_flops"]

# Dense bf16 peak FLOP/s by device-name substring (vendor data sheets, no sparsity).
PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12, "L4": 121e12}


def _by_device_name(table: dict[str, float], device: torch.device | str) -> float | None:
    """The first value of ``table`` whose key is in the CUDA device's name; None off CUDA or for an unknown GPU."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in table.items() if k in name), None)


def device_peak_flops(device: torch.device | str) -> float | None:
    """The device's dense bf16 peak FLOP/s, or None off CUDA / for an unknown GPU (then no MFU is reported)."""
    return _by_device_name(PEAK_BF16, device)


# Peak memory bandwidth in bytes/s by device-name substring, most specific first (vendor data sheets).
PEAK_BANDWIDTH = {"H200": 4.8e12, "H100 PCIe": 2.0e12, "H100": 3.35e12, "A100-PCIE-40GB": 1.555e12,
                  "A100": 2.039e12, "L40S": 0.864e12, "A10G": 0.6e12, "L4": 0.3e12}


def device_peak_bandwidth(device: torch.device | str) -> float | None:
    """The device's peak memory bandwidth in bytes/s, or None off CUDA / for an unknown GPU."""
    return _by_device_name(PEAK_BANDWIDTH, device)
