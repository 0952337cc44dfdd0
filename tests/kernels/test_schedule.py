"""The Triton path's launch schedule, host side: occupancy from a compiled kernel's resources,
vocabulary splits and split-K sized against waves, balanced backward chunks, L2-sized launch groups. Pure
arithmetic on the sm_90 figures benchmarks/check_hopper.py reports; the kernels' numerics under every schedule
choice are tested in interpret_cases.py."""

import pytest

_schedule = pytest.importorskip("fastgrpo.kernels._schedule", reason="needs triton")

SMS, V = 132, 151936


def wave_efficiency(programs: int, per_program: int, slots: int) -> float:
    """Useful work over the time of ceil(programs / slots) waves of the longest program."""
    return programs * per_program / (-(-programs // slots) * slots * per_program)


def test_programs_per_sm_from_registers_shared_memory_and_warps():
    kib = 1024
    assert _schedule.programs_per_sm(214, 97 * kib, 8) == 1  # the bf16 forward: 216 x 256 regs per CTA
    assert _schedule.programs_per_sm(108, 97 * kib, 8) == 2  # _dhidden_kernel: registers allow 2, smem 2
    assert _schedule.programs_per_sm(108, 120 * kib, 8) == 1  # ... unless its shared memory grows
    assert _schedule.programs_per_sm(64, 1 * kib, 8) == 4  # 64 regs x 256 threads: 4 CTAs of 16384 registers
    assert _schedule.programs_per_sm(16, 0, 4) == 16  # 128-thread CTAs: the 2048-thread limit
    assert _schedule.programs_per_sm(255, 200 * kib, 8) == 1  # never 0


@pytest.mark.parametrize("n", [1, 4096, 16384])
def test_forward_splits_fill_the_last_wave(n):
    tiles = -(-V // 128)
    row_blocks = -(-n // 128)
    splits, per = _schedule.fwd_splits(n, V, 128, 128, SMS)  # one 214-register program per SM
    assert (splits - 1) * per < tiles <= splits * per  # every split starts on a valid tile
    assert wave_efficiency(row_blocks * splits, per, SMS) >= 0.95
    if n == 4096:  # the old rule (2 programs per SM assumed) gave 9 splits: 288 programs, 3 waves at 73%
        assert wave_efficiency(32 * 9, -(-tiles // 9), SMS) < 0.75


def test_backward_chunks_whole_batch_when_it_saves_memory_else_balanced():
    # N=4096: dx for all rows (1.24 GB) is less than two chunks' dx plus the float32 [V, H] sum they need.
    assert _schedule.backward_chunk(4096, V, 2048, 2, 128, None) == 4096
    chunk = _schedule.backward_chunk(16384, V, 3584, 2, 128, None)
    assert chunk % 128 == 0 and chunk * V * 2 <= _schedule._DX_BUDGET_BYTES and -(-16384 // chunk) == 5
    assert 5 * chunk - 16384 < 128 * 5  # at most one row block of padding per chunk (not 4 x 3456 + 2560)
    assert _schedule.backward_chunk(37, 75, 24, 4, 16, 16) == 16
    assert _schedule.backward_chunk(5, 75, 24, 4, 16, None) == 16
    assert _schedule.backward_chunk(300, 75, 24, 4, 16, 128) == 112  # 3 chunks of 112, not 128 + 128 + 44


def test_split_k_removes_most_of_dhidden_tail():
    slots = 2 * SMS  # _dhidden_kernel: 2 programs per SM
    k_tiles = -(-V // 64)
    programs = (3328 // 128) * (2048 // 128)  # a 3328-row chunk at H=2048: 416 programs, 1.58 waves
    s = _schedule.split_k(programs, k_tiles, slots)
    assert s > 1 and wave_efficiency(programs * s, -(-k_tiles // s), slots) >= 0.9
    assert wave_efficiency(programs, k_tiles, slots) < 0.8  # without split-K
    assert _schedule.split_k(256, k_tiles, slots) == 1  # 256 programs: one nearly full wave


def test_l2_groups_fit_half_the_cache():
    l2 = 50 << 20
    group = _schedule.l2_group(128 * 3584 * 2, 128, l2)  # forward at H=3584: hidden row blocks of 896 KiB
    assert group * 128 * 3584 * 2 <= l2 // 2 < (group + 1) * 128 * 3584 * 2
    assert _schedule.l2_group(128 * 2048 * 2, 8, l2) == 8 and _schedule.l2_group(10**9, 8, l2) == 1
