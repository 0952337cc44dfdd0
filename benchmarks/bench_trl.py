"""fastgrpo against TRL's GRPOTrainer: the same GRPO work, side by side, alternated and repeated.

Both sides read the same model folder, the same prompt file (rendered once here), the same reward functions
(``fastgrpo.rewards.REWARDS`` have TRL's signature) plus ``spread_reward``, and the same GRPO settings
(``SHARED``: G, prompts per step, max completion length, temperature, beta, loss type, lr, AdamW, float32 on
CPU, sdpa, transformers generation; colocated vLLM in both with ``--engine vllm``).

Same work, checked: every prompt in the file has the same token length P, and the model folder is edited so
that it never emits EOS (``suppress_eos``), so every completion is exactly L tokens on both sides. Each step's
prompt and completion token counts are read back from both sides and compared; a mismatch is reported.
``spread_reward`` (a deterministic function of the completion's token ids that varies within a group) makes
every advantage non-zero, so neither side can skip backward work on a zero-advantage group.

Timing, per optimizer step (one rollout batch of S = B * G completions), CUDA synchronised at each boundary:
  fastgrpo  ``python -m fastgrpo.train``'s metrics.jsonl: time/rollout_s (generation, rewards, advantages) and
            time/update_s (forward, backward, optimizer step); step = the trainer's whole ``train_step`` call, timed
            around it (rollout, update, the guard's end of step, weight sync, the metrics' reduction).
  TRL       GRPOTrainer with a callback: generation = ``_generate_and_score_completions`` (generation, rewards,
            advantages), step = on_step_begin -> on_step_end, update = step - generation.
Both children stamp when each step began (wall clock), so a run's time splits into start-up (process launch -> the
first step begins: imports, CUDA context, model load, trainer set-up), the first step (lazy initialisation, kernel
compilation and autotuning), the other warm-up steps, and the timed steps; only the timed steps enter the medians
and ratios, and the rest is reported beside them. Tokens/s divide the same S * (P + L) tokens by each side's
seconds. Peak memory: the child's peak RSS (VmHWM, polled from this process until the last step is logged, so a
final checkpoint save does not count); on CUDA ``torch.cuda.max_memory_allocated``. Every measured run is a fresh
process; sides alternate A/B, B/A, ... and works take turns pair by pair, so that a cut-short call still has a pair
of each work; ``--budget-s`` starts no pair that the work's previous pair says would end past it.

    make bench-env                                                   # once: .venv-bench (TRL 1.16.0, pinned)
    .venv-bench/bin/python benchmarks/bench_trl.py                   # tiny + 0.5B-shaped, 3 alternated pairs
    .venv-bench/bin/python benchmarks/bench_trl.py --works tiny --repeats 3 --out benchmarks/results/bench_trl
    python3 benchmarks/bench_trl.py --works qwen0.5b-shape,tiny --steps 10 --warmup 2 --budget-s 300   # a GPU
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parents[1]))  # run as a script from a checkout

from benchmarks.peer_work import (  # noqa: E402
    SHAPES, WORKS, Work, build_model_folder, check_no_eos, fastgrpo_config, few_shot_system_prompt, make_spec,
    spread_reward, trl_config, trl_lora_config, write_prompts,
)
from benchmarks.profile_phases import phase_seconds, phase_table  # noqa: E402
from fastgrpo.runtime.peaks import device_peak_flops  # noqa: E402

# -- the two children (each run is a fresh process) ------------------------------------------------------------


def run_fastgrpo_child(spec: dict) -> None:
    """fastgrpo through its public entry point; the per-step figures are its metrics.jsonl and the stamps of
    ``_stamped`` (STEP_TIMES)."""
    import torch
    import yaml

    from fastgrpo.models.attention import choose_attn_implementation
    from fastgrpo.train import main as train_main
    from fastgrpo.trainers.grpo import Trainer

    run_dir, tree = Path(spec["run_dir"]), fastgrpo_config(spec)
    cfg = run_dir / "fastgrpo.yaml"
    cfg.write_text(yaml.safe_dump(tree, sort_keys=False))
    attn = choose_attn_implementation(tree["model"]["attn_implementation"], spec["device"])
    (run_dir / "child.json").write_text(json.dumps({"attn_implementation": attn}))  # first: the parent may kill us
    if spec.get("profile"):
        if not hasattr(Trainer, "policy_update"):
            raise RuntimeError("--profile: fastgrpo.trainers.grpo.Trainer has no policy_update any more; point the "
                               "profile hook in benchmarks/bench_trl.py at the trainer's update phase")
        Trainer.policy_update = _profile_last(Trainer.policy_update, spec, lambda self: self.step)
    cuda = torch.cuda.is_available()
    with (run_dir / STEP_TIMES).open("w") as times:
        Trainer.train_step = _stamped(Trainer.train_step, times, torch.cuda.synchronize if cuda else (lambda: None),
                                      torch.cuda.max_memory_allocated if cuda else (lambda: None))
        rc = train_main(["--config", str(cfg)])
    sys.exit(rc)


UNSHARED = "fastgrpo-unshared"
"""The side that runs fastgrpo with ``grpo.shared_prefix=false``: every sequence's prompt forwarded on its own, as TRL
does, so the table shows what sharing a group's prompt is worth beside what the rest of fastgrpo is."""

