"""The control of the guessing game (benchmarks/llm_learning.py --configs guess): the embedded
assets/guess.py:GuessingGame whose every answer is "no", whatever the guess, so that the policy learns nothing about the
hidden number from the environment. Its rewards are the embedded class's, counted on the true game: a guess that names
the hidden number still wins (the answer does not say so, so the policy goes on guessing until it stops)."""

import importlib.util
import os

path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets", "guess.py")
spec = importlib.util.spec_from_file_location("guess", path)
guess = importlib.util.module_from_spec(spec)
spec.loader.exec_module(guess)


class ControlGuessingGame(guess.GuessingGame):
    """GuessingGame whose answers carry no information: every call of guess is answered "no"."""

    def guess(self, n: int) -> str:
        """Guess the hidden number.

        Args:
            n: the guess, a whole number from 1 to 31
        """
        super().guess(n)
        return "no"
