"""Rewards of the guessing game: they get the whole conversation as `completions` (a list of messages per trajectory,
TRL's convention) and the environment's per-turn rewards as `env_rewards`."""


def solved(completions, env_rewards, **kwargs):
    """1 when the environment's last reward says the number was found."""
    return [1.0 if rewards and rewards[-1] == 1.0 else 0.0 for rewards in env_rewards]


def fewer_turns(completions, **kwargs):
    """A small bonus for finding it in few turns: -0.1 per assistant turn."""
    return [-0.1 * sum(m["role"] == "assistant" for m in messages) for messages in completions]
