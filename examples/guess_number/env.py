"""A multi-turn environment: the model guesses a secret number and is told 'higher' or 'lower' after each guess.

    python -m fastgrpo.train --config examples/guess_number/config.yaml

fastgrpo creates one GuessNumber per trajectory (with rollout.env.kwargs), calls reset(row) with the dataset row,
then step(text) after every model turn until it returns done or rollout.max_turns is reached.
"""

import re

from fastgrpo.environments import Environment


class GuessNumber(Environment):
    observation_role = "user"  # a string observation becomes a user message

    def __init__(self, low: int = 1, high: int = 100) -> None:
        self.low, self.high = low, high

    def reset(self, row: dict) -> str:
        self.secret = int(row["secret"])  # randomness comes from the row: a resumed run replays the same game
        return f"Guess my number between {self.low} and {self.high}. Answer with a number."

    def step(self, text: str):
        numbers = re.findall(r"-?\d+", text)
        if not numbers:
            return "Answer with a number.", -0.1, False  # observation, per-turn reward, done
        guess = int(numbers[-1])
        if guess == self.secret:
            return None, 1.0, True
        return ("higher" if guess < self.secret else "lower"), 0.0, False
