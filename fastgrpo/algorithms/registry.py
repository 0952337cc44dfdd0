"""ALGORITHMS: the training algorithms by name (``algorithm:`` in a run config; the config's choices, its checks and
``--help-config`` read this table). A new algorithm is one :class:`~fastgrpo.algorithms.interface.Algorithm`
value and one entry here."""

from __future__ import annotations

from fastgrpo.algorithms.grpo import GRPO
from fastgrpo.algorithms.interface import Algorithm
from fastgrpo.algorithms.ppo import PPO

__all__ = ["ALGORITHMS", "register_algorithm"]

ALGORITHMS: dict[str, Algorithm] = {}


def register_algorithm(algorithm: Algorithm) -> Algorithm:
    """Add ``algorithm`` under its name (a name already taken is an error: two entries would drift apart)."""
    if algorithm.name in ALGORITHMS:
        raise ValueError(f"algorithm {algorithm.name!r} is registered already")
    ALGORITHMS[algorithm.name] = algorithm
    return algorithm


register_algorithm(GRPO)
register_algorithm(PPO)
