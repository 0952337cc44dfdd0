"""The RolloutEngine interface (G completions per pre-tokenized prompt) and the ENGINES registry.

Legend: B prompts, G completions per prompt, L completion length.

An engine registers itself with ``@register_engine(name)``; ``rollout.engine`` accepts every registered name, and
the trainer builds the engine with ``ENGINES[name].from_setup(EngineSetup(...))``, so a new engine is one file.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
from torch import nn

from fastgrpo.config import RolloutConfig
from fastgrpo.models.policy_state import iter_policy_tensors


@dataclass(kw_only=True)
class SamplingParams:
    """How to sample; shared by every engine so that results are comparable."""

    max_tokens: int
    """Most new tokens per completion."""
    temperature: float = 1.0
    """0 means greedy."""
    top_p: float = 1.0
    """Nucleus threshold."""
    top_k: int = 0
    """Sample among the top_k most likely tokens only (before top_p); 0 = all."""
    seed: int | None = None
    """Seed for this call; the same seed and weights give the same completions."""
    logprobs: bool = False
    """Also return the sampler's log-prob of each sampled token."""


@dataclass(kw_only=True)
class Completion:
    """One sampled completion of one prompt."""

    token_ids: list[int]
    """Generated token ids, EOS included when generation stopped on it; no padding."""
    text: str
    """Decoded completion, special tokens removed."""
    finish_reason: str
    """'stop' (EOS or a stop token) or 'length' (hit max_tokens)."""
    logprobs: list[float] | None = None
    """Sampler log-prob of each token in token_ids, when asked for: under the distribution it was drawn from (after
    temperature, renormalised over the top_k / top_p kept set: fastgrpo.rollout.truncation)."""


@dataclass(kw_only=True)
class EngineSetup:
    """What the trainer hands an engine's :meth:`RolloutEngine.from_setup`; the callables cost work only if called."""

    cfg: RolloutConfig
    """The rollout section of the run's config."""
    model: nn.Module
    """The live (parallelized) policy."""
    tokenizer: Any
    """The policy's tokenizer."""
    model_path: Callable[[], str]
    """The policy's local Hugging Face folder (the tiny model is built on first use)."""
    prompt_token_bound: Callable[[], int]
    """An upper bound on the token count of every prompt of both splits (see Trainer.prompt_token_bound)."""
    seed: int
    """The run's seed."""
    rank: int = 0
    """This process's rank."""
    world_size: int = 1
    """Number of ranks."""
    autocast_dtype: torch.dtype | None = None
    """The dtype the policy computes in under autocast (its runner's: one plain GPU, float32 weights), or None."""


class RolloutEngine(abc.ABC):
    """Generates completions with the current policy weights."""

    @classmethod
    def from_setup(cls, setup: EngineSetup) -> "RolloutEngine":
        """Build the engine for a training run (the trainer then calls :meth:`sync_from` once)."""
        raise NotImplementedError(f"{cls.__name__} cannot be built from a training config; pass it to Trainer")

    @classmethod
    def check_available(cls) -> None:
        """Cheap check, before any model loads: ImportError with the install command if a dependency is missing."""

    def sync_from(self, model: nn.Module) -> bool:
        """Make the engine sample from ``model``'s current weights; returns whether weights were copied.

        Default: :meth:`update_weights` with the full tensors (FSDP2 shards gathered; LoRA adapters merged in).
        Engines that generate with the policy module itself override this with a no-op."""
        self.update_weights(iter_policy_tensors(model))
        return True

    @abc.abstractmethod
    def generate(self, prompts: list[list[int]], n: int, sampling: SamplingParams) -> list[list[Completion]]:
        """For each of B pre-tokenized prompts, n completions: returns [B][n]."""

    @abc.abstractmethod
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load new policy weights (Hugging Face parameter names, full tensors)."""

    @staticmethod
    def check_request(prompts: list[list[int]], n: int, sampling: SamplingParams) -> None:
        """The argument checks every engine makes before generating."""
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        if sampling.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {sampling.max_tokens}")
        if sampling.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = all tokens), got {sampling.top_k}")
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")

    def sleep(self) -> None:
        """Release generation memory during the policy update (no-op where unsupported)."""

    def wake(self) -> None:
        """Re-acquire generation memory before the next rollout."""


ENGINES: dict[str, type[RolloutEngine]] = {}
"""Engine name (the choices of rollout.engine) -> engine class."""


def register_engine(name: str) -> Callable[[type[RolloutEngine]], type[RolloutEngine]]:
    """Class decorator: make ``name`` a valid ``rollout.engine``."""

    def deco(cls: type[RolloutEngine]) -> type[RolloutEngine]:
        ENGINES[name] = cls
        return cls

    return deco
