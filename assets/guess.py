"""The fourth embedded task, an agent in a stateful environment: find a hidden number from the answers to its guesses.

The class below follows TRL 1.16's `environment_factory` contract, so that it runs unchanged in TRL's GRPOTrainer, and
adds the RL scripts' per-turn rewards in a way TRL does not see:

    python grpo_llm.py --model assets/guess-sft --dataset assets/guess/train.jsonl \\
        --environment assets/guess.py:GuessingGame

Its data and its SFT policy are built by assets/make_guess_models.py. Importing this file only defines the class.
"""

import math


class GuessingGame:
    """Guess a hidden number from 1 to N = 31 in at most K = 8 guesses; each answer says "higher", "lower" or "correct".

    The hidden number comes from the row's `secret` column, so the G completions of one prompt (a GRPO group) play the
    same game. The prompt says nothing about it: the game cannot be won without the answers to earlier guesses.

    TRL's contract: a constructor without arguments; `reset(**row)` starts a game with the dataset row's columns and
    returns None (nothing is added to the prompt); every other public method but `get_reward` is a tool, here `guess`,
    whose JSON schema comes from its type hints and docstring; `get_reward()` is the episode's total reward. The RL
    scripts' extension: `turn_rewards`, a list (an attribute, not a method, or TRL would make it a tool) to which each
    call of `guess` appends that guess's reward; what a turn's calls append is that turn's reward, and `ppo_llm.py`
    puts it on the turn's last token. `reset` clears it.

    Rewards. m is the number of candidates, the numbers that every answer so far allows (m = N before the first guess;
    1 once a guess is correct). The guess of turn t takes m from m_(t-1) to m_t and is rewarded by the share of the
    log2(N) bits the game needs that it gains, minus a cost c = 0.1 a guess:

        r_t = log2(m_(t-1) / m_t) / log2(N) - c

    A guess that is not a candidate, a guess after the game has ended (answered "over") and a call whose n is not a
    whole number from 1 to N (answered with an error) gain nothing and cost c. The episode's total, after k calls:

        get_reward() = 1[solved] - c k

    so a won game of k <= 8 guesses scores 1 - c k >= 0.2, the more the fewer guesses, and a lost one -c k <= 0. The
    bits telescope: the turns' rewards sum to log2(N / m_k) / log2(N) - c k, and the rest, get_reward() -
    sum(turn_rewards), which the RL scripts put on the episode's last token, is 0 for a won game (its guesses gained all
    the log2(N) bits) and -log2(N / m_k) / log2(N) for a lost one (the bits it gathered are taken back). The bits move
    reward between the turns of an episode without changing its total, and they are what tells one guess from another
    at its own turn: a constant cost per guess gives every turn the same reward whatever its guess (at gamma = 1, the
    same expected gradient as the costs summed at the end), whereas halving 31 candidates to 15 earns
    log2(31 / 15) / log2(31) - 0.1 = +0.11 and naming the lowest of 31 earns log2(31 / 30) / log2(31) - 0.1 = -0.09.

    The optimum: bisection (guess (low + high) // 2 of the candidates) takes at most floor(log2(31)) + 1 = 5 guesses,
    and over hidden numbers drawn uniformly from 1..31 it takes (1*1 + 2*2 + 3*4 + 4*8 + 5*16) / 31 = 129 / 31 = 4.16
    guesses on average, the fewest any strategy can: its total is 1 - 0.1 * 129 / 31 = 0.584.
    """

    N = 31
    MAX_GUESSES = 8
    COST = 0.1

    def __init__(self):
        self.secret = None  # no game before reset()
        self.low, self.high = 1, self.N
        self.guesses = 0
        self.solved = False
        self.turn_rewards = []

    def reset(self, secret: int, **row) -> None:
        """Starts the game whose hidden number is the row's `secret`; the row's other columns are not used."""
        if isinstance(secret, bool) or not isinstance(secret, int) or not 1 <= secret <= self.N:
            raise ValueError(f"secret must be a whole number from 1 to {self.N} (got {secret!r})")
        self.secret = secret
        self.low, self.high = 1, self.N
        self.guesses = 0
        self.solved = False
        self.turn_rewards = []

    def guess(self, n: int) -> str:
        """Guess the hidden number.

        Args:
            n: the guess, a whole number from 1 to 31
        """
        if self.secret is None:
            raise RuntimeError("call reset() before guess()")
        over = self.solved or self.guesses >= self.MAX_GUESSES
        self.guesses += 1
        before = self.high - self.low + 1
        if over:
            answer = "over"
        elif isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= self.N:
            answer = f"error: n must be a whole number from 1 to {self.N}"
        elif n == self.secret:
            self.low = self.high = n
            self.solved = True
            answer = "correct"
        elif n < self.secret:
            self.low = max(self.low, n + 1)
            answer = "higher"
        else:
            self.high = min(self.high, n - 1)
            answer = "lower"
        after = self.high - self.low + 1
        self.turn_rewards.append(math.log2(before / after) / math.log2(self.N) - self.COST)
        return answer

    def get_reward(self) -> float:
        """The episode's total: 1 for a won game, minus COST for each call of guess."""
        return float(self.solved) - self.COST * self.guesses