STEP_TIMES = "step_times.jsonl"
"""fastgrpo child: one {t_begin, step_s, cuda_peak_bytes} line per ``Trainer.train_step`` call (its metrics.jsonl
has no clock)."""


def _stamped(train_step, out, sync, peak):
    """``train_step`` that appends to ``out`` when it began (wall clock, for the start-up), how long it took, and the
    CUDA peak so far (as TRL's callback reads it: the final checkpoint's memory is not the step's)."""
    def timed(self):
        sync()
        t_begin, t0 = time.time(), time.perf_counter()
        result = train_step(self)
        sync()
        out.write(json.dumps({"t_begin": t_begin, "step_s": time.perf_counter() - t0, "cuda_peak_bytes": peak()})
                  + "\n")
        out.flush()
        return result
    return timed


def run_trl_child(spec: dict) -> None:
    """TRL's GRPOTrainer with an equivalent GRPOConfig and a timing callback (see the module docstring)."""
    import datasets
    import torch
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from fastgrpo.rewards import REWARDS

    run_dir = Path(spec["run_dir"])
    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    steps_file = (run_dir / "steps.jsonl").open("w")

    class StepTimer(TrainerCallback):
        """Generation = the trainer's generate-and-score call; step = on_step_begin -> on_step_end."""

        def __init__(self, trainer):
            self.inner = trainer._generate_and_score_completions  # TRL 1.16's rollout phase (private)
            trainer._generate_and_score_completions = self.timed_generate
            self.rec: dict = {}

        def timed_generate(self, batch):
            sync()
            t0 = time.perf_counter()
            out = self.inner(batch)
            sync()
            self.rec["gen_s"] = self.rec.get("gen_s", 0.0) + time.perf_counter() - t0
            self.rec["calls"] = self.rec.get("calls", 0) + 1
            self.rec["prompt_tokens"] = int(out["prompt_mask"].sum())
            self.rec["completion_tokens"] = int(out["completion_mask"].sum())
            return out

        def on_step_begin(self, args, state, control, **kw):
            sync()
            self.rec = {"t_begin": time.time(), "t0": time.perf_counter()}

        def on_step_end(self, args, state, control, **kw):
            sync()
            rec = self.rec
            if rec.get("calls") != 1:  # TRL changed where it generates: the split below would be wrong
                raise RuntimeError(f"trl {__import__('trl').__version__}: expected one generation call per "
                                   f"optimizer step, saw {rec.get('calls', 0)}")
            step_s = time.perf_counter() - rec.pop("t0")
            rec |= {"step": state.global_step, "step_s": step_s, "update_s": step_s - rec["gen_s"],
                    "cuda_peak_bytes": torch.cuda.max_memory_allocated() if cuda else None}
            steps_file.write(json.dumps(rec) + "\n")
            steps_file.flush()

    funcs = [REWARDS[name] for name in spec["shared"]["rewards"]] + [spread_reward]
    lora = trl_lora_config(spec)
    if lora:
        from peft import LoraConfig

        lora = LoraConfig(**lora)
    trainer = GRPOTrainer(model=spec["model_dir"], reward_funcs=funcs, args=GRPOConfig(**trl_config(spec)),
                          peft_config=lora,
                          train_dataset=datasets.load_dataset("json", data_files=spec["prompts_file"], split="train"),
                          processing_class=AutoTokenizer.from_pretrained(spec["model_dir"]))
    timer = StepTimer(trainer)
    trainer.add_callback(timer)
    if spec.get("profile"):  # TRL's update = its training_step calls after the generation; profiled the same way
        def update_only(model, inputs, num_items, _inner=type(trainer).training_step.__get__(trainer)):
            return _inner(model, inputs, num_items)
        trainer._prepare_inputs = _unprofiled(trainer._prepare_inputs)
        trainer.training_step = _profile_last(update_only, spec, lambda _: trainer.state.global_step)
    trainer.train()
    steps_file.close()


_PROFILE = {"prof": None}


