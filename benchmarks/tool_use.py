"""How a model uses the calculator on the tools demo's held-out problems: greedy trajectories, counted.

    python benchmarks/tool_use.py tiny:countdown-tools /tmp/t25/runs/tools-seed0/final   # one JSON line per model

Each model runs the trainer's own trajectory driver (``configs/tiny-tools.yaml``, or ``--config``; the calculator in
its worker pool, ``rollout.max_turns`` turns) greedily on the first ``--problems`` held-out rows. Per model: how many
trajectories are correct, call a tool, call it twice or more; the calls and the malformed ones; the correct answers
that are an equation a call had just confirmed (its result was the target); the correct answers after a first call
that missed; and the trajectories where a call hit the target but the answer was wrong (the confirmed equation was
not copied). benchmarks/RESULTS.md, "Multi-turn tools demo", has the figures.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

COUNTS = ("problems", "correct", "with_call", "calls", "malformed", "with_second_call", "correct_confirmed",
          "correct_after_miss", "confirmed_not_answered")


def tool_use_counts(rows: list[dict[str, Any]], conversations: list[list[dict[str, Any]]]) -> dict[str, int]:
    """The counts of :data:`COUNTS` for Countdown ``rows`` and the conversation after each prompt (the assistant
    turns and the tool messages, in order, as ``Trajectory.messages``). A call is confirmed when the tool message
    that follows it reads the row's target."""
    from fastgrpo.environments.tools import parse_qwen_tool_calls
    from fastgrpo.rewards.countdown import countdown_reward
    from fastgrpo.rewards.format import last_answer

    if len(rows) != len(conversations):
        raise ValueError(f"{len(rows)} rows for {len(conversations)} conversations")
    c = dict.fromkeys(COUNTS, 0)
    for row, msgs in zip(rows, conversations):
        turns = [m["content"] for m in msgs if m["role"] == "assistant"]
        results = [m["content"].strip() for m in msgs if m["role"] == "tool"]
        ok = bool(turns) and countdown_reward([turns[-1]], [row["nums"]], [row["target"]])[0] == 1.0
        calls = [call for text in turns for call in parse_qwen_tool_calls(text)]
        # one tool message per call, in order (a malformed call gets an "Error: ..." message too)
        confirmed = {str((call.arguments or {}).get("expression", "")).strip()
                     for call, result in zip(calls, results) if call.error is None and result == str(row["target"])}
        answer = (last_answer(turns[-1]) or "").strip() if turns else ""  # the block the reward reads
        c["problems"] += 1
        c["correct"] += ok
        c["with_call"] += bool(calls)
        c["calls"] += len(calls)
        c["malformed"] += sum(call.error is not None for call in calls)
        c["with_second_call"] += len(calls) > 1
        c["correct_confirmed"] += ok and answer in confirmed
        c["correct_after_miss"] += ok and bool(results) and results[0] != str(row["target"])
        c["confirmed_not_answered"] += bool(confirmed) and not ok
    return c


def run_model(model: str, *, config: str, problems: int, overrides: list[str]) -> dict[str, Any]:
    import fastgrpo.trainers.warm  # noqa: F401  (registers tiny:countdown-tools)
    from fastgrpo.config import load_config
    from fastgrpo.environments.trajectory import reset_environments, run_trajectories
    from fastgrpo.rollout import SamplingParams
    from fastgrpo.trainers.grpo import Trainer

    cfg = load_config(config, [f"model.name_or_path={model}", "output_dir=/tmp/fastgrpo-tool-use", "name=probe",
                               "checkpoint.resume=never", "checkpoint.overwrite=true", "log.progress=false",
                               "log.report_to=[]", *overrides])
    if cfg.rollout.env is None or cfg.rollout.env.name != "tools":
        raise SystemExit(f"{config}: rollout.env must be the tools environment")
    tr = Trainer(cfg)
    try:
        rows = tr.eval_rows[:problems]
        _, ids = tr.prompts(list(range(len(rows))), tr.eval_rows)
        envs = [tr.env.new() for _ in rows]
        _, ids = reset_environments(envs, rows, 1, [""] * len(rows), ids, tr.env_render)
        trajs = run_trajectories(tr.engine, envs, ids, group_size=1,
                                 sampling=SamplingParams(max_tokens=cfg.rollout.max_completion_length,
                                                         temperature=0.0, seed=cfg.seed),
                                 max_turns=cfg.rollout.max_turns, render=tr.env_render,
                                 tokenizer=tr.env_render.tokenizer)
        return {"model": model, **tool_use_counts(rows, [t.messages for t in trajs])}
    finally:
        tr.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("models", nargs="+", help="registered names (tiny:countdown-tools) or model folders")
    ap.add_argument("--config", default=str(ROOT / "configs" / "tiny-tools.yaml"))
    ap.add_argument("--problems", type=int, default=256, help="held-out problems (the first ones)")
    ap.add_argument("--set", dest="overrides", nargs="*", default=[], help="extra key=value config overrides")
    args = ap.parse_args()
    for model in args.models:
        print(json.dumps(run_model(model, config=args.config, problems=args.problems, overrides=args.overrides)),
              flush=True)


if __name__ == "__main__":
    main()
