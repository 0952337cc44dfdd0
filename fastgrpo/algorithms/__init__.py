"""The algorithm side of a step: episodes (one rollout batch with rewards and advantages), advantages, sampling
filters, loss types as token weights, the token inputs and head loss GRPO and PPO share (tokens), GRPO, PPO and its
critic, SFT's loss, and the ALGORITHMS registry (registry) the trainer and the config ask."""
