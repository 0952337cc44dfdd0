"""torch.distributed: process groups and collectives, FSDP2 parallelization, checkpoints."""
