"""The optimizer update on packed micro-batches, whatever the loss: the step plan and update (step), the trained-model
bundle (model + optimizer + schedule + guard), the optimizer and its schedule, the non-finite guard and the micro-batch
token budget."""