def _profile_last(fn, spec: dict, step_of):
    """Wrap ``fn`` so that its calls during the last step run under torch.profiler (CPU ops; CUDA too when
    present); the table, sorted by self time, goes to RUN_DIR/profile.txt when the process exits."""
    import atexit

    import torch
    from torch.profiler import ProfilerActivity, profile

    last = spec["warmup"] + spec["steps"] - 1

    def write():
        prof = _PROFILE["prof"]
        if prof is not None:
            prof.stop()
            # torch >= 2.4 names the device columns self_device_time_total (on torch 2.11 self_cuda_time_total sorts
            # nothing: the table comes out in call order)
            key = "self_device_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
            averages = prof.key_averages()
            table = averages.table(sort_by=key, row_limit=30, max_name_column_width=60)
            shapes = prof.key_averages(group_by_input_shape=True).table(sort_by=key, row_limit=20,
                                                                        max_name_column_width=50)
            cpu = averages.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60)
            vocab = json.loads((Path(spec["model_dir"]) / "config.json").read_text())["vocab_size"]
            split = phase_table(phase_seconds(prof.events(), vocab))
            (Path(spec["run_dir"]) / "profile.txt").write_text(f"self CPU time by phase (benchmarks/profile_phases.py"
                                                                f", V = {vocab}):\n{split}\n\n{table}\n\n"
                                                                f"by input shape:\n{shapes}"
                                                                f"\n\nby self CPU time (dispatch):\n{cpu}")

    atexit.register(write)

    def wrapped(self_or_first, *args, **kwargs):
        if step_of(self_or_first) != last:
            return fn(self_or_first, *args, **kwargs)
        if _PROFILE["prof"] is None:
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
            _PROFILE["prof"] = profile(activities=acts, record_shapes=True)
            _PROFILE["prof"].start()
        else:
            _PROFILE["prof"].toggle_collection_dynamic(True, _PROFILE["prof"].activities)
        try:
            return fn(self_or_first, *args, **kwargs)
        finally:
            if torch.cuda.is_available():  # the GPU's records of this call are in before its collection pauses
                torch.cuda.synchronize()
            _PROFILE["prof"].toggle_collection_dynamic(False, _PROFILE["prof"].activities)

    return wrapped


def _unprofiled(fn):
    """Run ``fn`` with profiler collection paused (TRL generates inside its first training_step)."""
    def wrapped(*args, **kwargs):
        prof = _PROFILE["prof"]
        if prof is None:
            return fn(*args, **kwargs)
        prof.toggle_collection_dynamic(False, prof.activities)
        try:
            return fn(*args, **kwargs)
        finally:
            prof.toggle_collection_dynamic(True, prof.activities)
    return wrapped


CHILDREN = {"fastgrpo": run_fastgrpo_child, UNSHARED: run_fastgrpo_child, "trl": run_trl_child}
LINGER_S = 5.0
"""Timed runs: seconds a child may take to exit after its last step is logged (``run_side``'s linger_s)."""


# -- running and reading one side ------------------------------------------------------------------------------


