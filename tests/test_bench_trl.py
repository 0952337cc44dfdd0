"""The side-by-side benchmark against TRL gives both trainers the same work (benchmarks/peer_work.py), keeps
start-up and warm-up out of its ratios (benchmarks/bench_trl.py), and the GPU call's summary gives each headline
target its verdict (benchmarks/gpu_summary.py; on fabricated step outputs, never a device's figures).

Runs without TRL: the fastgrpo side is checked through fastgrpo's own config loader; the TRL side through
GRPOConfig only where TRL is installed (the bench environment, `make bench-env`).
"""

import dataclasses

import pytest
import torch
import yaml

from benchmarks import peer_work
from benchmarks.bench_trl import UNSHARED
from fastgrpo.config import load_config, to_dict


def _spec(name, engine, tmp_path):
    work = peer_work.WORKS[name]
    return peer_work.make_spec(work, model_dir=tmp_path / "model", prompts_file=tmp_path / "p.jsonl", prompt_len=10,
                               engine=engine, run_dir=str(tmp_path / "run"))


@pytest.mark.parametrize("engine", ["hf", "vllm"])
@pytest.mark.parametrize("name", sorted(peer_work.WORKS))
def test_both_configs_ask_for_the_same_grpo_run(name, engine, tmp_path):
    spec = _spec(name, engine, tmp_path)
    path = tmp_path / "fastgrpo.yaml"
    path.write_text(yaml.safe_dump(peer_work.fastgrpo_config(spec)))
    parsed = to_dict(load_config(path))  # what fastgrpo itself reads from the file, after validation
    ours = peer_work.settings_of_fastgrpo(parsed)
    theirs = peer_work.settings_of_trl(peer_work.trl_config(spec))
    assert ours == theirs
    assert ours["sequences_per_step"] == spec["prompts_per_step"] * spec["generations"]
    assert ours["loss_type"] == "dr_grpo" and ours["beta"] == 0.0


def test_fastgrpo_set_overrides_reach_the_config_fastgrpo_reads(tmp_path):
    """--fastgrpo-set (e.g. the graphed configuration against TRL): dotted keys, values read as YAML, the
    shared GRPO settings unchanged."""
    spec = _spec("tiny", "hf", tmp_path) | {"fastgrpo_set": [
        "parallel.master_weights=true", "parallel.token_buckets=[2048,4096]", "grpo.max_tokens_per_microbatch=4096"]}
    path = tmp_path / "fastgrpo.yaml"
    path.write_text(yaml.safe_dump(peer_work.fastgrpo_config(spec)))
    cfg = load_config(path)
    assert cfg.parallel.master_weights and cfg.parallel.token_buckets == [2048, 4096]
    assert cfg.grpo.max_tokens_per_microbatch == 4096
    assert peer_work.settings_of_fastgrpo(to_dict(cfg)) == peer_work.settings_of_trl(peer_work.trl_config(spec))
    with pytest.raises(ValueError, match="is not KEY=VALUE"):
        peer_work.fastgrpo_config(spec | {"fastgrpo_set": ["parallel.master_weights"]})


@pytest.mark.parametrize("name", sorted(peer_work.WORKS))
def test_trl_reads_the_same_settings(name, tmp_path):
    pytest.importorskip("trl")
    from trl import GRPOConfig

    spec = _spec(name, "hf", tmp_path)
    args = GRPOConfig(**peer_work.trl_config(spec))
    read_back = {f.name: getattr(args, f.name) for f in dataclasses.fields(args)}
    assert peer_work.settings_of_trl(read_back) == peer_work.settings_of_fastgrpo(peer_work.fastgrpo_config(spec))
    assert args.gradient_checkpointing is False and args.steps_per_generation == args.gradient_accumulation_steps


