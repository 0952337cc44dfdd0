"""The run's progress bar (rank 0, ``log.progress``)."""

from __future__ import annotations

__all__ = ["ProgressBar"]


class ProgressBar:
    """tqdm bar: step, ETA and those of reward (GRPO), loss (SFT), completion length, tokens/s (the sequences' own
    tokens) and the update's forwarded tokens beside its sequences' (fewer with shared prompt prefixes) the record
    has."""

    FIELDS = (("reward", "reward/mean", "{:.3f}"), ("loss", "sft/nll", "{:.3f}"), ("len", "completion/len_mean", "{:.0f}"),
              ("tok/s", "perf/tokens_per_s", "{:.0f}"), ("upd tok", "perf/update_tokens", "{:.0f}"),
              ("fwd", "perf/update_tokens_forwarded", "{:.0f}"))

    def __init__(self, total: int, initial: int, enabled: bool, desc: str = "grpo") -> None:
        from tqdm.auto import tqdm

        self._bar = tqdm(total=total, initial=initial, disable=not enabled, desc=desc, unit="step",
                         dynamic_ncols=True)

    def update(self, record: dict, advance: bool = True) -> None:
        self._bar.set_postfix({name: fmt.format(record[key]) for name, key, fmt in self.FIELDS if key in record},
                              refresh=not advance)
        if advance:
            self._bar.update(1)

    def write(self, msg: str) -> None:
        self._bar.write(msg)

    def close(self) -> None:
        self._bar.close()
