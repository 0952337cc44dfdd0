"""Adapters that put fastgrpo's fused kernels inside other trainers; each speaks its peer's names and defaults.

``fastgrpo.integrations.trl.GRPOTrainer``: a drop-in for ``trl.GRPOTrainer`` (needs ``pip install fastgrpo[trl]``).
The Liger-shaped module needs no other package and lives with the kernels: ``fastgrpo.kernels.FusedLinearGRPOLoss``.
Nothing here is imported by the rest of fastgrpo.
"""
