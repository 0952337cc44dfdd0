"""Rollout engines, keyed by name. Engines import their heavy dependencies lazily."""

from fastgrpo.rollout.base import Completion, RolloutEngine, SamplingParams

__all__ = ["Completion", "RolloutEngine", "SamplingParams", "build_engine"]


def build_engine(name: str, **kwargs) -> RolloutEngine:
    """Construct the engine registered under ``name`` ('hf' or 'vllm')."""
    if name == "hf":
        from fastgrpo.rollout.hf import HFEngine

        return HFEngine(**kwargs)
    if name == "vllm":
        from fastgrpo.rollout.vllm import VLLMEngine

        return VLLMEngine(**kwargs)
    raise ValueError(f"rollout.engine: unknown engine {name!r} (hf, vllm)")