def test_lora_asks_both_sides_for_the_same_adapters(tmp_path):
    """--lora R: fastgrpo's model.lora and TRL's peft_config name the same rank, scale, dropout and layers; without
    it both sides train every weight."""
    spec = _spec("smollm2", "hf", tmp_path) | {"lora_rank": 16}
    path = tmp_path / "fastgrpo.yaml"
    path.write_text(yaml.safe_dump(peer_work.fastgrpo_config(spec)))
    cfg = load_config(path)
    assert cfg.model.lora.rank == 16 and cfg.model.lora.alpha == 32
    ours = peer_work.settings_of_fastgrpo(to_dict(cfg))
    assert ours == peer_work.settings_of_trl(peer_work.trl_config(spec), peer_work.trl_lora_config(spec))
    assert ours["lora"] == (16, 32, 0.0, "all-linear")
    full = _spec("smollm2", "hf", tmp_path)
    assert peer_work.trl_lora_config(full) is None
    assert peer_work.settings_of_fastgrpo(peer_work.fastgrpo_config(full))["lora"] is None
    assert ours != peer_work.settings_of_trl(peer_work.trl_config(full))  # a one-sided LoRA would not pass
    peft = pytest.importorskip("peft")
    read = peft.LoraConfig(**peer_work.trl_lora_config(spec))
    assert (read.r, read.lora_alpha, read.lora_dropout, read.target_modules) == (16, 32, 0.0, "all-linear")


