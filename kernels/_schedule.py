"""Host-side launch schedule of the Triton backend (``_triton.py``): how many programs the GPU holds at once, and
the grid sizes, launch groups and backward chunks chosen from that. Pure arithmetic except ``resident_programs``,
which reads a compiled kernel's registers on CUDA. benchmarks/roofline.py imports these same functions to model
the schedule on an H100 / H200 without a GPU.
"""

from __future__ import annotations

import functools

import torch
import triton

# Grids are sized from what the hardware holds at once, so that the last wave is not mostly idle:
#   slots   = SMs x programs per SM (from the compiled kernel's registers, shared memory and warps);
#   waves   = ceil(programs / slots); a kernel's time ~ waves x the work of one program.
# benchmarks/roofline.py models the same schedule with the sm_90 compile's figures, without a GPU.

_DX_BUDGET_BYTES = 1 << 30  # the backward's [C, V] dx buffer when chunking
_CPU_SLOTS = 16  # the interpreter: as if on a small GPU, so the tests' tiny shapes still split the vocabulary
_L2_BYTES_DEFAULT = 50 << 20  # H100 / H200
_MAX_SPLIT_K = 8


def programs_per_sm(regs: int, smem_bytes: int, num_warps: int, *, regs_per_sm: int = 65536,
                    smem_per_sm: int = 233472, threads_per_sm: int = 2048, max_blocks: int = 32) -> int:
    """Programs (CTAs) of one kernel resident on one SM (sm_90 defaults): registers are allocated per warp in
    units of 256, each CTA reserves 1 KiB of shared memory beyond what it asks for."""
    regs_per_warp = -(-max(regs, 1) * 32 // 256) * 256
    by_regs = (regs_per_sm // regs_per_warp) // num_warps
    by_smem = smem_per_sm // (smem_bytes + 1024)
    by_threads = threads_per_sm // (32 * num_warps)
    return max(1, min(by_regs, by_smem, by_threads, max_blocks))


_SLOTS: dict = {}


def resident_programs(kernel, args, kw, device) -> int:
    """Programs of ``kernel`` (compiled for ``args``/``kw``) that the whole device holds at once. On CUDA this
    compiles the kernel ahead of its launch (``warmup``, cached by Triton) and reads its register count; the
    answer is cached per kernel variant, so the schedule of a call never depends on what ran before it."""
    if device.type != "cuda":
        return _CPU_SLOTS
    key = (kernel.__name__, device.index, str(args[0].dtype), tuple(sorted(kw.items())))
    if key not in _SLOTS:
        props = torch.cuda.get_device_properties(device)
        try:
            compiled = kernel.warmup(*args, grid=(1,), **kw)
            compiled._init_handles()  # loads the binary: fills n_regs
            per_sm = programs_per_sm(
                compiled.n_regs, compiled.metadata.shared, compiled.metadata.num_warps,
                regs_per_sm=getattr(props, "regs_per_multiprocessor", 65536),
                smem_per_sm=getattr(props, "shared_memory_per_multiprocessor", 233472),
                threads_per_sm=getattr(props, "max_threads_per_multi_processor", 2048))
        except Exception:  # pragma: no cover - a Triton whose CompiledKernel differs: assume one program per SM
            per_sm = 1
        _SLOTS[key] = per_sm * props.multi_processor_count
    return _SLOTS[key]


def l2_bytes(device) -> int:
    if device.type == "cuda":
        return getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or _L2_BYTES_DEFAULT
    return _L2_BYTES_DEFAULT


def l2_group(reused_bytes_per_tile: int, n_tiles: int, l2_bytes: int) -> int:
    """Tiles of the reused axis in one launch group (``_tile_ids``): as many as half the L2 holds."""
    return max(1, min(n_tiles, (l2_bytes // 2) // max(1, reused_bytes_per_tile)))


@functools.lru_cache(maxsize=1024)
def fwd_splits(n: int, vocab: int, block_m: int, block_v: int, slots: int) -> tuple[int, int]:
    """``(splits, tiles_per_split)`` of the forward's vocabulary: the fewest splits whose waves x tiles per
    program is within 2% of the best (more splits mean shorter programs, hence a less idle last wave)."""
    n_tiles = triton.cdiv(vocab, block_v)
    row_blocks = triton.cdiv(n, block_m)
    options = []
    for s in range(1, min(n_tiles, 2 * slots) + 1):
        per = triton.cdiv(n_tiles, s)
        s_eff = triton.cdiv(n_tiles, per)  # every split starts on a valid tile
        options.append((triton.cdiv(row_blocks * s_eff, slots) * per, s_eff, per))
    best = min(t for t, _, _ in options)
    _, splits, per = next(o for o in options if o[0] <= 1.02 * best)
    return splits, per


def split_k(programs: int, k_tiles: int, slots: int) -> int:
    """K splits for a grid of ``programs`` equal programs: the fewest that bring waves x K tiles per program
    within 3% of the best over 1..``_MAX_SPLIT_K`` (each split adds a float32 partial to write and sum)."""
    options = [(triton.cdiv(programs * s, slots) * triton.cdiv(k_tiles, s), s)
               for s in range(1, min(_MAX_SPLIT_K, k_tiles) + 1)]
    best = min(t for t, _ in options)
    return next(s for t, s in options if t <= 1.03 * best)


def backward_chunk(n: int, vocab: int, h_dim: int, elt: int, block_m: int, chunk_size: int | None) -> int:
    """Rows per backward chunk, a multiple of BLOCK_M. Without ``chunk_size``: the whole batch when its ``dx``
    takes no more memory than chunking would (several chunks also need the float32 ``[V, H]`` sum of
    ``grad_weight``), else balanced chunks within ``_DX_BUDGET_BYTES`` (N=16384: five of 3328 rows, not four of
    3456 and a tail of 2560)."""
    whole = triton.cdiv(n, block_m) * block_m
    if chunk_size is None:
        if whole * vocab * elt <= _DX_BUDGET_BYTES + 4 * vocab * h_dim:
            return whole
        chunk_size = _DX_BUDGET_BYTES // (vocab * elt)
    cap = max(block_m, min(chunk_size, whole) // block_m * block_m)
    n_chunks = triton.cdiv(n, cap)
    return min(cap, triton.cdiv(triton.cdiv(n, n_chunks), block_m) * block_m)
