"""grpo.max_tokens_per_microbatch null on CUDA: the budget sized from free GPU memory (fastgrpo.update.microbatch)."""

from types import SimpleNamespace

import pytest
import torch
from transformers import Qwen2Config

from fastgrpo.update.microbatch import (CAP_TOKENS, FLOOR_TOKENS, activation_bytes_per_token, auto_microbatch_tokens,
                                 pending_training_bytes)

GiB = 2**30


def _qwen05b_config():
    return Qwen2Config(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                       num_key_value_heads=2, vocab_size=151936)


class _Stub(torch.nn.Module):
    """A model's config and trainable parameters, without building the model."""

    def __init__(self, config, numel=1000):
        super().__init__()
        self.config = config
        self.w = torch.nn.Parameter(torch.zeros(numel))


def test_the_estimate_is_above_what_the_h100_measured_and_scales_with_the_model():
    per_token = activation_bytes_per_token(_qwen05b_config(), compute_bytes=2)
    # H100, Qwen2.5-0.5B shapes under bf16 autocast: about 1.6 MB per token (benchmarks/RESULTS.md); the estimate is
    # an upper bound, within 1.5x of it
    assert 1.6e6 < per_token < 1.5 * 1.6e6
    assert activation_bytes_per_token(_qwen05b_config(), compute_bytes=4) == 2 * per_token
    ckpt = activation_bytes_per_token(_qwen05b_config(), compute_bytes=2, checkpointing=True)
    assert ckpt < per_token / 10
    bigger = _qwen05b_config()
    bigger.num_hidden_layers = 48
    assert activation_bytes_per_token(bigger, compute_bytes=2) == 2 * per_token
    assert activation_bytes_per_token(SimpleNamespace(hidden_size=896, num_hidden_layers=2), compute_bytes=2) is None


def test_pending_bytes_count_missing_gradients_and_adam_moments():
    p = torch.nn.Parameter(torch.zeros(10))
    opt = torch.optim.AdamW([p])
    assert pending_training_bytes([p], opt) == 10 * 4 + 2 * 10 * 4
    p.grad = torch.ones(10)
    opt.step()
    assert pending_training_bytes([p], opt) == 0


def test_budget_grows_with_free_memory_and_stays_in_its_bounds():
    model = _Stub(_qwen05b_config())

    def tokens(free_gib, cached_gib=0.0):
        return auto_microbatch_tokens(model, None, device="cuda", compute_bytes=2,
                                      mem_info=(int(free_gib * GiB), 80 * GiB), cached_bytes=int(cached_gib * GiB)).tokens

    assert tokens(0.5) == FLOOR_TOKENS  # never below the old fixed default
    assert tokens(70) == 14336  # 0.4 * 70 GiB / ~2.09 MB, rounded down to a multiple of 1024
    assert tokens(40) < tokens(60) <= tokens(70)
    assert tokens(60, cached_gib=10) == tokens(70)  # torch's unused cache counts as free
    assert tokens(10_000) == CAP_TOKENS
    assert all(t % 1024 == 0 for t in (tokens(33), tokens(47), tokens(71)))


def test_gradients_and_moments_still_to_come_are_taken_off():
    big = _Stub(_qwen05b_config(), numel=1_000_000_000 // 4)  # 1 GB of float32 parameters -> 1 GB grads + 2 GB moments
    opt = torch.optim.AdamW(big.parameters())
    with_state = auto_microbatch_tokens(big, opt, device="cuda", compute_bytes=2, mem_info=(40 * GiB, 80 * GiB),
                                        cached_bytes=0)
    assert with_state.free_bytes == 40 * GiB - 3 * 10**9
    assert "tokens" in with_state.describe() and "GiB free" in with_state.describe()


def test_a_model_without_the_sizes_keeps_the_floor():
    sizing = auto_microbatch_tokens(_Stub(SimpleNamespace(hidden_size=896, num_hidden_layers=2)), None, device="cuda", compute_bytes=2,
                                    mem_info=(70 * GiB, 80 * GiB), cached_bytes=0)
    assert sizing.tokens == FLOOR_TOKENS and sizing.bytes_per_token is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the trainer sizes the budget on CUDA only)")
def test_the_trainer_sizes_on_cuda_from_the_devices_readings():
    model = _Stub(_qwen05b_config()).cuda()
    sizing = auto_microbatch_tokens(model, None, device="cuda", compute_bytes=2)
    assert FLOOR_TOKENS <= sizing.tokens <= CAP_TOKENS and sizing.free_bytes > 0


def test_the_trainer_sizes_once_on_cuda_and_leaves_an_explicit_budget_and_the_cpu_alone(monkeypatch, capsys):
    """Trainer.microbatch_tokens' wiring, without a GPU: the sizing function is replaced by one that counts calls."""
    from fastgrpo.trainers import grpo as trainer_mod
    from fastgrpo.config import load_config
    from fastgrpo.update.microbatch import MicrobatchSizing

    calls = []

    def fake_sizing(model, optimizer, *, device, compute_bytes, checkpointing):
        calls.append((compute_bytes, checkpointing))
        return MicrobatchSizing(tokens=12288, free_bytes=30 * GiB, bytes_per_token=2_000_000)

    monkeypatch.setattr(trainer_mod, "auto_microbatch_tokens", fake_sizing)

    def fake_trainer(overrides, device):
        return SimpleNamespace(cfg=load_config(None, overrides), device=torch.device(device), world_size=1,
                               is_main=True, model=_Stub(_qwen05b_config()), optimizer=None, _microbatch_tokens=None)

    t = fake_trainer([], "cuda")
    assert trainer_mod.Trainer.microbatch_tokens(t) == 12288
    assert trainer_mod.Trainer.microbatch_tokens(t) == 12288
    assert calls == [(2, False)]  # once per run, bf16 compute (autocast on one plain GPU)
    assert "grpo.max_tokens_per_microbatch: null -> 12288 tokens" in capsys.readouterr().out
    t = fake_trainer(["parallel.activation_checkpointing=true", "parallel.param_dtype=float32"], "cuda")
    assert trainer_mod.Trainer.microbatch_tokens(t) == 12288 and calls[-1] == (4, True)
    assert trainer_mod.Trainer.microbatch_tokens(fake_trainer(["grpo.max_tokens_per_microbatch=2048"], "cuda")) is None
    assert trainer_mod.Trainer.microbatch_tokens(fake_trainer([], "cpu")) is None
    assert len(calls) == 2
