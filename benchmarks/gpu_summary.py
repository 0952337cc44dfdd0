"""The verdict of one GPU call (``benchmarks/run_gpu.sh``): the headline comparisons, each with its ratio, its target
and met / not met / not run, the update's MFU per side on both token counts, then every step of the call with its
status, and the start-up and warm-up times that the ratios leave out.

    python3 benchmarks/gpu_summary.py --work DIR --out OUT/summary.md

Reads what run_gpu.sh leaves in DIR:
  steps.tsv       one line per step: name, status (ok | failed | timeout | skipped | unavailable), seconds, limit,
                  note (tab-separated)
  device.txt      date, GPU, versions
  bench_trl.json  ``bench_trl.py``'s results (runs of fastgrpo, fastgrpo with shared prefixes off and TRL per work)
  decode.log      ``bench_rollout.py --hf-vs-generate``'s output (its markdown table)
  pytest.xml      the GPU pytest's JUnit report

A ratio is fastgrpo's over the reference's, median over alternated pairs (range in brackets); below 1 is faster or
smaller. A comparison is "met" when its median is within the target, "not run" when nothing was measured (the step's
status says why), and "invalid" when the two sides did not do the same work.
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import statistics
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from a checkout

from benchmarks.bench_trl import UNSHARED, markdown as trl_markdown  # noqa: E402


@dataclass(frozen=True)
class Target:
    """One compared quantity: where it comes from and its target bound (None: reported, no target)."""

    label: str
    step: str
    """run_gpu.sh's step that measures it (its status explains a comparison not run)."""
    bound: float | None = None
    at_least: bool = False
    """False: met when the value is <= bound (a time ratio); True: met when it is >= bound (a speed-up)."""
    ratios: str = "ratios"
    """Which of bench_trl's per-pair ratios: 'ratios' (fastgrpo / TRL) or 'ratios_sharing' (fastgrpo with shared
    prefixes / fastgrpo with them off, the same run's third side)."""


# bench_trl's work name and metric name -> the comparison (the 0.5B-shapes targets first: they are the verdict; then
# the 512-token shared prompt, fastgrpo against TRL and sharing against the same trainer with it off)
TRL_TARGETS = [
    ("qwen0.5b-shape", "update", Target("policy update, fastgrpo / TRL, Qwen2.5-0.5B shapes, bf16", "trl", 0.7)),
    ("qwen0.5b-shape", "step", Target("whole step, fastgrpo / TRL, Qwen2.5-0.5B shapes, bf16", "trl", 0.6)),
    ("qwen0.5b-shape", "peak memory", Target("peak memory, fastgrpo / TRL, Qwen2.5-0.5B shapes", "trl")),
    ("qwen0.5b-long-prompt", "update", Target("policy update, fastgrpo / TRL, 512-token shared prompt, Qwen2.5-0.5B "
                                              "shapes", "trl")),
    ("qwen0.5b-long-prompt", "update", Target("policy update, prompts shared / unshared, 512-token shared prompt, "
                                              "Qwen2.5-0.5B shapes", "trl", ratios="ratios_sharing")),
    ("qwen0.5b-long-prompt", "step", Target("whole step, fastgrpo / TRL, 512-token shared prompt, Qwen2.5-0.5B "
                                            "shapes", "trl")),
    ("long-prompt", "update", Target("policy update, fastgrpo / TRL, 512-token shared prompt, tiny model", "trl")),
    ("long-prompt", "update", Target("policy update, prompts shared / unshared, 512-token shared prompt, tiny model",
                                     "trl", ratios="ratios_sharing")),
    ("tiny", "update", Target("policy update, fastgrpo / TRL, tiny model, bf16", "trl")),
    ("tiny", "step", Target("whole step, fastgrpo / TRL, tiny model, bf16", "trl")),
    ("tiny", "peak memory", Target("peak memory, fastgrpo / TRL, tiny model", "trl")),
]
MFU_WORKS = ("qwen0.5b-shape", "qwen0.5b-long-prompt", "long-prompt")
"""bench_trl works whose update MFU the verdict table reports (both counts, every side)."""
DECODE = Target("decode, fastgrpo hf engine vs transformers `generate`, 64 sequences (speed-up)", "decode", 2.0,
                at_least=True)
DECODE_SEQUENCES = 64
PYTEST = Target("kernels, packing, losses, decode tests on CUDA (failed + errors)", "pytest", 0)


@dataclass(frozen=True)
class Verdict:
    target: Target
    measured: str
    verdict: str

    def row(self) -> str:
        t = self.target
        bound = "" if t.bound is None else (f">= {t.bound:g}x" if t.at_least else f"<= {t.bound:g}")
        return f"| {t.label} | {self.measured} | {bound or 'none (reported)'} | {self.verdict} |"


