"""The guessing game with its rewards summed at the end (benchmarks/llm_learning.py --configs guess): the embedded
assets/guess.py:GuessingGame whose turn_rewards stays empty, so that ppo_llm.py puts the whole get_reward() on the
episode's last token, as grpo_llm.py does. The game, its answers and its total are the embedded class's."""

import importlib.util
import os

path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets", "guess.py")
spec = importlib.util.spec_from_file_location("guess", path)
guess = importlib.util.module_from_spec(spec)
spec.loader.exec_module(guess)


class SummedGuessingGame(guess.GuessingGame):
    """GuessingGame without per-turn rewards: each guess's reward is dropped, the episode's total is unchanged."""

    def guess(self, n: int) -> str:
        """Guess the hidden number.

        Args:
            n: the guess, a whole number from 1 to 31
        """
        answer = super().guess(n)
        self.turn_rewards.clear()
        return answer
