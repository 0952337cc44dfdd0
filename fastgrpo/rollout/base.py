"""The RolloutEngine interface: G completions per pre-tokenized prompt.

Legend: B prompts, G completions per prompt, L completion length.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Iterable

import torch


@dataclass(kw_only=True)
class SamplingParams:
    """How to sample; shared by every engine so that results are comparable."""

    max_tokens: int
    """Most new tokens per completion."""
    temperature: float = 1.0
    """0 means greedy."""
    top_p: float = 1.0
    """Nucleus threshold."""
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
    """Sampler log-prob of each token in token_ids (after temperature), when asked for."""


class RolloutEngine(abc.ABC):
    """Generates completions with the current policy weights."""

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
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")

    def sleep(self) -> None:
        """Release generation memory during the policy update (no-op where unsupported)."""

    def wake(self) -> None:
        """Re-acquire generation memory before the next rollout."""