def _vm_hwm(pid: int) -> int | None:
    """Peak resident set size of a live process in bytes (Linux /proc), or None."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _progress_file(side: str, run_dir: Path) -> Path:
    return run_dir / ("fastgrpo/metrics.jsonl" if side != "trl" else "steps.jsonl")


def _lines(path: Path) -> int:
    try:
        return sum(1 for line in path.read_text().splitlines() if line.strip())
    except OSError:
        return 0


def run_side(side: str, spec: dict, timeout_s: float, linger_s: float | None = None) -> dict:
    """One fresh child process; returns its per-step records, peak memory and wall time. ``linger_s``: once every
    step is logged, kill a child still running after this long (what follows, fastgrpo's final checkpoint, is no part
    of the comparison and only spends the budget); None waits for it to exit (a profile is written at exit)."""
    run_dir = Path(spec["run_dir"])
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    (run_dir / "spec.json").write_text(json.dumps(spec))
    env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false",
               VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"))
    log = (run_dir / "child.log").open("w")
    launch_time, t0 = time.time(), time.perf_counter()
    proc = subprocess.Popen([sys.executable, str(HERE), "--child", side, "--spec", str(run_dir / "spec.json")],
                            stdout=log, stderr=subprocess.STDOUT, env=env)
    total, progress, peak = spec["warmup"] + spec["steps"], _progress_file(side, run_dir), None
    # Poll the peak RSS until the last step is logged: what the child does after (a checkpoint save) is not the
    # training step's memory.
    while proc.poll() is None and _lines(progress) < total:
        peak = _vm_hwm(proc.pid) or peak
        if time.perf_counter() - t0 > timeout_s:
            proc.kill()
            break
        time.sleep(0.1)
    left = max(1.0, timeout_s - (time.perf_counter() - t0))
    try:
        proc.wait(timeout=left if linger_s is None else min(left, linger_s))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    log.close()
    wall = time.perf_counter() - t0
    steps = _read_steps(side, run_dir)
    error = "" if len(steps) >= total else (
        f"rc={proc.returncode}, {len(steps)}/{total} steps; see {run_dir / 'child.log'}: "
        + " | ".join((run_dir / "child.log").read_text(errors="replace").strip().splitlines()[-3:])[-300:])
    cuda_peak, attn = steps[-1].get("cuda_peak_bytes") if steps else None, spec["shared"]["attn"]
    if side != "trl" and (run_dir / "child.json").is_file():
        attn = json.loads((run_dir / "child.json").read_text())["attn_implementation"]
    return {"side": side, "steps": steps, "peak_rss_bytes": peak, "cuda_peak_bytes": cuda_peak, "wall_s": wall,
            "launch_time": launch_time, "attn_implementation": attn, "error": error}


def _jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _read_steps(side: str, run_dir: Path) -> list[dict]:
    """Per-step records in one format: gen_s, update_s, step_s, prompt_tokens, completion_tokens, and t_begin (wall
    clock; absent from a fastgrpo step whose stamp was not written, whose step_s is then rollout + update); a
    fastgrpo step also has its update's FLOPs as the trainer counts them (``fastgrpo.runtime.metrics.
    add_update_flops``): ``flops`` of the sequences as if unshared, ``flops_forwarded`` of what its trunk ran."""
    records = _jsonl(_progress_file(side, run_dir))
    if side == "trl":
        return records
    stamps = _jsonl(run_dir / STEP_TIMES)
    out = []
    for i, r in enumerate(records):
        comp = int(r["perf/rollout_tokens"])
        rec = {"step": r["step"], "gen_s": r["time/rollout_s"], "update_s": r["time/update_s"],
               "step_s": r["time/rollout_s"] + r["time/update_s"], "completion_tokens": comp,
               "prompt_tokens": int(r["perf/update_tokens"]) - comp}
        if "perf/update_flops" in r:
            rec |= {"flops": r["perf/update_flops"], "flops_forwarded": r["perf/update_flops_forwarded"]}
        out.append(rec | (stamps[i] if i < len(stamps) else {}))
    return out


def phases(run: dict, warmup: int) -> dict:
    """Where a finished run's time went besides its timed steps: start-up (launch -> the first step begins), the
    first step (compilation, lazy initialisation), the other warm-up steps; then the timed steps' count, median and
    range of step_s. None where the run did not record it."""
    steps = run["steps"]
    timed = [s["step_s"] for s in steps[warmup:]]
    first_begin = steps[0].get("t_begin") if steps else None
    return {"startup_s": first_begin - run["launch_time"] if first_begin and run.get("launch_time") else None,
            "first_step_s": steps[0]["step_s"] if steps else None,
            "other_warmup_s": [s["step_s"] for s in steps[1:warmup]],
            "timed_steps": len(timed),
            "timed_step_s": (statistics.median(timed), min(timed), max(timed)) if timed else None}


# -- alternated pairs, medians, ratios -------------------------------------------------------------------------

def _mfu(key: str):
    """An MFU row's per-run value (percent): the median step's ``key`` FLOPs over its update seconds and the device's
    peak; None off CUDA (no peak) or where the FLOPs are not known."""
    def value(r: dict, run: dict, w: dict) -> float | None:
        if not w.get("peak_flops") or r.get(key) is None:
            return None
        return 100 * r[key] / r["update_s"] / w["peak_flops"]
    return value


METRICS = (  # name, unit, per-run value from (median step record, run, the work: tokens per step, peak FLOP/s)
    ("generation", "s", lambda r, run, w: r["gen_s"]),
    ("update", "s", lambda r, run, w: r["update_s"]),
    ("step", "s", lambda r, run, w: r["step_s"]),
    ("update tokens/s", "", lambda r, run, w: w["tokens"] / r["update_s"]),
    ("end-to-end tokens/s", "", lambda r, run, w: w["tokens"] / r["step_s"]),
    ("peak memory", "GB", lambda r, run, w: (run["cuda_peak_bytes"] if run["cuda_peak_bytes"] is not None
                                              else run["peak_rss_bytes"] or float("nan")) / 1e9),
    # the update's model FLOPs utilisation, counted on the tokens each side's trunk forwarded (the hardware's work:
    # fastgrpo with shared prefixes forwards each group's prompt once) and on the sequences' tokens as if unshared
    # (the same FLOPs for every side: what compares the trainers)
    ("MFU, tokens forwarded", "%", _mfu("flops_forwarded")),
    ("MFU, sequences' tokens", "%", _mfu("flops")),
)


def median_record(steps: list[dict], warmup: int) -> dict:
    """Per-key median over the measured (post warm-up) steps: the times, and the FLOPs where the side counts them."""
    kept = steps[warmup:]
    keys = ("gen_s", "update_s", "step_s", *(k for k in ("flops", "flops_forwarded") if kept and all(
        s.get(k) is not None for s in kept)))
    return {k: statistics.median(s[k] for s in kept) for k in keys}


def summarize(name: str, work: dict, runs: list[dict]) -> dict:
    """runs: alternating records of the sides, each tagged with its repeat index. Rows: per metric, each side's
    per-run medians and the fastgrpo / TRL ratio of every finished pair (with the unshared side: its ratio to TRL,
    ``ratios_unshared``, and sharing's own, fastgrpo / unshared, ``ratios_sharing``); phases: per side, each
    finished run's start-up, first step and warm-up (:func:`phases`), kept out of the rows. MFU (``work``'s
    ``peak_flops``, CUDA): fastgrpo's from the FLOPs its trainer counted; TRL forwards every sequence whole and
    unpadded here (one prompt length, no EOS), so both of its counts are the sequences' FLOPs fastgrpo counted for
    the same work (the median over its runs)."""
    tokens = work["sequences"] * (work["prompt_len"] + work["max_completion_length"])
    finished = [median_record(r["steps"], work["warmup"]) for r in runs if not r["error"] and r["side"] != "trl"]
    counted = [m["flops"] for m in finished if "flops" in m]
    sequence_flops = statistics.median(counted) if counted else None
    context = {"tokens": tokens, "peak_flops": work.get("peak_flops")}
    names = ["fastgrpo", *([UNSHARED] if any(r["side"] == UNSHARED for r in runs) else []), "trl"]
    per_side: dict[str, dict[int, dict]] = {n: {} for n in names}
    phase: dict[str, list[dict]] = {n: [] for n in names}
    equal, notes, skipped = True, [], set()
    for run in runs:
        if run["error"].startswith("skipped"):  # not started: one note per pair
            if run["repeat"] not in skipped:
                notes.append(f"repeat {run['repeat']}: {run['error']}")
            skipped.add(run["repeat"])
            continue
        if run["error"]:
            notes.append(f"{run['side']} repeat {run['repeat']}: {run['error']}")
            continue
        measured = run["steps"][work["warmup"]:]
        for rec in measured:
            want = (work["sequences"] * work["prompt_len"], work["sequences"] * work["max_completion_length"])
            got = (rec["prompt_tokens"], rec["completion_tokens"])
            if got != want:
                equal = False
                notes.append(f"{run['side']} repeat {run['repeat']} step {rec['step']}: tokens (prompt, completion) "
                             f"{got} != {want}")
        med = median_record(run["steps"], work["warmup"])
        if run["side"] == "trl" and sequence_flops is not None:
            med |= {"flops": sequence_flops, "flops_forwarded": sequence_flops}
        per_side[run["side"]][run["repeat"]] = {m: fn(med, run, context) for m, _, fn in METRICS}
        phase[run["side"]].append({"repeat": run["repeat"], **phases(run, work["warmup"])})
    def ratios(a: str, b: str, m: str) -> list[float]:
        return [per_side[a][k][m] / per_side[b][k][m] for k in sorted(set(per_side[a]) & set(per_side[b]))
                if per_side[a][k][m] is not None and per_side[b][k][m] is not None]

    rows = []
    for m, unit, _ in METRICS:
        row = {"metric": m, "unit": unit, **{n: [per_side[n][k][m] for k in sorted(per_side[n])
                                                 if per_side[n][k][m] is not None] for n in names},
               "ratios": ratios("fastgrpo", "trl", m)}
        if UNSHARED in per_side:
            row |= {"ratios_unshared": ratios(UNSHARED, "trl", m), "ratios_sharing": ratios("fastgrpo", UNSHARED, m)}
        rows.append(row)
    return {"work": name, **work, "tokens_per_step": tokens, "equal_tokens": equal, "notes": notes, "rows": rows,
            "phases": phase}


def _fmt(values: list[float], digits: int) -> str:
    if not values:
        return "n/a"
    med = statistics.median(values)
    return f"{med:,.{digits}f} ({min(values):,.{digits}f}-{max(values):,.{digits}f})"


def markdown(summary: dict) -> str:
    s = summary
    head = (f"**{s['work']}**: model {s['model']}, S = {s['prompts_per_step']} x {s['generations']} = "
            f"{s['sequences']} sequences of {s['prompt_len']} prompt + {s['max_completion_length']} completion "
            f"tokens ({s['tokens_per_step']:,} tokens per step), {s['steps']} timed steps after "
            f"{s['warmup']} warm-up, {len(s['rows'][0]['ratios'])} alternated pairs; equal tokens on both sides: "
            f"{'yes' if s['equal_tokens'] else 'NO'}\n\n")
    unshared = UNSHARED in s["rows"][0]
    lines = ["| per timed step | fastgrpo, median (range) over runs | "
             + ("fastgrpo, prompts unshared | " if unshared else "") + "TRL, median (range) over runs | "
             "fastgrpo / TRL per pair | median ratio (range) |"
             + (" unshared / TRL | shared / unshared |" if unshared else ""),
             "|---|---|---|---|---|" + ("---|---|---|" if unshared else "")]
    for r in s["rows"]:
        digits = 0 if "tokens/s" in r["metric"] else (2 if r["unit"] in ("GB", "%") else 3)
        unit = f" ({r['unit']})" if r["unit"] else ""
        lines.append(f"| {r['metric']}{unit} | {_fmt(r['fastgrpo'], digits)} | "
                     + (f"{_fmt(r[UNSHARED], digits)} | " if unshared else "") + f"{_fmt(r['trl'], digits)} | "
                     f"{', '.join(f'{x:.2f}' for x in r['ratios']) or 'n/a'} | {_fmt(r['ratios'], 2)} |"
                     + (f" {_fmt(r['ratios_unshared'], 2)} | {_fmt(r['ratios_sharing'], 2)} |" if unshared else ""))
    lines += ["", "| outside the timed steps (s) | start-up: launch -> first step | first step (compile, lazy init) | "
              "other warm-up steps | timed steps per run, step s median (range) |", "|---|---|---|---|---|"]
    for side, runs in s.get("phases", {}).items():
        timed = [r["timed_step_s"] for r in runs if r["timed_step_s"]]
        lines.append(
            f"| {side} ({len(runs)} runs) | {_fmt([r['startup_s'] for r in runs if r['startup_s'] is not None], 1)} | "
            f"{_fmt([r['first_step_s'] for r in runs if r['first_step_s'] is not None], 2)} | "
            f"{_fmt([x for r in runs for x in r['other_warmup_s']], 2)} | "
            f"{'/'.join(str(r['timed_steps']) for r in runs) or 'n/a'}, "
            + (f"{statistics.median(t[0] for t in timed):.3f} ({min(t[1] for t in timed):.3f}-"
               f"{max(t[2] for t in timed):.3f}) |" if timed else "n/a |"))
    notes = "".join(f"\n- {n}" for n in s["notes"][:10])
    return head + "\n".join(lines) + ("\n" + notes if notes else "") + "\n"


@functools.cache  # written after every pair; asked once (the device name starts CUDA here)
def versions() -> dict:
    out = {"python": platform.python_version(), "machine": platform.machine(), "cpus": os.cpu_count()}
    for mod in ("torch", "transformers", "trl", "accelerate", "datasets", "vllm"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception:  # not installed (vllm is optional)
            out[mod] = None
    try:
        import torch

        out["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu"
    except ImportError:
        pass
    return out


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--works", default="tiny,qwen0.5b-shape", help=f"comma list of {list(WORKS)}")
    ap.add_argument("--model-path", default=None,
                    help="also run a real local model folder (e.g. Qwen2.5-0.5B-Instruct), as work 'local'")
    ap.add_argument("--repeats", type=int, default=3, help="alternated fastgrpo/TRL pairs per work")
    ap.add_argument("--steps", type=int, default=None, help="measured steps per run (default: the work's)")
    ap.add_argument("--warmup", type=int, default=None, help="discarded steps per run (default: the work's)")
    ap.add_argument("--engine", default="hf", choices=("hf", "vllm"),
                    help="hf: transformers generation on both sides; vllm: colocated vLLM on both")
    ap.add_argument("--trl-micro-batch", type=int, default=8, help="TRL per_device_train_batch_size")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workdir", default=None, help="model folders, prompts and runs (default: $FASTGRPO_CACHE "
                                                    "or ~/.cache/fastgrpo, under bench-trl/)")
    ap.add_argument("--run-timeout-s", type=float, default=1800, help="kill one side's run after this long")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="start no pair that would end past this many seconds after the start (estimated from the "
                         "work's last pair; a work's first pair starts while time is left)")
    ap.add_argument("--fastgrpo-attn", default=None,
                    help="fastgrpo's model.attn_implementation (default: peer_work.FASTGRPO_ATTN's name for TRL's)")
    ap.add_argument("--fastgrpo-set", action="append", default=[], metavar="KEY=VALUE",
                    help="a dotted override of fastgrpo's config, repeatable (e.g. parallel.cuda_graphs=true): its "
                         "full runs and its --update-only side (parallel.* and grpo.max_tokens_per_microbatch there)")
    ap.add_argument("--lora", type=int, default=0, metavar="RANK",
                    help="LoRA adapters of this rank (alpha 2 x rank, every linear layer but lm_head) on every side "
                         "instead of full fine-tuning (TRL: peft_config; needs peft); works are named WORK+loraRANK")
    ap.add_argument("--no-unshared", action="store_true",
                    help=f"skip the third side, {UNSHARED} (fastgrpo with grpo.shared_prefix=false)")
    ap.add_argument("--profile", action="store_true",
                    help="instead of timing: one run per side under torch.profiler, the last step's update only "
                         "(fastgrpo: policy_update; TRL: its micro-batch training steps, generation excluded); "
                         "writes OUT-profile-WORK-SIDE.txt")
    ap.add_argument("--out", default="benchmarks/results/bench_trl", help="writes OUT.json and OUT.md")
    up = ap.add_argument_group("--update-only: TRL's policy update against grpo_update on one fixed rollout batch "
                               "(benchmarks/trl_update.py; --repeats, --trl-micro-batch, --budget-s, --seed, --workdir "
                               "and --out apply too)")
    up.add_argument("--update-only", action="store_true", help="no generation: the update alone (trl_update.py)")
    up.add_argument("--shape", default="108m", help="random-weight model shape, a key of peer_work.SHAPES")
    up.add_argument("--sequences", type=int, default=64, help="S sequences in the rollout batch")
    up.add_argument("--generations", type=int, default=8, help="G sequences per prompt (prompt lengths repeat)")
    up.add_argument("--loss-type", default="dapo", help="the loss type of both sides (TRL's default: dapo)")
    up.add_argument("--completion-mean", type=float, default=300.0, help="mean completion length (lognormal)")
    up.add_argument("--completion-cap", type=int, default=1024, help="longest completion")
    up.add_argument("--microbatch-tokens", type=int, default=None,
                    help="fastgrpo's grpo.max_tokens_per_microbatch (default: the trainer's for the device)")
    up.add_argument("--no-control", action="store_true", help="skip the one-length control batch")
    ap.add_argument("--child", choices=sorted(CHILDREN), help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.lora < 0:
        ap.error(f"--lora: must be >= 0 (0 = full fine-tuning), got {args.lora}")
    unknown = [n for n in args.works.split(",") if n and n not in WORKS]
    if unknown and not args.child:
        ap.error(f"--works: unknown {', '.join(map(repr, unknown))}; choose from {', '.join(WORKS)}")
    return args


def prepare(work: Work, args, root: Path, device: str) -> dict:
    """Model folder and prompt file (built once, cached under ROOT), then the spec both children read."""
    key = work.model if work.model in ("tiny", *SHAPES) else Path(work.model).name
    model_dir = build_model_folder(work.model, root / "models" / f"{key}-noeos-seed{args.seed}", seed=args.seed)
    system = ""
    if work.system_prompt_tokens:  # a long few-shot system prompt, the same before every question
        from transformers import AutoTokenizer

        system = few_shot_system_prompt(AutoTokenizer.from_pretrained(model_dir), work.system_prompt_tokens,
                                        seed=args.seed)
    suffix = f"-system{work.system_prompt_tokens}" if system else ""
    prompts_file = root / "prompts" / f"{key}{suffix}.jsonl"
    prompts_file.parent.mkdir(parents=True, exist_ok=True)
    P = write_prompts(model_dir, prompts_file, count=64, seed=args.seed, system_prompt=system)
    spec = make_spec(work, model_dir=model_dir, prompts_file=prompts_file, prompt_len=P, device=device,
                     engine=args.engine, seed=args.seed, trl_micro_batch=args.trl_micro_batch, steps=args.steps,
                     warmup=args.warmup)
    if system:  # fastgrpo renders the rows' questions after the same system prompt TRL reads in the conversation
        spec["shared"] = {**spec["shared"], "system_prompt": system}
    if getattr(args, "fastgrpo_attn", None):
        spec["fastgrpo_attn"] = args.fastgrpo_attn
    if getattr(args, "lora", 0):
        spec["lora_rank"] = args.lora
    if getattr(args, "fastgrpo_set", None):
        spec["fastgrpo_set"] = list(args.fastgrpo_set)
    # the device's peak for the MFU rows (None off CUDA or for a GPU the table does not know: those rows say n/a)
    spec["peak_flops"] = device_peak_flops(device)
    return spec | {"max_eos_probability": check_no_eos(model_dir, prompts_file)}


def alternated_pairs(names: list[str], repeats: int, budget_s: float | None, run_pair, clock=time.perf_counter,
                     sides: tuple[str, ...] = ("fastgrpo", "trl")):
    """Round r runs pair r of each work in turn (a pair: one run of each of ``sides``), in the order of ``sides`` for
    even r and reversed for odd r; ``run_pair(name, repeat, sides)`` returns that pair's run records. A pair is
    started only while the seconds since the first call, plus the wall time of the work's previous pair, stay within
    ``budget_s``; one not started is recorded as one run per side with error "skipped: time budget". Returns
    {name: [runs]}."""
    start, runs, last_pair_s, order = clock(), {n: [] for n in names}, {}, tuple(sides)
    for rep in range(repeats):
        sides = order if rep % 2 == 0 else order[::-1]
        for name in names:
            t0 = clock()
            if budget_s is not None and t0 - start + last_pair_s.get(name, 0.0) > budget_s:
                runs[name] += [{"side": s, "repeat": rep, "steps": [], "error": "skipped: time budget"} for s in sides]
                continue
            runs[name] += run_pair(name, rep, sides)
            last_pair_s[name] = clock() - t0
    return runs


def main(argv: list[str] | None = None) -> int:
    started, args = time.perf_counter(), parse_args(argv)
    if args.child:
        CHILDREN[args.child](json.loads(Path(args.spec).read_text()))
        return 0
    try:
        import trl  # noqa: F401  (the children need it; fail here, in one line)
    except ImportError:
        print("bench_trl: TRL is not installed in this environment; run `make bench-env` and use "
              ".venv-bench/bin/python (TRL is never a dependency of fastgrpo itself)", file=sys.stderr)
        return 2
    root = Path(args.workdir or Path(os.environ.get("FASTGRPO_CACHE", Path.home() / ".cache" / "fastgrpo")) / "bench-trl")
    if args.update_only:
        from benchmarks.trl_update import run as run_update_only

        run_update_only(args, "python benchmarks/bench_trl.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                        root, say=lambda msg: print(msg, file=sys.stderr, flush=True))
        return 0
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    tag = f"+lora{args.lora}" if args.lora else ""
    works = {n + tag: WORKS[n] for n in args.works.split(",") if n}
    if args.model_path:
        works["local"] = Work(model=args.model_path, prompts_per_step=2, max_completion_length=128)
    specs, configs = {}, {}
    for name, work in works.items():  # every model folder first, so that each pair's time is only its runs
        specs[name] = spec = prepare(work, args, root, device)
        print(f"[{name}] model {spec['model_dir']}, P={spec['prompt_len']}, max EOS probability "
              f"{spec['max_eos_probability']:.1e}", file=sys.stderr)
        configs[name] = {"fastgrpo": fastgrpo_config(spec), "trl": trl_config(spec), "trl_lora": trl_lora_config(spec)}
    if args.profile:
        for name, spec in specs.items():
            for side in CHILDREN:
                run = run_side(side, {**spec, "profile": True, "run_dir": str(root / "runs" / name / side)},
                               args.run_timeout_s)
                src = Path(root / "runs" / name / side / "profile.txt")
                dst = Path(f"{args.out}-profile-{name}-{side}.txt")
                dst.parent.mkdir(parents=True, exist_ok=True)
                gen = (f"generation of the profiled step (not profiled; the step's record): "
                       f"{run['steps'][-1]['gen_s']:.2f} s, its update {run['steps'][-1]['update_s']:.2f} s\n"
                       if run["steps"] else "")
                dst.write_text(gen + src.read_text() if src.is_file() else f"no profile: {run['error']}\n")
                print(f"[{name}] {side}: profile of the last update in {dst}", file=sys.stderr)
        return 0
    done: dict[str, list[dict]] = {name: [] for name in specs}

    def run_pair(name: str, rep: int, sides: tuple[str, str]) -> list[dict]:
        spec, pair = specs[name], []
        for side in sides:
            side_spec = spec if side != UNSHARED else {
                **spec, "fastgrpo_set": [*spec.get("fastgrpo_set", []), "grpo.shared_prefix=false"]}
            run = run_side(side, {**side_spec, "run_dir": str(root / "runs" / name / side)}, args.run_timeout_s,
                           linger_s=LINGER_S) | {"repeat": rep}
            pair.append(run)
            med = median_record(run["steps"], spec["warmup"]) if not run["error"] else {}
            ph = phases(run, spec["warmup"]) if not run["error"] else {}
            mem = run["cuda_peak_bytes"] if run["cuda_peak_bytes"] is not None else run["peak_rss_bytes"]
            print(f"[{name}] repeat {rep} {side}: {run['wall_s']:.0f}s wall"
                  + (f" (start-up {ph['startup_s']:.1f}s, first step {ph['first_step_s']:.2f}s)"
                     if ph.get("startup_s") is not None else "") + ", "
                  + (", ".join(f"{k} {v:.3f}" for k, v in med.items() if k.endswith("_s")) or run["error"])
                  + (f", peak memory {mem / 1e9:.2f} GB" if mem else ""), file=sys.stderr)
        done[name] += pair  # results after each pair, so a cut-short call keeps every finished one
        write_results(args, argv, configs, [summarize(n, specs[n], r) | {"runs": r} for n, r in done.items() if r])
        return pair

    budget_left = None if args.budget_s is None else args.budget_s - (time.perf_counter() - started)
    sides = ("fastgrpo", "trl") if args.no_unshared else ("fastgrpo", UNSHARED, "trl")
    runs = alternated_pairs(list(specs), args.repeats, budget_left, run_pair, sides=sides)
    summaries = [summarize(name, specs[name], r) | {"runs": r} for name, r in runs.items()]
    write_results(args, argv, configs, summaries)
    print("\n".join(markdown(s) for s in summaries))
    return 0


def write_results(args, argv, configs: dict, summaries: list[dict]) -> None:
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = "python benchmarks/bench_trl.py " + " ".join(argv if argv is not None else sys.argv[1:])
    info = versions()
    out.with_suffix(".json").write_text(json.dumps({"command": cmd, "date": time.strftime("%Y-%m-%d"),
                                                    "versions": info, "configs": configs, "works": summaries},
                                                   indent=1, default=str))
    text = "\n".join(markdown(s) for s in summaries)
    out.with_suffix(".md").write_text(f"{time.strftime('%Y-%m-%d')}, {info}\n\n`{cmd}`\n\n{text}")


if __name__ == "__main__":
    sys.exit(main())
