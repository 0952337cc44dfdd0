"""Rollout engines, keyed by name in ENGINES. Each engine module registers itself on import; engines import their
heavy dependencies (vllm) lazily."""

from fastgrpo.rollout.base import (ENGINES, Completion, EngineSetup, RolloutEngine, SamplingParams,
                                   register_engine)
from fastgrpo.rollout import hf as _hf, vllm as _vllm  # noqa: E402,F401  (registration)

__all__ = ["ENGINES", "Completion", "EngineSetup", "RolloutEngine", "SamplingParams", "build_engine",
           "register_engine"]


def build_engine(name: str, setup: EngineSetup) -> RolloutEngine:
    """Construct the engine registered under ``name`` for a training run."""
    if name not in ENGINES:
        raise ValueError(f"rollout.engine: unknown engine {name!r} ({', '.join(sorted(ENGINES))})")
    return ENGINES[name].from_setup(setup)
