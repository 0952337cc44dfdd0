"""The model: loading (hub ids, local folders, named sources), attention backends, packing into rows, the tiny
embedded model, LoRA and the policy as full tensors."""