def test_suppress_eos_makes_eos_unreachable_at_unchanged_shapes(tmp_path):
    from transformers import AutoModelForCausalLM

    from fastgrpo.models.tiny import build_tiny

    folder = build_tiny(cache_dir=tmp_path)
    eos = peer_work.eos_ids_of(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    ids = torch.randint(0, 250, (3, 40), generator=torch.Generator().manual_seed(1))  # [B, T], no EOS inputs
    with torch.no_grad():
        before = model(input_ids=ids).logits.softmax(-1)[..., eos].max()
        peer_work.suppress_eos(model, eos)
        after = model(input_ids=ids).logits.softmax(-1)[..., eos].max()
    assert before > 1e-4  # a random model does emit EOS now and then
    assert after < 1e-15
    assert {k: v.shape for k, v in model.state_dict().items()} == shapes


def test_spread_reward_varies_within_a_group():
    ids = [[3, 5, 7], [3, 5, 8], [9], [100, 2]]
    scores = peer_work.spread_reward(completions=["a"] * 4, completion_ids=ids, nums=[[1]] * 4)
    assert scores == [15 / 100, 16 / 100, 9 / 100, 1 / 100]
    assert len(set(scores)) == len(scores)


# -- timing: start-up and warm-up apart from the timed steps; pairs scheduled within a budget ----------------------


def _run(side, repeat, step_s, *, launch=1000.0, startup=7.0, gen=0.1, update=None, work=None):
    """A finished run record as bench_trl.run_side returns it (fabricated test data)."""
    work = work or {"sequences": 2, "prompt_len": 3, "max_completion_length": 4}
    t, steps = launch + startup, []
    for i, s in enumerate(step_s):
        steps.append({"step": i + 1, "t_begin": t, "step_s": s, "gen_s": gen, "update_s": update or s - gen,
                      "prompt_tokens": work["sequences"] * work["prompt_len"],
                      "completion_tokens": work["sequences"] * work["max_completion_length"]})
        t += s
    return {"side": side, "repeat": repeat, "steps": steps, "launch_time": launch, "peak_rss_bytes": 10**9,
            "cuda_peak_bytes": None, "wall_s": t - launch, "error": ""}


def test_phases_keep_start_up_and_warm_up_apart_from_the_timed_steps():
    from benchmarks.bench_trl import phases

    ph = phases(_run("fastgrpo", 0, [9.0, 2.0, 1.0, 1.2, 0.8], startup=7.5), warmup=2)
    assert ph["startup_s"] == pytest.approx(7.5)
    assert ph["first_step_s"] == 9.0 and ph["other_warmup_s"] == [2.0]
    assert ph["timed_steps"] == 3 and ph["timed_step_s"] == (1.0, 0.8, 1.2)


def test_ratios_use_only_the_timed_steps_and_the_phases_are_reported_beside_them():
    from benchmarks.bench_trl import markdown, summarize

    work = {"sequences": 2, "prompt_len": 3, "max_completion_length": 4, "warmup": 2, "steps": 3, "model": "m",
            "prompts_per_step": 1, "generations": 2}
    runs = [_run("fastgrpo", 0, [50.0, 5.0, 1.0, 1.0, 1.0]), _run("trl", 0, [1.0, 1.0, 2.0, 2.0, 2.0], startup=3.0)]
    s = summarize("w", work, runs)
    step = next(r for r in s["rows"] if r["metric"] == "step")
    assert step["ratios"] == [0.5]  # the 50 s first step (a compile) is not in it
    assert s["phases"]["fastgrpo"][0]["first_step_s"] == 50.0 and s["phases"]["trl"][0]["startup_s"] == 3.0
    text = markdown(s)
    assert "first step" in text and "50.00" in text and "0.50 (0.50-0.50)" in text


def test_fastgrpo_steps_take_their_clock_from_the_train_step_stamps(tmp_path):
    import json

    from benchmarks.bench_trl import STEP_TIMES, _read_steps

    (tmp_path / "fastgrpo").mkdir()
    metrics = [{"step": i, "time/rollout_s": 0.5, "time/update_s": 0.25, "perf/rollout_tokens": 8,
                "perf/update_tokens": 14} for i in (1, 2)]
    (tmp_path / "fastgrpo" / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    (tmp_path / STEP_TIMES).write_text(json.dumps({"t_begin": 123.0, "step_s": 0.9}) + "\n")  # 2nd not stamped
    steps = _read_steps("fastgrpo", tmp_path)
    assert steps[0]["t_begin"] == 123.0 and steps[0]["step_s"] == 0.9  # the whole train_step
    assert "t_begin" not in steps[1] and steps[1]["step_s"] == 0.75  # rollout + update
    assert steps[1]["prompt_tokens"] == 6 and steps[1]["completion_tokens"] == 8


def test_pairs_take_turns_between_works_and_none_starts_past_the_budget():
    from benchmarks.bench_trl import alternated_pairs

    now = [0.0]
    pair_seconds = {"big": 100.0, "small": 30.0}
    order = []

    def run_pair(name, rep, sides):
        order.append((name, rep, sides))
        now[0] += pair_seconds[name]
        return [{"side": s, "repeat": rep, "steps": [], "error": ""} for s in sides]

    runs = alternated_pairs(["big", "small"], 3, 200.0, run_pair, clock=lambda: now[0])
    # round 0: big (0-100), small (100-130); round 1: big would end at 230 > 200: skipped; small ends at 160;
    # round 2: small would end at 190: runs.
    assert order == [("big", 0, ("fastgrpo", "trl")), ("small", 0, ("fastgrpo", "trl")),
                     ("small", 1, ("trl", "fastgrpo")), ("small", 2, ("fastgrpo", "trl"))]
    assert [r["error"] for r in runs["big"]] == ["", "", "skipped: time budget", "skipped: time budget"] + [
        "skipped: time budget"] * 2
    assert len(runs["small"]) == 6 and not any(r["error"] for r in runs["small"])


# -- the GPU call's summary (benchmarks/gpu_summary.py), on fabricated outputs of each step ---------------------


def _decode_table(monkeypatch, ours_s: float, theirs_s: float) -> str:
    """bench_rollout's own --hf-vs-generate table (its ``alternated``), timed by a fake clock: test data."""
    import types

    from benchmarks import bench_rollout

    clock = [0.0]

    def timed(seconds):
        def fn():
            clock[0] += seconds
            return 64 * 128
        return fn

    monkeypatch.setattr(bench_rollout, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    table, _ = bench_rollout.alternated({"fastgrpo HFEngine": timed(ours_s), "transformers generate": timed(theirs_s)},
                                        "transformers generate", 3)
    return "device: TEST DATA; 8 prompts x 8 samples, prompt 64 tokens\n\n" + table


def test_decode_ratio_is_read_from_bench_rollouts_table(monkeypatch):
    from benchmarks.gpu_summary import parse_decode

    parsed = parse_decode(_decode_table(monkeypatch, 1.0, 4.0))
    assert parsed["sequences"] == 64
    assert parsed["rows"]["fastgrpo HFEngine"]["ratio"] == (0.25, 0.25, 0.25)
    assert parsed["rows"]["transformers generate"]["tokens"] == 64 * 128


def test_gpu_summary_gives_each_target_its_verdict(tmp_path, monkeypatch):
    """Fabricated step outputs (TEST DATA, no figure of any device): the 0.5B pair meets the update target and
    misses the step target, decode is 4x generate, one test failed, the kernels step was skipped."""
    import json

    from benchmarks.bench_trl import summarize
    from benchmarks.gpu_summary import summary

    work = {"sequences": 2, "prompt_len": 3, "max_completion_length": 4, "warmup": 1, "steps": 2, "model": "m",
            "prompts_per_step": 1, "generations": 2}
    # fastgrpo: step 1.4 s = 0.9 generation + 0.5 update; TRL: step 2.0 = 1.0 + 1.0 -> update 0.5x, step 0.7x
    runs = [_run("fastgrpo", 0, [5.0, 1.4, 1.4], gen=0.9), _run("trl", 0, [5.0, 2.0, 2.0], gen=1.0)]
    trl = {"command": "TEST", "works": [summarize("qwen0.5b-shape", work, runs) | {"runs": runs}]}
    (tmp_path / "bench_trl.json").write_text(json.dumps(trl))
    (tmp_path / "decode.log").write_text(_decode_table(monkeypatch, 1.0, 4.0))
    (tmp_path / "pytest.xml").write_text(
        '<testsuites><testsuite name="pytest" tests="3" failures="1" errors="0" skipped="1">'
        '<testcase classname="tests.test_packing" name="test_a"/>'
        '<testcase classname="tests.test_packing" name="test_b"><failure message="x"/></testcase>'
        '<testcase classname="tests.test_packing" name="test_c"><skipped/></testcase></testsuite></testsuites>')
    (tmp_path / "steps.tsv").write_text("trl\tok\t200\t330\t\ndecode\tok\t40\t90\t\npytest\tfailed\t60\t150\texit 1\n"
                                        "kernels\tskipped\t0\t12\ttime budget spent\n")
    (tmp_path / "device.txt").write_text("TEST DATA")
    text = summary(tmp_path)
    verdict = {line.split("|")[1].strip(): line.split("|")[4].strip() for line in text.splitlines()
               if line.startswith("| ") and line.count("|") == 5}
    assert verdict["policy update, fastgrpo / TRL, Qwen2.5-0.5B shapes, bf16"] == "met"  # 0.5 <= 0.7
    assert verdict["whole step, fastgrpo / TRL, Qwen2.5-0.5B shapes, bf16"] == "not met"  # 0.7 > 0.6
    assert verdict["policy update, fastgrpo / TRL, tiny model, bf16"] == "not run"
    assert "| tiny: no finished pair; step trl ok |" in text
    assert verdict["decode, fastgrpo hf engine vs transformers `generate`, 64 sequences (speed-up)"] == "met"
    assert verdict["kernels, packing, losses, decode tests on CUDA (failed + errors)"] == "not met"
    assert "`tests.test_packing::test_b`" in text and "| kernels | skipped | 0 | 12 | time budget spent |" in text
    assert "4.00x" in text and "0.50 (0.50-0.50), 1 pair" in text


def test_gpu_summary_says_why_nothing_was_measured(tmp_path):
    from benchmarks.gpu_summary import summary

    (tmp_path / "steps.tsv").write_text("trl\tunavailable\t0\t0\ttrl or datasets is not importable\n"
                                        "decode\ttimeout\t90\t90\t\n")
    text = summary(tmp_path)
    assert "step trl unavailable: trl or datasets is not importable | <= 0.7 | not run |" in text
    assert "step decode timeout after 90 s | >= 2x | not run |" in text
    assert "step pytest not in this call" in text


# -- --update-only: TRL's update against grpo_update on one fixed batch (benchmarks/trl_update.py) --------------------


def test_update_only_batch_is_padded_as_trl_pads_and_its_control_is_not():
    from benchmarks.trl_update import draw_batches, trl_rollout_output

    batch, control = draw_batches(16, 4, 300, seed=2, completion_mean=20.0, completion_cap=40)
    assert len(batch.prompts) == len(control.prompts) == 16
    assert [len(p) for p in batch.prompts[:4]] == [len(batch.prompts[0])] * 4  # a group shares its prompt
    assert len({len(c) for c in batch.completions}) > 1 and batch.padding_frac > 0.1
    assert control.padding_frac == 0 and abs(control.real_tokens - batch.real_tokens) <= 16
    assert torch.equal(batch.advantages, control.advantages)
    out = trl_rollout_output(batch, torch.device("cpu"), pad_id=0)
    i = min(range(16), key=lambda k: len(batch.prompts[k]))  # the shortest prompt: left padding
    p_len, c_len = len(batch.prompts[i]), len(batch.completions[i])
    assert out["prompt_mask"][i].tolist() == [0] * (out["prompt_ids"].shape[1] - p_len) + [1] * p_len
    assert out["prompt_ids"][i, -p_len:].tolist() == batch.prompts[i]
    assert out["completion_ids"][i, :c_len].tolist() == batch.completions[i]
    assert out["completion_mask"][i].sum() == c_len and out["completion_mask"][i, :c_len].all()
    assert int(out["num_items_in_batch"]) == sum(len(c) for c in batch.completions)
    assert out["prompt_ids"].numel() + out["completion_ids"].numel() == batch.padded_slots


def test_update_only_gradients_agree_with_trls_and_pairs_are_timed(tmp_path):
    """TRL's own training_step on its padded layout and grpo_update on the packed sequences: the same gradients
    (float32, CPU), then one alternated pair per batch."""
    pytest.importorskip("trl")
    import json

    from benchmarks.bench_trl import main

    out = tmp_path / "upd"
    assert main(["--update-only", "--shape", "tiny", "--sequences", "8", "--generations", "4", "--trl-micro-batch",
                 "4", "--completion-mean", "12", "--completion-cap", "24", "--repeats", "1", "--workdir",
                 str(tmp_path), "--out", str(out)]) == 0
    report = json.loads(out.with_suffix(".json").read_text())
    assert report["parity"]["max_rel_diff"] < 1e-4 and report["parity"]["max_abs_grad"] > 0
    countdown, control = report["batches"]
    assert countdown["padding_frac"] > 0 and control["padding_frac"] == 0
    for b in report["batches"]:
        assert b["pairs"] == 1
        for side in ("trl", "fastgrpo"):
            assert len(b["seconds"][side]) == 1 and b["seconds"][side][0] > 0 and b["peak_mb"][side][0] > 0
    assert "| countdown lengths |" in out.with_suffix(".md").read_text()
    # the same with fastgrpo on bf16 weights with float32 masters and rows padded to buckets (--fastgrpo-set)
    assert main(["--update-only", "--shape", "tiny", "--sequences", "8", "--generations", "4", "--trl-micro-batch",
                 "4", "--completion-mean", "12", "--completion-cap", "24", "--repeats", "1", "--no-control",
                 "--workdir", str(tmp_path), "--out", str(out), "--fastgrpo-set", "parallel.master_weights=true",
                 "--fastgrpo-set", "parallel.token_buckets=[256,512]", "--fastgrpo-set",
                 "grpo.max_tokens_per_microbatch=512"]) == 0
    report = json.loads(out.with_suffix(".json").read_text())
    assert report["dtype"] == "bf16 weights, float32 masters" and report["fastgrpo_microbatch_tokens"] == 512
    assert report["parity"]["max_rel_diff"] < 0.1  # bf16 against TRL's float32


@pytest.mark.parametrize("name, writes_nothing", [("gpu_trl_update_and_head.sh", False), ("run_gpu.sh", True)])
def test_the_gpu_scripts_refuse_a_machine_without_cuda_unless_smoke(tmp_path, name, writes_nothing):
    """benchmarks/gpu_trl_update_and_head.sh and run_gpu.sh (make bench-gpu) parse (bash -n) and, with no CUDA device
    and no SMOKE=1, stop at once with exit 2 and say why; run_gpu.sh writes nothing (the other opens its log first; SMOKE=1 runs their steps at tiny shapes on a
    CPU: the update-only and kernel runs tested above; run_gpu.sh's whole smoke run takes minutes and is not a test)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible")
    script = Path(__file__).resolve().parents[1] / "benchmarks" / name
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    env = dict(os.environ, OUT=str(tmp_path), PYTHON=sys.executable, SMOKE="0")
    proc = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "no CUDA device visible" in proc.stderr + proc.stdout
    assert not (writes_nothing and any(tmp_path.iterdir()))


def test_the_unshared_side_gets_its_own_column_and_sharings_ratio():
    from benchmarks.bench_trl import markdown, summarize

    work = {"sequences": 2, "prompt_len": 3, "max_completion_length": 4, "warmup": 1, "steps": 2, "model": "m",
            "prompts_per_step": 1, "generations": 2}
    runs = [_run("fastgrpo", 0, [9.0, 1.0, 1.0]), _run(UNSHARED, 0, [9.0, 2.0, 2.0]), _run("trl", 0, [9.0, 4.0, 4.0])]
    s = summarize("w", work, runs)
    step = next(r for r in s["rows"] if r["metric"] == "step")
    assert step["ratios"] == [0.25] and step["ratios_unshared"] == [0.5] and step["ratios_sharing"] == [0.5]
    text = markdown(s)
    assert "prompts unshared" in text and "shared / unshared" in text
    assert "prompts unshared" not in markdown(summarize("w", work, [runs[0], runs[2]]))


def _with_flops(run, flops, forwarded):
    """A fastgrpo run record whose steps carry the update FLOPs its trainer counted (fabricated test data)."""
    return run | {"steps": [st | {"flops": flops, "flops_forwarded": forwarded} for st in run["steps"]]}


def _three_sides_work(peak_flops):
    work = {"sequences": 2, "prompt_len": 3, "max_completion_length": 4, "warmup": 1, "steps": 2, "model": "m",
            "prompts_per_step": 1, "generations": 2, "peak_flops": peak_flops}
    # updates: fastgrpo 0.5 s, unshared 1.0 s, TRL 2.0 s (steps 1.0 / 1.5 / 2.5 s, generation 0.5 s each)
    runs = [_with_flops(_run("fastgrpo", 0, [9.0, 1.0, 1.0], gen=0.5), 600.0, 200.0),
            _with_flops(_run(UNSHARED, 0, [9.0, 1.5, 1.5], gen=0.5), 600.0, 600.0),
            _run("trl", 0, [9.0, 2.5, 2.5], gen=0.5)]
    return work, runs


def test_mfu_rows_count_the_forwarded_and_the_sequences_flops_and_trls_are_the_sequences():
    """MFU per side on both counts: fastgrpo's from the FLOPs its trainer logged; TRL, which forwards every
    sequence whole here, gets the sequences' FLOPs of the same work on both; off CUDA (no peak) the rows say n/a."""
    from benchmarks.bench_trl import markdown, summarize

    work, runs = _three_sides_work(100.0)
    rows = {r["metric"]: r for r in summarize("w", work, runs)["rows"]}
    forwarded, sequences = rows["MFU, tokens forwarded"], rows["MFU, sequences' tokens"]
    assert forwarded["fastgrpo"] == [100 * 200.0 / 0.5 / 100.0] and sequences["fastgrpo"] == [100 * 600.0 / 0.5 / 100.0]
    assert forwarded[UNSHARED] == sequences[UNSHARED] == [100 * 600.0 / 1.0 / 100.0]
    assert forwarded["trl"] == sequences["trl"] == [100 * 600.0 / 2.0 / 100.0]
    assert sequences["ratios"] == [4.0] and sequences["ratios_sharing"] == [2.0]
    assert "| MFU, tokens forwarded (%) | 400.00 (400.00-400.00) |" in markdown(summarize("w", work, runs))
    work, runs = _three_sides_work(None)
    rows = {r["metric"]: r for r in summarize("w", work, runs)["rows"]}
    assert rows["MFU, tokens forwarded"]["fastgrpo"] == [] and rows["MFU, tokens forwarded"]["ratios"] == []
    assert "| MFU, sequences' tokens (%) | n/a | n/a | n/a | n/a | n/a |" in markdown(summarize("w", work, runs))


def test_gpu_summary_reports_the_long_prompts_sharing_ratio_and_the_mfu(tmp_path):
    """Fabricated step outputs (TEST DATA): the long-prompt work's three sides give fastgrpo / TRL, shared /
    unshared, and each side's MFU on both counts; a work without a peak says why it has no MFU."""
    import json

    from benchmarks.bench_trl import summarize
    from benchmarks.gpu_summary import summary

    work, runs = _three_sides_work(100.0)
    no_peak, no_peak_runs = _three_sides_work(None)
    trl = {"command": "TEST", "works": [summarize("long-prompt", work, runs) | {"runs": runs},
                                        summarize("qwen0.5b-long-prompt", no_peak, no_peak_runs)]}
    (tmp_path / "bench_trl.json").write_text(json.dumps(trl))
    (tmp_path / "steps.tsv").write_text("trl\tok\t200\t300\t\n")
    text = summary(tmp_path)
    verdict = {line.split("|")[1].strip(): (line.split("|")[2].strip(), line.split("|")[4].strip())
               for line in text.splitlines() if line.startswith("| ") and line.count("|") == 5}
    assert verdict["policy update, fastgrpo / TRL, 512-token shared prompt, tiny model"] == (
        "0.25 (0.25-0.25), 1 pair", "reported")
    assert verdict["policy update, prompts shared / unshared, 512-token shared prompt, tiny model"] == (
        "0.50 (0.50-0.50), 1 pair", "reported")
    assert verdict["update MFU, tokens forwarded / sequences' tokens, long-prompt"] == (
        "fastgrpo 400.0% / 1200.0%; unshared 600.0% / 600.0%; TRL 300.0% / 300.0%", "reported")
    measured, outcome = verdict["update MFU, tokens forwarded / sequences' tokens, qwen0.5b-long-prompt"]
    assert outcome == "not run" and "no peak FLOP/s" in measured


def test_the_long_prompt_works_system_prompt_has_about_its_token_count():
    from transformers import AutoTokenizer

    from benchmarks.peer_work import WORKS, few_shot_system_prompt
    from fastgrpo.models.tiny import build_tiny

    tok = AutoTokenizer.from_pretrained(build_tiny())
    n = WORKS["long-prompt"].system_prompt_tokens
    text = few_shot_system_prompt(tok, n)
    count = len(tok(text, add_special_tokens=False)["input_ids"])
    assert 0.8 * n <= count <= n and "<answer>" in text
    assert few_shot_system_prompt(tok, n) == text and few_shot_system_prompt(tok, 0) == ""


def test_an_unknown_work_is_one_argument_error_before_any_work(capsys):
    from benchmarks import bench_trl, count_ops

    for main, name in ((bench_trl.main, "qwen0.5b-2l"), (count_ops.main, "qwen0.5b-2l-shape")):
        with pytest.raises(SystemExit) as e:
            main(["--works", f"tiny,{name}"])
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert e.value.code == 2 and f"--works: unknown '{name}'; choose from tiny" in err, err
