"""The algorithm side of a step: episodes (one rollout batch with rewards and advantages), advantages, sampling
filters, loss types as token weights, PPO and its critic."""