def judge(target: Target, value: float) -> str:
    if target.bound is None:
        return "reported"
    ok = value >= target.bound if target.at_least else value <= target.bound
    return "met" if ok else "not met"


def not_run(target: Target, steps: dict[str, dict], why: str = "") -> Verdict:
    s = steps.get(target.step)
    if s is None:
        status = "not in this call"
    else:
        status = s["status"] + (f" after {s['seconds']} s" if s["status"] in ("timeout", "failed") else "")
        status += f": {s['note']}" if s["note"] else ""
    return Verdict(target, f"{why}; step {target.step} {status}" if why else f"step {target.step} {status}",
                   "not run")


def read_steps(path: Path) -> dict[str, dict]:
    """steps.tsv -> {name: {status, seconds, limit, note}} (in the order the steps ran)."""
    if not path.is_file():
        return {}
    rows = csv.reader(path.read_text().splitlines(), delimiter="\t")
    return {r[0]: {"status": r[1], "seconds": r[2], "limit": r[3], "note": r[4] if len(r) > 4 else ""}
            for r in rows if len(r) >= 4}


def _ratio_text(ratios: list[float], digits: int = 2) -> str:
    med = statistics.median(ratios)
    return (f"{med:.{digits}f} ({min(ratios):.{digits}f}-{max(ratios):.{digits}f}), "
            f"{len(ratios)} pair{'s' if len(ratios) != 1 else ''}")


def trl_verdicts(trl: dict | None, steps: dict[str, dict]) -> list[Verdict]:
    works = {w["work"]: w for w in (trl or {}).get("works", [])}
    out = []
    for work, metric, target in TRL_TARGETS:
        w = works.get(work)
        row = next((r for r in w["rows"] if r["metric"] == metric), None) if w else None
        ratios = row.get(target.ratios, []) if row else []
        if not ratios:
            why = f"{work}: no finished pair" + (f" ({'; '.join(w['notes'][:2])})" if w and w["notes"] else "")
            out.append(not_run(target, steps, why if trl else "no bench_trl.json"))
        elif not w["equal_tokens"]:
            out.append(Verdict(target, _ratio_text(ratios), "invalid: unequal tokens (bench_trl notes)"))
        else:
            out.append(Verdict(target, _ratio_text(ratios), judge(target, statistics.median(ratios))))
    return out


def mfu_verdicts(trl: dict | None, steps: dict[str, dict]) -> list[Verdict]:
    """The update's MFU at each of ``MFU_WORKS`` that bench_trl ran, both counts (bench_trl's rows "MFU, tokens
    forwarded" and "MFU, sequences' tokens"), median over runs for each side; reported, no target."""
    works = {w["work"]: w for w in (trl or {}).get("works", [])}
    out = []
    for work in MFU_WORKS:
        w = works.get(work)
        if w is None:
            continue
        target = Target(f"update MFU, tokens forwarded / sequences' tokens, {work}", "trl")
        rows = {r["metric"]: r for r in w["rows"]}
        forwarded, sequences = rows.get("MFU, tokens forwarded"), rows.get("MFU, sequences' tokens")
        sides = [(name, side) for name, side in (("fastgrpo", "fastgrpo"), ("unshared", UNSHARED),
                                                 ("TRL", "trl")) if forwarded and forwarded.get(side)]
        if not sides:
            out.append(not_run(target, steps, f"{work}: no MFU (no run finished, or no peak FLOP/s for the device)"))
            continue
        out.append(Verdict(target, "; ".join(
            f"{name} {statistics.median(forwarded[side]):.1f}% / {statistics.median(sequences[side]):.1f}%"
            for name, side in sides), "reported"))
    return out


_DECODE_ROW = re.compile(r"^\|\s*(?P<name>[^|]+?)\s*\|\s*(?P<s>[\d.]+)\s*\|[^|]*\|\s*(?P<tokens>[\d.]+)\s*\|[^|]*\|"
                         r"\s*(?P<med>[\d.]+) \((?P<lo>[\d.]+)-(?P<hi>[\d.]+)\)\s*\|\s*$")
_DECODE_WORK = re.compile(r"(\d+) prompts x (\d+) samples")


