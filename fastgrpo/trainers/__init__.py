"""The loops: the shared TrainingLoop, the GRPO and SFT trainers, evaluation, preflight checks and warm models."""
