"""Dispatched aten ops and host syncs per GRPO step: fastgrpo's Trainer and TRL's GRPOTrainer at the same work.

On a GPU each dispatched op is (about) a kernel launch and each host sync a pipeline stall; on small models launch
overhead dominates the update. Both are counted on the CPU by ``benchmarks/op_counter.py`` (its docstring says which
ops count as syncs), so progress is measurable without a GPU. Same work as ``benchmarks/bench_trl.py``
(``peer_work``: the same model folder without EOS, the same prompt file, rewards and GRPO settings; every completion
is exactly L tokens on both sides), plus a 4-layer Qwen2 at Qwen2.5-0.5B's widths (its per-layer ops are those of
the 24-layer model; the CPU runs it in seconds).

Each run is a fresh child process: the trainer is built, ``--warmup`` steps run uncounted, then ``--steps`` steps
are counted, phase by phase:

    step         one optimizer step: rollout + update
    rollout      fastgrpo: Trainer.rollout (generation, rewards, advantages) and the step's reward statistics
                 (episodes.record_metrics, run at the end of the step); TRL: _generate_and_score_completions
    generate     inside rollout: fastgrpo: engine.generate; TRL: _generate_single_turn
    update       step - rollout (fastgrpo: policy_update, the non-finite guard's end of step, the metrics' one
                 reduction; TRL: its micro-batch training_steps, clipping, the optimizer step, zero_grad)
    policy_update  fastgrpo only: Trainer.policy_update (the update less the end of the step)
    microbatch   inside update: fastgrpo: from each packed forward to the next (forward, head loss, backward,
                 metrics) until clipping; TRL: each training_step (generation excluded)
    clip         gradient clipping;  optimizer: optimizer.step();  attention: the attention function, per layer

TRL runs at ``--trl-micro-batch`` sequences per micro-batch (its default 8); fastgrpo at the token budgets of
``--budgets``: two (1024, its CPU default, and 256), so that syncs that grow with the number of micro-batches show,
and TRL's micro-batch in tokens (8 sequences of P + L tokens), so that both run as many micro-batches.

    make bench-env                                                 # once: .venv-bench (TRL 1.16.0)
    .venv-bench/bin/python benchmarks/count_ops.py                 # both works, both trainers: ~10 min on 2 cores
    .venv-bench/bin/python benchmarks/count_ops.py --works tiny --sides fastgrpo

Writes benchmarks/out/count_ops.json (``--out``) and prints one Markdown table.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from unittest import mock

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parents[1]))  # run as a script from a checkout

from benchmarks.op_counter import OpCounter, optimizer_host_tensors  # noqa: E402
from benchmarks.peer_work import SHAPES, WORKS, Work, fastgrpo_config, trl_config  # noqa: E402

FEW_LAYERS = "qwen2.5-0.5b-4l"
SHAPES.setdefault(FEW_LAYERS, {**SHAPES["qwen2.5-0.5b"], "num_hidden_layers": 4})
COUNT_WORKS = {
    "tiny": WORKS["tiny"],  # 2 x 8 sequences of P + 64 tokens
    "qwen0.5b-4l": Work(model=FEW_LAYERS, prompts_per_step=2, max_completion_length=32),
}
PHASES = ("step", "rollout", "generate", "policy_update", "microbatch", "clip", "optimizer", "attention")


# -- phase hooks ----------------------------------------------------------------------------------------------


def _in_phase(counter: OpCounter, name: str, fn):
    def wrapped(*args, **kwargs):
        with counter.phase(name):
            return fn(*args, **kwargs)
    return wrapped


@contextlib.contextmanager
def _common_phases(counter: OpCounter, attn_impl: str):
    """optimizer.step() and the attention function: the same hooks for both trainers."""
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
    from transformers.modeling_utils import AttentionInterface

    pre = register_optimizer_step_pre_hook(lambda *_: counter.enter("optimizer"))
    post = register_optimizer_step_post_hook(lambda *_: counter.leave("optimizer"))
    table = AttentionInterface._global_mapping
    try:
        with mock.patch.dict(table, {attn_impl: _in_phase(counter, "attention", table[attn_impl])}):
            yield
    finally:
        pre.remove()
        post.remove()


class _MicroBatchSpan:
    """fastgrpo's micro-batch: from a packed forward of the update to the next one, the last up to clipping (the
    backward and the metrics run between forwards, outside any call one could wrap)."""

    def __init__(self, counter: OpCounter) -> None:
        self.counter, self.count = counter, 0

    def start(self) -> None:
        if self.counter.current() == "microbatch":
            self.counter.leave("microbatch")
        if self.counter.current() == "policy_update":
            self.counter.enter("microbatch")
            self.count += 1

    def end(self) -> None:
        if self.counter.current() == "microbatch":
            self.counter.leave("microbatch")

    def wrap_forward(self, fn):
        def wrapped(*args, **kwargs):
            self.start()
            return fn(*args, **kwargs)
        return wrapped

    def wrap_clip(self, fn):
        def wrapped(*args, **kwargs):
            self.end()
            with self.counter.phase("clip"):
                return fn(*args, **kwargs)
        return wrapped

    def wrap_update(self, fn):
        def wrapped(*args, **kwargs):
            with self.counter.phase("policy_update"):
                try:
                    return fn(*args, **kwargs)
                finally:
                    self.end()  # no clipping after the forwards (a failed update): close the span here
        return wrapped


# -- the two children -----------------------------------------------------------------------------------------


def count_fastgrpo(spec: dict, budget: int) -> dict:
    """fastgrpo's Trainer in process: warm-up steps, then ``spec['steps']`` counted train_step calls."""
    import torch
    import yaml

    import fastgrpo.trainers.grpo as trainer_module
    from fastgrpo.config import TrainConfig, load_config
    from fastgrpo.trainers.grpo import Trainer

    tree = fastgrpo_config(spec)
    tree["grpo"]["max_tokens_per_microbatch"] = budget
    # AdamW as on a GPU (optim.implementation auto: fused on CUDA; the CPU default is foreach), as TRL's is fused
    tree["optim"]["implementation"] = "fused"
    path = Path(spec["run_dir"]) / "fastgrpo.yaml"
    path.write_text(yaml.safe_dump(tree, sort_keys=False))
    # The decode loop checks for finished rows every step on a CPU (free there) and every 8 on a GPU: count the GPU's.
    from fastgrpo.rollout import hf as hf_engine

    hf_engine.finish_check_every = lambda device: 8
    trainer = Trainer(load_config(path, [], cls=TrainConfig))
    if spec.get("autocast_bf16"):  # one plain CUDA rank's mixed precision (float32 masters, bf16 autocast), on the CPU
        trainer.runner.autocast_dtype = torch.bfloat16
        trainer.engine.autocast_dtype = torch.bfloat16  # the hf engine decodes the policy itself under autocast
    try:
        for _ in range(spec["warmup"]):
            trainer.train_step()
        counter = OpCounter(host_tensors=optimizer_host_tensors(trainer.optimizer))
        span = _MicroBatchSpan(counter)
        model = trainer.model
        tokens = 0
        with contextlib.ExitStack() as stack:
            for obj, attr, fn in (
                    (trainer, "rollout", _in_phase(counter, "rollout", trainer.rollout)),
                    # the step's reward / advantage / length statistics: TRL's are computed in its rollout phase
                    (trainer_module, "record_metrics", _in_phase(counter, "rollout", trainer_module.record_metrics)),
                    (trainer.engine, "generate", _in_phase(counter, "generate", trainer.engine.generate)),
                    (trainer, "policy_update", span.wrap_update(trainer.policy_update)),
                    (trainer.runner, "packed_forward", span.wrap_forward(trainer.runner.packed_forward)),
                    (torch.nn.utils, "clip_grad_norm_", span.wrap_clip(torch.nn.utils.clip_grad_norm_))):
                stack.enter_context(mock.patch.object(obj, attr, fn))
            stack.enter_context(_common_phases(counter, model.config._attn_implementation))
            with counter.active():
                for _ in range(spec["steps"]):
                    with counter.phase("step"):
                        record, _ = trainer.train_step()
                    tokens += int(record["perf/rollout_tokens"])
    finally:
        trainer.close()
    return _summary(counter, spec, micro_batches=span.count, generated_tokens=tokens)


