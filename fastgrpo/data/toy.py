"""The toy task of the learning test: prompts asking for a number, scored by the ``toy_digit`` reward.

A tiny randomly initialised model learns within a few dozen GRPO steps to start its reply with a digit, which
is what the end-to-end learning test checks. Rows are ``{"prompt": str}``; the prompt strings are distinct
so that held-out prompts never appear in training.
"""

from __future__ import annotations

import random
from itertools import product
from typing import Any

_VERBS = ("Write", "Give me", "Type", "Say", "Name", "Pick", "Tell me", "Choose")
_OBJECTS = ("a number", "any number", "one number")
_ENDINGS = (":", ".")


def toy_prompts() -> list[str]:
    """All distinct toy prompt strings (8 verbs x 3 objects x 2 endings = 48), in a fixed order."""
    return [f"{verb} {obj}{end}" for verb, obj, end in product(_VERBS, _OBJECTS, _ENDINGS)]


def toy_splits(*, num_eval: int, seed: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(train, eval) rows: a seeded shuffle of the prompts; eval takes at most a quarter of them.

    The cap keeps most prompts for training whatever DataConfig.num_eval says (the default 64 exceeds the 48
    prompts); train always has every prompt not held out.
    """
    prompts = toy_prompts()
    random.Random(f"toy-{seed}").shuffle(prompts)
    n_eval = min(num_eval, len(prompts) // 4)
    return [{"prompt": p} for p in prompts[n_eval:]], [{"prompt": p} for p in prompts[:n_eval]]
