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


def test_causal_pairs_count_a_shared_prefix_once_and_a_completion_over_prefix_and_own_tokens():
    from fastgrpo.runtime.step_cost import causal_pairs

    assert causal_pairs([(8, 8)]) == 36  # one unshared sequence of 8: 1 + 2 + ... + 8
    # prefix of 5 once (15), then two own segments of 3, each over 5 + its own causal 3 (15 + 6)
    assert causal_pairs([(5, 5), (3, 8), (3, 8)]) == 15 + 2 * 21
    assert causal_pairs([(5, 5), (3, 8), (3, 8)]) < causal_pairs([(8, 8), (8, 8)])


def _shared_batch(seed: int, *, groups: int = 3, g: int = 4, same_prompt: bool = True):
    """``groups`` prompts of odd lengths, each sampled ``g`` times, completions of 1-9 tokens; ``same_prompt``
    False: every sample's prompt differs from the first token (nothing to share)."""
    gen = torch.Generator().manual_seed(seed)
    prompts, completions = [], []
    for k in range(groups):
        prompt = torch.randint(1, 50, (int(torch.randint(9, 23, (1,), generator=gen)),), generator=gen).tolist()
        for j in range(g):
            prompts.append(prompt if same_prompt else [50 + 4 * k + j, *prompt[1:]])
            completions.append(torch.randint(1, 50, (int(torch.randint(1, 10, (1,), generator=gen)),),
                                             generator=gen).tolist())
    return prompts, completions


def _update_work(prompts, completions, *, shared: bool, budget: int = 1024, buckets=()):
    from fastgrpo.update.step import count_update_tokens, plan_step

    plan = plan_step(prompts, completions, budget, device="cpu", shared_prefix=shared, buckets=buckets)
    metrics = StepMetrics()
    count_update_tokens(metrics, plan.mbs)
    return plan.mbs, metrics.reduce()


@pytest.mark.parametrize("budget, buckets", [(1024, ()), (30, ()), (30, (32, 64))])
def test_the_update_counts_the_attention_pairs_its_rows_mask_in(budget, buckets):
    """The pairs count_update_tokens logs are the entries the rows' block-causal masks let through, padding left out:
    forwarded ones from the shared plan (a budget of 30 splits each group into parts that repeat its prefix, or
    leaves a part that would not pay unshared; buckets pad the rows), the sequences' own ones from the batch planned
    unshared."""
    from fastgrpo.models.attention import block_causal_mask

    prompts, completions = _shared_batch(0, groups=2, g=8)

    def masked(mbs):
        return sum(int(block_causal_mask(mb)[..., :mb.num_real_tokens, :mb.num_real_tokens].sum()) for mb in mbs
                   if not mb.is_dummy)

    shared_mbs, work = _update_work(prompts, completions, shared=True, budget=budget, buckets=buckets)
    unshared_mbs, _ = _update_work(prompts, completions, shared=False, budget=budget, buckets=buckets)
    assert sum(mb.shares_prefix for mb in shared_mbs) >= (1 if budget > 100 else 3)  # 30: a group in two rows
    assert work["perf/update_attention_pairs_forwarded"] == masked(shared_mbs)
    assert work["perf/update_attention_pairs"] == masked(unshared_mbs)
    assert work["perf/update_completion_tokens"] == sum(map(len, completions))


def _qwen2(layers: int = 2):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return Qwen2ForCausalLM(Qwen2Config(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                                        num_attention_heads=4, num_key_value_heads=2))


def test_update_flops_count_a_trunk_pass_per_token_the_head_on_completions_and_the_attention_pairs():
    from fastgrpo.runtime.step_cost import UpdateCost, update_flops

    model = _qwen2()
    cost = UpdateCost.of(model)
    layer = sum(p.numel() for p in model.model.layers[0].parameters())
    assert cost.trunk_params == 2 * layer + 32  # two blocks and the final norm; the embedding is a lookup
    assert cost.head_params == 32 * 100 and cost.attention_width == 2 * 4 * 8
    # two sequences: 3 + 2 and 4 + 1 tokens
    assert update_flops(model, [3, 4], [2, 1]) == (6 * cost.trunk_params * 10 + 6 * 3200 * 3
                                                   + 12 * 64 * (15 + 15))


def test_update_flops_on_a_shared_layout_are_fewer_and_equal_the_unshared_where_nothing_is_shared():
    """The trainer's count (count_update_tokens, then add_update_flops): a batch of G samples per prompt planned with
    its prefixes shared has fewer forwarded FLOPs than its sequences', which equal the unshared count of the
    benchmarks' ``update_flops``; a batch whose prompts differ from the first token, or one planned unshared, has
    both counts equal."""
    from fastgrpo.runtime.metrics import add_update_flops
    from fastgrpo.runtime.step_cost import UpdateCost, update_flops

    model = _qwen2()
    cost = UpdateCost.of(model)

    def flops(prompts, completions, shared):
        _, record = _update_work(prompts, completions, shared=shared, budget=60)
        add_update_flops(record, cost, update_s=1.0, num_iterations=2, peak_flops=None, world_size=1)
        assert "perf/mfu" not in record  # no peak (a CPU): the FLOPs alone
        return record["perf/update_flops_forwarded"], record["perf/update_flops"]

    prompts, completions = _shared_batch(1)
    unshared = 2 * update_flops(model, [len(p) for p in prompts], [len(c) for c in completions])
    forwarded, sequences = flops(prompts, completions, shared=True)
    assert sequences == unshared and forwarded < 0.8 * sequences
    assert flops(prompts, completions, shared=False) == (unshared, unshared)
    prompts, completions = _shared_batch(1, same_prompt=False)
    forwarded, sequences = flops(prompts, completions, shared=True)
    assert forwarded == sequences == 2 * update_flops(model, [len(p) for p in prompts], [len(c) for c in completions])


def test_mfu_is_logged_on_the_forwarded_flops_and_on_the_sequences_per_device():
    from fastgrpo.runtime.metrics import add_update_flops
    from fastgrpo.runtime.step_cost import UpdateCost

    record = {"perf/update_tokens": 100.0, "perf/update_tokens_forwarded": 40.0, "perf/update_completion_tokens": 20.0,
              "perf/update_attention_pairs": 500.0, "perf/update_attention_pairs_forwarded": 300.0}
    cost = UpdateCost(trunk_params=1000, head_params=50, attention_width=2)
    add_update_flops(record, cost, update_s=0.5, num_iterations=3, peak_flops=1e6, world_size=2)
    assert record["perf/update_flops"] == 3 * (6 * 1000 * 100 + 6 * 50 * 20 + 12 * 2 * 500)
    assert record["perf/update_flops_forwarded"] == 3 * (6 * 1000 * 40 + 6 * 50 * 20 + 12 * 2 * 300)
    assert record["perf/mfu"] == record["perf/update_flops_forwarded"] / (0.5 * 1e6 * 2)
    assert record["perf/mfu_sequences"] == record["perf/update_flops"] / (0.5 * 1e6 * 2)
    empty = {"perf/update_tokens": 1.0}  # an update that counted no work: nothing added
    add_update_flops(empty, cost, update_s=0.5, num_iterations=1, peak_flops=1e6, world_size=1)
    assert empty == {"perf/update_tokens": 1.0}
