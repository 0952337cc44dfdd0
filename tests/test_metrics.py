import json

import pytest
import torch

from benchmarks.op_counter import OpCounter
from fastgrpo.runtime.metrics import StepMetrics
from fastgrpo.runtime.sinks import drop_records_after


def test_reduce_kinds():
    m = StepMetrics()
    m.add("clip", torch.tensor(0.5), 10.0)
    m.add("clip", torch.tensor(0.0), 30.0)
    m.total("loss", torch.tensor(1.5))
    m.total("loss", torch.tensor(-0.5))
    m.max("len_max", torch.tensor(3.0))
    m.max("len_max", torch.tensor(7.0))
    m.min("adv_min", torch.tensor(-1.0))
    m.min("adv_min", torch.tensor(-4.0))
    v = torch.tensor([1.0, 2.0, float("nan"), 4.0])
    m.moments(v, "r/mean", "r/std")
    m.host("lr", 1e-3)
    out = m.reduce()
    assert out["clip"] == 0.125  # token-weighted, not the mean of the two micro-batch fractions
    assert out["loss"] == 1.0 and out["len_max"] == 7.0 and out["adv_min"] == -4.0 and out["lr"] == 1e-3
    finite = v[~v.isnan()]
    assert abs(out["r/mean"] - finite.mean().item()) < 1e-6 and abs(out["r/std"] - finite.std().item()) < 1e-6


def test_drop_records_after(tmp_path):
    p = tmp_path / "metrics.jsonl"
    p.write_text("".join(json.dumps({"step": s}) + "\n" for s in (1, 2, 3, 4)))
    drop_records_after(p, 2)
    assert [json.loads(x)["step"] for x in p.read_text().splitlines()] == [1, 2]


def test_wandb_runs_offline_without_an_api_key(monkeypatch, tmp_path):
    import sys
    import types

    calls = {}
    fake = types.ModuleType("wandb")

    class Run:
        def log(self, data, step):
            calls.setdefault("log", []).append((step, data))

        def finish(self):
            calls["finished"] = True

    def init(**kwargs):
        calls["init"] = kwargs
        return Run()

    fake.init = init
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    from fastgrpo.runtime.sinks import WandbSink

    sink = WandbSink("proj", "run", {"a": 1}, tmp_path)
    sink.write({"step": 3, "reward/mean": 0.5})
    sink.close()
    assert calls["init"]["mode"] == "offline" and calls["init"]["project"] == "proj"
    assert calls["log"] == [(3, {"reward/mean": 0.5})] and calls["finished"]


def test_a_torn_last_line_is_dropped_and_the_next_record_starts_a_line(tmp_path, capsys):
    p = tmp_path / "metrics.jsonl"
    p.write_text('{"step": 1}\n{"step": 2}\n{"step": 3, "rew')  # killed in the middle of writing step 3
    drop_records_after(p, 5)
    assert "torn last line" in capsys.readouterr().out
    assert p.read_text() == '{"step": 1}\n{"step": 2}\n'
    p.write_text('{"step": 1}\n{"step": 2}')  # complete, but killed before its newline
    drop_records_after(p, 5)
    assert p.read_text() == '{"step": 1}\n{"step": 2}\n'


def test_a_broken_line_in_the_middle_names_its_line(tmp_path):
    import pytest

    p = tmp_path / "metrics.jsonl"
    p.write_text('{"step": 1}\nnot json\n{"step": 3}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl line 2 is not valid JSON"):
        drop_records_after(p, 5)


def test_add_many_gives_the_numbers_of_add():
    gen = torch.Generator().manual_seed(0)
    one, many = StepMetrics(), StepMetrics()
    for n in (7.0, 1.0, 30.0):  # three micro-batches of n tokens
        stats = {f"s{k}": torch.rand((), generator=gen) for k in range(4)}
        for key, value in stats.items():
            one.add(key, value, n)
        many.add_many(stats, n)
    assert one.reduce() == many.reduce()


def test_a_metric_is_added_the_same_way_every_time():
    m = StepMetrics()
    m.add_many({"a": torch.tensor(1.0), "b": torch.tensor(2.0)}, 3.0)
    with pytest.raises(ValueError, match="'a'"):
        m.add("a", torch.tensor(1.0))


def test_nothing_is_read_from_the_device_before_reduce_and_reduce_reads_once():
    m = StepMetrics()
    counter = OpCounter()
    with counter.active():
        for n in (3.0, 5.0):
            m.add_many({"a": torch.tensor(0.5), "b": torch.tensor(0.25)}, n)
            m.total("loss", torch.tensor(1.5))
        m.set("grad_norm", torch.tensor(2.0))
        m.moments(torch.tensor([1.0, float("nan"), 3.0]), "r/mean", "r/std")
        m.max("len_max", torch.tensor(4.0))
        m.min("adv_min", torch.tensor(-1.0))
        assert counter.total(kind="syncs") == 0, counter.by_name(kind="syncs")
        out = m.reduce()
    assert counter.total(kind="syncs") == 1
    assert out["a"] == 0.5 and out["loss"] == 3.0 and out["r/mean"] == 2.0 and out["adv_min"] == -1.0


@pytest.mark.parametrize("tied", [True, False])
def test_decode_step_bytes_counts_the_weights_per_batch_and_every_sequences_cache(tied):
    """The decode floor's bytes: weights once per batch of sequences (the input embedding only where it
    is the head), keys and values of every sequence's context once; counted by hand on a small Qwen2."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from fastgrpo.runtime.peaks import device_peak_bandwidth
    from fastgrpo.runtime.step_cost import decode_step_bytes

    cfg = Qwen2Config(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
    model = Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    embed = 100 * 32
    total = sum(p.numel() for p in model.parameters())  # parameters() yields a tied weight once
    weights = 2 * (total - (0 if tied else embed))
    kv_per_token = 2 * 3 * 2 * 8 * 2  # keys and values, 3 layers, 2 kv heads of 8, bf16
    got = decode_step_bytes(model, sequences=10, batch_size=4, context=20.5)
    assert got == 3 * weights + 10 * 20.5 * kv_per_token
    assert device_peak_bandwidth("cpu") is None


def test_peak_figures_go_by_the_device_name_most_specific_first(monkeypatch):
    from fastgrpo.runtime import peaks

    for name, bandwidth in (("NVIDIA H100 80GB HBM3", 3.35e12), ("NVIDIA H100 PCIe", 2.0e12),
                            ("NVIDIA H200", 4.8e12), ("NVIDIA GeForce RTX 4090", None)):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device, name=name: name)
        assert peaks.device_peak_bandwidth("cuda") == bandwidth, name
        assert peaks.device_peak_flops("cuda") == (None if bandwidth is None else 989e12), name
