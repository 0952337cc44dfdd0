"""fastgrpo: a fast GRPO trainer for reasoning RL on language models."""

__version__ = "0.1.0"
