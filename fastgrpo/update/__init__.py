"""The optimizer update on packed micro-batches: the update step, the optimizer, the non-finite guard and the
micro-batch token budget."""
