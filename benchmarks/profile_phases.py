"""Where a profiled policy update's CPU time goes: trunk forward, trunk backward, head, optimizer, other.

Reads the events of a ``torch.profiler.profile`` (recorded with ``record_shapes=True``) and sums each op's *self*
CPU time into one phase, so that nothing is counted twice:

- ``optimizer``: under torch's ``Optimizer.step#...`` or ``Optimizer.zero_grad#...`` records;
- ``head``: any other op that reads a tensor with a dimension equal to the vocabulary size V (the lm_head matmuls and
  the log-softmax over V, forward or backward; with tied embeddings also the embedding's gradient, a [V, H] tensor);
- ``trunk backward``: under the autograd engine (``autograd::engine::evaluate_function: ...``);
- ``trunk forward``: the rest that runs inside a module's forward, i.e. every other aten op.

Self time is the op's own time, its children's excluded, so the phases add up to the profiled CPU time. On a GPU
the CPU times are dispatch, not the kernels' run time; this split is meant for CPU runs.
"""

from __future__ import annotations

from typing import Any, Iterable

PHASES = ("trunk forward", "trunk backward", "head", "optimizer")


def _ancestors(event: Any) -> Iterable[Any]:
    parent = event.cpu_parent
    while parent is not None:
        yield parent
        parent = parent.cpu_parent


def _phase(event: Any, vocab_size: int) -> str:
    names = [a.name for a in _ancestors(event)] + [event.name]
    if any(n.startswith(("Optimizer.step#", "Optimizer.zero_grad#")) for n in names):
        return "optimizer"
    if any(vocab_size in shape for shape in (event.input_shapes or []) if isinstance(shape, (list, tuple))):
        return "head"
    if any(n.startswith("autograd::engine::evaluate_function") for n in names):
        return "trunk backward"
    return "trunk forward"


def phase_seconds(events: Iterable[Any], vocab_size: int) -> dict[str, float]:
    """Seconds of self CPU time per phase (PHASES) over the profiled events."""
    out = dict.fromkeys(PHASES, 0.0)
    for e in events:
        if e.device_type.name != "CPU":
            continue
        out[_phase(e, vocab_size)] += e.self_cpu_time_total / 1e6
    return out


def phase_table(seconds: dict[str, float], *, extra: dict[str, float] | None = None) -> str:
    """A markdown table of ``seconds`` (and ``extra`` rows, e.g. the rollout's time from the run's metrics), with each
    row's share of the total."""
    rows = {**(extra or {}), **seconds}
    total = sum(rows.values()) or 1.0
    lines = ["| phase | seconds | share |", "|---|---|---|"]
    lines += [f"| {k} | {v:.2f} | {100 * v / total:.0f}% |" for k, v in rows.items()]
    return "\n".join(lines + [f"| total | {total:.2f} | 100% |"])