def parse_decode(text: str) -> dict | None:
    """bench_rollout.py --hf-vs-generate's output -> {sequences, rows: {name: {s, tokens, ratio: (med, lo, hi)}}}:
    ratio = that row's seconds / generate's, median and range over the alternated rounds; None without a table."""
    rows = {m["name"]: {"s": float(m["s"]), "tokens": float(m["tokens"]),
                        "ratio": (float(m["med"]), float(m["lo"]), float(m["hi"]))}
            for m in map(_DECODE_ROW.match, text.splitlines()) if m}
    work = _DECODE_WORK.search(text)
    if not rows:
        return None
    return {"sequences": int(work[1]) * int(work[2]) if work else None, "rows": rows}


def decode_verdict(text: str | None, steps: dict[str, dict]) -> Verdict:
    parsed = parse_decode(text) if text else None
    ours = parsed and next((r for name, r in parsed["rows"].items() if name.startswith("fastgrpo")), None)
    theirs = parsed and next((r for name, r in parsed["rows"].items() if "generate" in name), None)
    if not ours or not theirs:
        return not_run(DECODE, steps, "no table in decode.log" if text else "")
    med, lo, hi = ours["ratio"]
    measured = (f"{1 / med:.2f}x ({1 / hi:.2f}-{1 / lo:.2f}); seconds ratio {med:.2f}, "
                f"{parsed['sequences']} sequences")
    if ours["tokens"] != theirs["tokens"]:
        return Verdict(DECODE, measured, f"invalid: tokens {ours['tokens']:.0f} vs {theirs['tokens']:.0f}")
    if parsed["sequences"] != DECODE_SEQUENCES:
        return Verdict(DECODE, measured, f"not run at {DECODE_SEQUENCES} sequences")
    return Verdict(DECODE, measured, judge(DECODE, 1 / med))


def pytest_verdict(xml: Path, steps: dict[str, dict]) -> tuple[Verdict, list[str]]:
    """Counts from the JUnit report, and the names of the tests that failed or errored."""
    if not xml.is_file():
        return not_run(PYTEST, steps), []
    root = ET.parse(xml).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    count = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    bad = [f"{c.get('classname')}::{c.get('name')}" for c in root.iter("testcase")
           if c.find("failure") is not None or c.find("error") is not None]
    n_bad = count["failures"] + count["errors"]
    measured = (f"{count['tests'] - n_bad - count['skipped']} passed, {count['failures']} failed, "
                f"{count['errors']} errors, {count['skipped']} skipped")
    return Verdict(PYTEST, measured, judge(PYTEST, n_bad)), bad


def summary(work: Path) -> str:
    steps = read_steps(work / "steps.tsv")
    trl_file = work / "bench_trl.json"
    trl = json.loads(trl_file.read_text()) if trl_file.is_file() else None
    decode_file = work / "decode.log"
    decode_text = decode_file.read_text(errors="replace") if decode_file.is_file() else None
    tests, failed = pytest_verdict(work / "pytest.xml", steps)
    verdicts = [*trl_verdicts(trl, steps), *mfu_verdicts(trl, steps), decode_verdict(decode_text, steps), tests]

    device = (work / "device.txt").read_text().strip() if (work / "device.txt").is_file() else "device: unknown"
    out = [f"# GPU call: the headline verdict\n\n```\n{device}\n```\n",
           "| comparison | measured: median (range) | target | verdict |", "|---|---|---|---|",
           *(v.row() for v in verdicts)]
    if failed:
        out += ["", "Failed tests: " + ", ".join(f"`{name}`" for name in failed[:20])]
    out += ["", "## Steps of this call, in the order they ran", "", "| step | status | seconds | limit | note |",
            "|---|---|---|---|---|", *(f"| {n} | {s['status']} | {s['seconds']} | {s['limit']} | {s['note']} |"
                                       for n, s in steps.items())]
    if trl:
        out += ["", "## fastgrpo vs TRL (bench_trl.py; start-up and warm-up are outside the ratios)", "",
                f"`{trl.get('command', '')}`", ""] + [trl_markdown(w) for w in trl.get("works", [])]
    update_md = work / "bench_trl_update.md"  # the update alone (bench_trl.py --update-only), as it printed it
    if update_md.is_file():
        out += ["", "## The update alone: TRL padded vs fastgrpo packed (bench_trl.py --update-only)", "",
                update_md.read_text(errors="replace").strip()]
    if decode_text and parse_decode(decode_text):
        lines = decode_text.splitlines()
        out += ["", "## Decode (bench_rollout.py --hf-vs-generate)", "",
                *(line for line in lines if line.startswith("device:")), "",
                *(line for line in lines if line.startswith("|"))]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", required=True, type=Path, help="the folder run_gpu.sh wrote its step outputs to")
    ap.add_argument("--out", type=Path, help="also write the summary here")
    args = ap.parse_args(argv)
    text = summary(args.work)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
