"""Resumable per-rank prompt order: epochs of seeded permutations, split disjointly across ranks.

Epoch e is the permutation of range(num_rows) seeded by (seed, e), cut to a multiple of world_size (so every
rank gets the same number of prompts per epoch and ranks step in lockstep; the few rows cut differ from
epoch to epoch). Rank r takes positions r, r + world_size, ... of it. The state is two integers (epoch,
offset into this rank's share), so a resumed run continues exactly where it stopped.
"""

from __future__ import annotations

from typing import Any

import numpy as np


class PromptSampler:
    """Yields dataset row indices for one rank, epoch after epoch."""

    def __init__(self, num_rows: int, *, seed: int, rank: int = 0, world_size: int = 1) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"PromptSampler: need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
        if num_rows < world_size:
            raise ValueError(f"PromptSampler: {num_rows} rows cannot give each of {world_size} ranks a prompt")
        self.num_rows, self.seed, self.rank, self.world_size = num_rows, seed, rank, world_size
        self.per_rank = num_rows // world_size
        """Prompts this rank sees per epoch."""
        self.epoch = 0
        self.offset = 0
        self._share = self._epoch_share(0)

    def _epoch_share(self, epoch: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, epoch])
        perm = rng.permutation(self.num_rows)[: self.per_rank * self.world_size]
        return perm[self.rank :: self.world_size]

    def next_batch(self, k: int) -> list[int]:
        """The next k row indices of this rank; crosses into the next epoch when this one runs out."""
        if k < 0:
            raise ValueError(f"PromptSampler.next_batch: k must be >= 0, got {k}")
        out: list[int] = []
        while len(out) < k:
            if self.offset == self.per_rank:
                self.epoch += 1
                self.offset = 0
                self._share = self._epoch_share(self.epoch)
            take = min(k - len(out), self.per_rank - self.offset)
            out.extend(int(i) for i in self._share[self.offset : self.offset + take])
            self.offset += take
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "offset": self.offset, "seed": self.seed, "num_rows": self.num_rows,
                "rank": self.rank, "world_size": self.world_size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``; the dataset, seed and world size must match (else the order would not)."""
        for key in ("seed", "num_rows", "world_size"):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"PromptSampler.load_state_dict: checkpoint has {key}={state[key]!r}, this run has "
                    f"{getattr(self, key)!r}; the prompt order cannot be resumed"
                )
        if not 0 <= state["offset"] <= self.per_rank:
            raise ValueError(f"PromptSampler.load_state_dict: offset {state['offset']} out of range")
        self.epoch, self.offset = int(state["epoch"]), int(state["offset"])
        self._share = self._epoch_share(self.epoch)