def count_trl(spec: dict, micro_batch: int) -> dict:
    """TRL's GRPOTrainer with the same work; the counter runs from on_step_begin to on_step_end of the counted
    steps (TRL generates inside the step's first training_step)."""
    import datasets
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from benchmarks.peer_work import spread_reward
    from fastgrpo.rewards import REWARDS

    spec = {**spec, "trl_micro_batch": micro_batch}
    funcs = [REWARDS[name] for name in spec["shared"]["rewards"]] + [spread_reward]
    args = trl_config(spec)
    if spec.get("autocast_bf16"):  # TRL's bf16=True (accelerate's autocast), as on a GPU
        args["bf16"] = True
    trainer = GRPOTrainer(model=spec["model_dir"], reward_funcs=funcs, args=GRPOConfig(**args),
                          train_dataset=datasets.load_dataset("json", data_files=spec["prompts_file"], split="train"),
                          processing_class=AutoTokenizer.from_pretrained(spec["model_dir"]))
    counter = OpCounter()
    stack = contextlib.ExitStack()
    seen = {"steps": 0, "micro_batches": 0, "tokens": 0}

    def rollout(batch, _inner=trainer._generate_and_score_completions):
        with counter.phase("rollout"):
            out = _inner(batch)
        with counter.paused():
            seen["tokens"] += int(out["completion_mask"].sum())
        return out

    def training_step(*args, _inner=trainer.training_step):
        seen["micro_batches"] += counter.current() == "step"
        with counter.phase("microbatch") if counter.current() == "step" else contextlib.nullcontext():
            return _inner(*args)

    class Count(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            if state.global_step >= spec["warmup"]:
                inner = getattr(trainer.optimizer, "optimizer", trainer.optimizer)  # accelerate's wrapper
                counter.declare_host(optimizer_host_tensors(inner))
                stack.enter_context(_common_phases(counter, trainer.model.config._attn_implementation))
                stack.enter_context(counter.active())
                counter.enter("step")

        def on_step_end(self, args, state, control, **kw):
            if counter.current() == "step":
                counter.leave("step")
                stack.close()
                seen["steps"] += 1

    trainer._generate_and_score_completions = rollout
    trainer._generate_single_turn = _in_phase(counter, "generate", trainer._generate_single_turn)
    trainer.training_step = training_step
    trainer._clip_grad_norm = _in_phase(counter, "clip", trainer._clip_grad_norm)
    trainer.add_callback(Count())
    trainer.train()
    assert seen["steps"] == spec["steps"], seen
    # TRL's micro-batch also includes its generation (the first one of a step); counted apart, as rollout
    return _summary(counter, spec, micro_batches=seen["micro_batches"], generated_tokens=seen["tokens"])


def _summary(counter: OpCounter, spec: dict, *, micro_batches: int, generated_tokens: int) -> dict:
    """Per optimizer step (means over the counted steps); rollout per generated token."""
    k = spec["steps"]
    kinds = ("ops", "launches", "syncs", "host_ops")

    def per_step(phase, without=()):
        return {kind: counter.total(phase, kind, without=without) / k for kind in kinds}

    def by_name(phase, kind, without):
        return {name: n / k for name, n in counter.by_name(phase, kind, without=without).most_common()}

    phases = {p: per_step(p) for p in PHASES}  # policy_update: fastgrpo's Trainer.policy_update alone
    phases["update"] = per_step("step", without=("rollout",))
    phases["microbatch"] = per_step("microbatch", without=("rollout",))
    phases["update_attention"] = per_step("attention", without=("rollout",))
    phases["update_backward"] = per_step("backward", without=("rollout",))
    n_mb = micro_batches / k
    tokens = generated_tokens / k
    return {
        "micro_batches": n_mb, "generated_tokens": tokens, "per_step": phases,
        "per_micro_batch": {kind: phases["microbatch"][kind] / max(n_mb, 1) for kind in kinds},
        "rollout_per_token": {kind: phases["rollout"][kind] / max(tokens, 1) for kind in kinds},
        "generate_per_token": {kind: phases["generate"][kind] / max(tokens, 1) for kind in kinds},
        "syncs_by_name": {name: by_name(p, "syncs", w) for name, p, w in _SYNC_TABLES},
        "sync_sites": {name: by_name(p, "sync_sites", w) for name, p, w in _SYNC_TABLES},
        "update_ops_by_name": by_name("step", "ops", ("rollout",)),
    }


_SYNC_TABLES = (("update", "step", ("rollout",)), ("microbatch", "microbatch", ("rollout",)),
                ("rollout", "rollout", ()))
"""Where syncs are listed by op name and by call site: (name, phase, less the phases)."""

CHILDREN = {"fastgrpo": count_fastgrpo, "trl": count_trl}


# -- the parent: inputs, children, table ----------------------------------------------------------------------


def run_child(side: str, spec: dict, setting: int, timeout_s: float) -> dict:
    run_dir = Path(spec["run_dir"])
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "spec.json").write_text(json.dumps(spec))
    out = run_dir / f"{side}-{setting}.json"
    out.unlink(missing_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    with (run_dir / f"{side}-{setting}.log").open("w") as log:
        proc = subprocess.run([sys.executable, str(HERE), "--child", side, "--setting", str(setting), "--spec",
                               str(run_dir / "spec.json"), "--child-out", str(out)],
                              stdout=log, stderr=subprocess.STDOUT, env=env, timeout=timeout_s)
    if proc.returncode or not out.is_file():
        tail = (run_dir / f"{side}-{setting}.log").read_text(errors="replace").strip().splitlines()[-5:]
        return {"error": f"rc={proc.returncode}: " + " | ".join(tail)[-600:]}
    return json.loads(out.read_text())


def _row(work: str, side: str, setting: str, r: dict) -> str:
    if "error" in r:
        return f"| {work} | {side} | {setting} | error: {r['error'][:200]} |"
    s, mb, tok = r["per_step"], r["per_micro_batch"], r["rollout_per_token"]
    gen = r["generate_per_token"]
    cells = [work, side, setting, f"{r['micro_batches']:g}", f"{s['update']['ops']:,.0f}",
             f"{s['update']['launches']:,.0f}", f"{mb['ops']:,.0f}", f"{s['update']['syncs']:g}",
             f"{mb['syncs']:g}", f"{s['optimizer']['ops']:,.0f}", f"{s['update_attention']['ops']:,.0f}",
             f"{tok['ops']:.1f} / {tok['syncs']:.3f}", f"{gen['ops']:.1f} / {gen['syncs']:.3f}"]
    return "| " + " | ".join(cells) + " |"


HEADER = ("| work | trainer | micro-batch | micro-batches | ops / update step | launches / update step | "
          "ops / micro-batch | syncs / optimizer step | syncs / micro-batch | optimizer.step ops | attention ops "
          "(update) | rollout ops / syncs per token | generate ops / syncs per token |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--works", default=",".join(COUNT_WORKS), help=f"comma list of {list(COUNT_WORKS)}")
    ap.add_argument("--sides", default="fastgrpo,trl")
    ap.add_argument("--budgets", default="1024,256,trl",
                    help="fastgrpo grpo.max_tokens_per_microbatch values; 'trl': the tokens of TRL's (first) "
                         "micro-batch, so that both run as many micro-batches")
    ap.add_argument("--trl-micro-batch", default="8", help="TRL per_device_train_batch_size values (divide B*G)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=1, help="counted steps per run")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fastgrpo-attn", default=None,
                    help="fastgrpo's model.attn_implementation (default: peer_work's, auto). 'sdpa' gives one attention "
                         "call per layer over the packed row, as torch_varlen does on CUDA: the launch proxy for a GPU")
    ap.add_argument("--autocast-bf16", action="store_true",
                    help="both sides in a GPU's mixed precision: float32 weights, bf16 autocast (fastgrpo's one plain "
                         "CUDA rank, TRL's bf16=True); the casts autocast dispatches are then counted too")
    ap.add_argument("--workdir", default=None, help="model folders, prompts, runs (default: $FASTGRPO_CACHE or "
                                                    "~/.cache/fastgrpo, under count-ops/)")
    ap.add_argument("--run-timeout-s", type=float, default=1800)
    ap.add_argument("--out", default="benchmarks/out/count_ops.json")
    ap.add_argument("--child", choices=sorted(CHILDREN), help=argparse.SUPPRESS)
    ap.add_argument("--setting", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    ap.add_argument("--child-out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    for arg, given, known in (("--works", args.works, COUNT_WORKS), ("--sides", args.sides, CHILDREN)):
        unknown = [n for n in given.split(",") if n not in known]
        if unknown and not args.child:
            ap.error(f"{arg}: unknown {', '.join(map(repr, unknown))}; choose from {', '.join(known)}")
    if args.child:
        result = CHILDREN[args.child](json.loads(Path(args.spec).read_text()), args.setting)
        Path(args.child_out).write_text(json.dumps(result, indent=1))
        return 0

    from benchmarks.bench_trl import prepare, versions

    root = Path(args.workdir or Path(os.environ.get("FASTGRPO_CACHE", Path.home() / ".cache" / "fastgrpo"))
                / "count-ops")
    sides = args.sides.split(",")
    trl_mbs = [int(m) for m in args.trl_micro_batch.split(",")]
    prep = argparse.Namespace(seed=args.seed, engine="hf", trl_micro_batch=8, steps=args.steps, warmup=args.warmup)
    results, rows = [], []
    for name in args.works.split(","):
        work = COUNT_WORKS[name]
        spec = prepare(replace(work, warmup=args.warmup, steps=args.steps), prep, root, "cpu")
        seq_tokens = spec["prompt_len"] + spec["max_completion_length"]
        settings = {"fastgrpo": [trl_mbs[0] * seq_tokens if b == "trl" else int(b) for b in args.budgets.split(",")],
                    "trl": trl_mbs}
        for side in sides:
            for setting in settings[side]:
                run = run_child(side, {**spec, "run_dir": str(root / "runs" / name / side),
                                       **({"fastgrpo_attn": args.fastgrpo_attn} if args.fastgrpo_attn else {}),
                                       "autocast_bf16": args.autocast_bf16},
                                setting, args.run_timeout_s)
                label = f"{setting} tokens" if side == "fastgrpo" else f"{setting} sequences"
                if side == "fastgrpo" and args.fastgrpo_attn:
                    label += f", {args.fastgrpo_attn}"
                if args.autocast_bf16:
                    label += ", bf16 autocast"
                results.append({"work": name, "side": side, "setting": setting, **run})
                rows.append(_row(name, side, label, run))
                print(rows[-1], file=sys.stderr, flush=True)
        S, P, L = spec["sequences"], spec["prompt_len"], spec["max_completion_length"]
        rows.append(f"| {name}: {S} sequences of {P} + {L} tokens, {work.model} | | | | | | | | | | | | |")
    cmd = "python benchmarks/count_ops.py " + " ".join(argv if argv is not None else sys.argv[1:])
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    info = versions() | {"platform": platform.platform()}
    out.write_text(json.dumps({"command": cmd, "date": time.strftime("%Y-%m-%d"), "versions": info,
                               "warmup": args.warmup, "steps": args.steps, "results": results}, indent=1))
    print(f"{time.strftime('%Y-%m-%d')}, {info}\n\n`{cmd}`\n\n{HEADER}\n" + "\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
