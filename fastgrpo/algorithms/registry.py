"""ALGORITHMS: the training algorithms by name (``algorithm:`` in a run config; the config's choices and
``--help-config`` read this table), and :func:`check_algorithm`, the run config's check of what the chosen
algorithm serves. A new algorithm is one :class:`~fastgrpo.algorithms.interface.Algorithm` value and one entry
here."""

from __future__ import annotations

from fastgrpo.algorithms.grpo import GRPO
from fastgrpo.algorithms.interface import Algorithm
from fastgrpo.algorithms.ppo import PPO
from fastgrpo.config import TrainConfig
from fastgrpo.config.loader import check, section_check

__all__ = ["ALGORITHMS", "check_algorithm", "check_async", "register_algorithm"]

ALGORITHMS: dict[str, Algorithm] = {}


def register_algorithm(algorithm: Algorithm) -> Algorithm:
    """Add ``algorithm`` under its name (a name already taken is an error: two entries would drift apart)."""
    if algorithm.name in ALGORITHMS:
        raise ValueError(f"algorithm {algorithm.name!r} is registered already")
    ALGORITHMS[algorithm.name] = algorithm
    return algorithm


register_algorithm(GRPO)
register_algorithm(PPO)


@section_check(TrainConfig)
def check_algorithm(cfg: TrainConfig, p: str = "") -> None:
    """What the chosen algorithm serves, each refusal naming its field: multi-turn rollouts, its own checks
    (``Algorithm.check_config``) and the asynchronous rollout."""
    algorithm = ALGORITHMS[cfg.algorithm]
    check(algorithm.multi_turn or not cfg.rollout.env.enabled, "rollout.env",
          f"multi-turn rollouts do not train with algorithm {cfg.algorithm} (use grpo)")
    algorithm.check_config(cfg)
    if cfg.rollout.asynchronous:
        check_async(cfg, algorithm)


def check_async(cfg: TrainConfig, algorithm: Algorithm) -> None:
    """rollout.asynchronous: the combinations it serves so far (docs/ASYNC.md); each other one is refused here,
    naming its field, rather than half-working."""
    r = cfg.rollout
    check(r.engine == "hf", "rollout.engine", f"rollout.asynchronous generates with the 'hf' engine only for now, got "
          f"{r.engine!r} (vLLM on its own GPUs is designed in docs/ASYNC.md, not built)")
    what = "the tools environment" if r.env.name == "tools" else f"the environment {r.env.name!r}"
    check(not r.env.enabled, "rollout.env.name", f"multi-turn rollouts ({what}) are not served by "
          "rollout.asynchronous yet: set rollout.asynchronous=false, or rollout.env.name=none for single-turn")
    check(algorithm.asynchronous_rollout, "algorithm", f"rollout.asynchronous does not serve algorithm "
          f"{cfg.algorithm!r} yet (grpo only)")
    check(r.importance_sampling_cap is not None, "rollout.importance_sampling_cap",
          "rollout.asynchronous trains on batches sampled by older weights: set the truncated importance-sampling "
          "cap that corrects them (e.g. 2.0)")
    check(cfg.device != "cuda", "device", "rollout.asynchronous runs on the CPU for now (the GPU design is in "
          "docs/ASYNC.md); use device=cpu")
