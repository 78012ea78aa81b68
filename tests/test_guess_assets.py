"""The fourth embedded task, the guessing game in a stateful environment: its environment (assets/guess.py), its builder
(assets/make_guess_models.py), its game files (assets/guess/) and its SFT policy (assets/guess-sft), its tokenizer and
its chat and response templates."""

import json
import math
import os
import random
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import get_json_schema

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ASSETS = os.path.join(ROOT, "assets")
SFT_DIR, DATA_DIR = os.path.join(ASSETS, "guess-sft"), os.path.join(ASSETS, "guess")
sys.path.insert(0, ASSETS)
import make_guess_models as mgm  # noqa: E402
from guess import GuessingGame  # noqa: E402

TINY = dict(n_embd=32, n_layer=1, n_head=1, sft_steps=2, sft_batch_size=4, log_every=100, eval_max_new_tokens=40)

PROMPT = "guess:1-31\nA:"
CALL = "<tool_call>guess(n=16)"
# 16 is too high, 8 too low, 12 right: the game the template renders below
GAME = (
    PROMPT + CALL + "<eos>\nR:lower\nA:<tool_call>guess(n=8)<eos>\nR:higher\nA:<tool_call>guess(n=12)<eos>"
    "\nR:correct\nA:<eos>"
)


def read_rows(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(SFT_DIR)


# ---- the environment ----
def test_rewards_of_a_game_worked_by_hand():
    game = GuessingGame()
    assert game.reset(secret=12, prompt=[{"role": "user", "content": "1-31"}], game=7) is None  # nothing for the prompt
    bits = math.log2(31)
    # 16: lower, the candidates go from 1..31 (31) to 1..15 (15): log2(31 / 15) / log2(31) - 0.1 = 1.0473 / 4.9542 - 0.1
    assert game.guess(16) == "lower" and (game.low, game.high) == (1, 15)
    assert game.turn_rewards[-1] == pytest.approx(math.log2(31 / 15) / bits - 0.1) == pytest.approx(0.1114, abs=1e-4)
    # 8: higher, 1..15 to 9..15 (7): log2(15 / 7) / log2(31) - 0.1 = 1.0995 / 4.9542 - 0.1 = 0.1219
    assert game.guess(8) == "higher" and (game.low, game.high) == (9, 15)
    assert game.turn_rewards[-1] == pytest.approx(0.1219, abs=1e-4)
    # 12: correct, 9..15 (7) to 12 alone (1): log2(7) / log2(31) - 0.1 = 2.8074 / 4.9542 - 0.1 = 0.4667
    assert game.guess(12) == "correct" and game.solved
    assert game.turn_rewards[-1] == pytest.approx(0.4667, abs=1e-4)
    # the guesses gained all log2(31) bits: the turns sum to 1 - 3 * 0.1 = 0.7, the total, and the final part is 0
    assert sum(game.turn_rewards) == pytest.approx(0.7) and game.get_reward() == pytest.approx(0.7)
    # a guess after the end: "over", no bits, the cost; the total falls to 1 - 4 * 0.1
    assert game.guess(12) == "over" and game.turn_rewards[-1] == pytest.approx(-0.1)
    assert game.get_reward() == pytest.approx(0.6) == pytest.approx(sum(game.turn_rewards))


def test_a_lost_game_takes_the_bits_back_at_the_end():
    game = GuessingGame()
    game.reset(secret=31)
    answers = [game.guess(n) for n in range(1, 9)]  # counting up from 1: 8 guesses, each "higher"
    assert answers == ["higher"] * 8 and not game.solved and (game.low, game.high) == (9, 31)
    # each guess rules out one of m candidates: log2(m / (m - 1)) / log2(31) - 0.1; they telescope to
    # log2(31 / 23) / log2(31) - 0.8 = 0.4307 / 4.9542 - 0.8 = -0.7131
    assert sum(game.turn_rewards) == pytest.approx(math.log2(31 / 23) / math.log2(31) - 0.8)
    assert sum(game.turn_rewards) == pytest.approx(-0.7131, abs=1e-4)
    # the total is -0.1 * 8; the final part, on the last token, takes back the bits gathered
    assert game.get_reward() == pytest.approx(-0.8)
    assert game.get_reward() - sum(game.turn_rewards) == pytest.approx(-math.log2(31 / 23) / math.log2(31))
    assert game.guess(31) == "over" and game.get_reward() == pytest.approx(-0.9)  # the game ended at the 8th guess


def test_reset_clears_the_game_and_its_rewards():
    game = GuessingGame()
    game.reset(secret=5)
    game.guess(5)
    game.reset(secret=20)
    assert (game.secret, game.low, game.high, game.guesses, game.solved, game.turn_rewards) == (20, 1, 31, 0, False, [])
    assert game.get_reward() == 0.0
    for bad in (0, 32, "5", True, None):
        with pytest.raises(ValueError, match="secret must be a whole number from 1 to 31"):
            game.reset(secret=bad)
    with pytest.raises(RuntimeError, match="reset"):
        GuessingGame().guess(3)


def test_bad_or_useless_guesses_cost_without_gaining():
    game = GuessingGame()
    game.reset(secret=10)
    assert game.guess(40).startswith("error: n must be a whole number from 1 to 31")
    assert game.guess("7").startswith("error: ")
    game.guess(20)  # lower: 1..19
    assert game.guess(25) == "lower" and game.high == 19  # not a candidate: a true answer, no bits
    assert game.turn_rewards[0] == game.turn_rewards[1] == game.turn_rewards[3] == pytest.approx(-0.1)
    assert game.guesses == 4 and game.get_reward() == pytest.approx(-0.4)


def test_the_sums_of_random_games_add_up():
    rng = random.Random(0)
    for _ in range(200):
        game = GuessingGame()
        game.reset(secret=rng.randint(1, 31))
        while rng.random() < 0.9 and game.guesses < 10:
            game.guess(rng.randint(0, 32))
        final = game.get_reward() - sum(game.turn_rewards)
        # 0 for a won game; for a lost one, minus the share of the bits gathered
        assert final == pytest.approx(-math.log2(31 / (game.high - game.low + 1)) / math.log2(31) * (not game.solved))
        assert game.get_reward() == pytest.approx(float(game.solved) - 0.1 * game.guesses)


def test_the_contract_as_trl_reads_it():
    # TRL's environment_factory: a constructor without arguments; every public method but reset and get_reward is a
    # tool, and turn_rewards is an attribute, not one of them
    game = GuessingGame()
    methods = [name for name in dir(GuessingGame) if callable(getattr(GuessingGame, name)) and not name.startswith("_")]
    assert methods == ["get_reward", "guess", "reset"] and isinstance(game.turn_rewards, list)
    schema = get_json_schema(game.guess)["function"]
    assert schema["name"] == "guess" and schema["parameters"]["properties"]["n"]["type"] == "integer"
    assert schema["parameters"]["required"] == ["n"]


def test_bisection_is_the_optimum_the_readme_quotes():
    # bisection's tree of 1..31 is perfect: 1 number at depth 1, 2 at 2, 4, 8 and 16 at 5
    depths = [len(mgm.bisection(secret)) for secret in range(1, 32)]
    assert max(depths) == math.floor(math.log2(31)) + 1 == 5 and sum(depths) == 1 + 4 + 12 + 32 + 80 == 129
    assert mgm.bisection(12) == [16, 8, 12]


# ---- the committed files ----
def test_committed_game_files():
    train, test = read_rows(os.path.join(DATA_DIR, "train.jsonl")), read_rows(os.path.join(DATA_DIR, "test.jsonl"))
    assert (len(train), len(test)) == (31 * 100, 31 * 8)
    for rows, per_secret in [(train, 100), (test, 8)]:
        assert sorted(row["secret"] for row in rows) == [s for s in range(1, 32) for _ in range(per_secret)]
        assert all(row["prompt"] == [{"role": "user", "content": "1-31"}] for row in rows)
    # the held-out games are never trained on: no game of test.jsonl is in train.jsonl
    assert {row["game"] for row in train}.isdisjoint(row["game"] for row in test)
    assert len({row["game"] for row in train + test}) == len(train) + len(test)
    assert (train, test) == mgm.problem_files()  # what the builder writes, row for row


def test_committed_model_config(tok):
    policy = AutoModelForCausalLM.from_pretrained(SFT_DIR)
    config = policy.config
    assert type(policy).__name__ == "GPT2LMHeadModel" and config.vocab_size == 105 == len(tok)
    # a head of 128 / 4 = 32, which vLLM's CPU attention serves
    assert (config.n_layer, config.n_embd, config.n_head, config.n_positions) == (4, 128, 4, 272)
    assert policy.generation_config.max_new_tokens == 129
    assert os.path.getsize(os.path.join(SFT_DIR, "model.safetensors")) <= 5 * 2**20


# ---- the tokenizer and its templates ----
def test_the_longest_valid_game_fits_the_budget(tok):
    # 8 two-digit guesses: each call is <tool_call> guess ( n = d d ) <eos> (9 tokens), each tool message
    # \n R : word \n A : (7); then the final <eos>: 8 * 16 + 1 = 129
    calls = "".join(f"<tool_call>guess(n={n})<eos>\nR:lower\nA:" for n in range(31, 23, -1))
    assert len(tok(calls + "<eos>", add_special_tokens=False)["input_ids"]) == 129
    assert len(tok(PROMPT, add_special_tokens=False)["input_ids"]) == mgm.PROMPT_TOKENS == 9


def test_chat_template_renders_the_game(tok):
    game = GuessingGame()
    conversation = [{"role": "user", "content": "1-31"}]
    for n, answer in [(16, "lower"), (8, "higher"), (12, "correct")]:
        conversation += [mgm.guess_call(n), {"role": "tool", "name": "guess", "content": answer}]
    conversation.append({"role": "assistant", "content": ""})
    assert tok.apply_chat_template(conversation, tools=[game.guess], tokenize=False) == GAME
    ids = tok(GAME, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == GAME and ids[:2] == [101, 29]  # the word token guess, then ':' (ASCII 58 -> 29)
    assert tok.convert_tokens_to_ids(list(mgm.WORDS)) == [101, 102, 103, 104]


def test_response_template_parses_the_call_back(tok):
    call = {"type": "function", "function": {"name": "guess", "arguments": {"n": 16}}}
    for turn in (CALL, CALL + "<eos>"):  # decoded with or without its EOS
        parsed = tok.parse_response(turn, prefix=PROMPT, tools=[GuessingGame().guess])
        assert parsed["role"] == "assistant" and parsed["tool_calls"] == [call]
        assert type(parsed["tool_calls"][0]["function"]["arguments"]["n"]) is int
    # the int comes from the template, without the tools' schemas too; a turn without a call is the stop
    assert tok.parse_response(CALL, prefix=PROMPT)["tool_calls"] == [call]
    assert "tool_calls" not in tok.parse_response("<eos>", prefix=PROMPT + CALL + "<eos>\nR:correct\nA:")


def test_demonstration_is_the_templates_render_and_masks_the_assistants_tokens(tok):
    ids, mask = mgm.demonstration(tok, 12, random.Random(3), mgm.Args())
    text = tok.decode(ids)
    assert text.startswith(PROMPT) and text.endswith("\nR:correct\nA:<eos>")
    # the same game, rendered whole by the chat template
    conversation = [{"role": "user", "content": "1-31"}]
    game = GuessingGame()
    game.reset(secret=12)
    guesses = [int(part.split(")")[0]) for part in text.split("guess(n=")[1:]]
    for n in guesses:
        conversation += [mgm.guess_call(n), {"role": "tool", "name": "guess", "content": game.guess(n)}]
    conversation.append({"role": "assistant", "content": ""})
    assert game.solved and tok.apply_chat_template(conversation, tools=[game.guess], tokenize=False) == text
    # the loss is on the calls and their EOS, and on the final EOS, not on the prompt nor the tool messages
    trained = tok.decode([i for i, m in zip(ids, mask) if m])
    assert trained == "".join(f"<tool_call>guess(n={n})<eos>" for n in guesses) + "<eos>"


@torch.no_grad()
def test_committed_policy_plays_a_valid_first_guess(tok):
    """Greedy, the policy's first turn is a well-formed call of guess."""
    policy = AutoModelForCausalLM.from_pretrained(SFT_DIR)
    prompt = tok(PROMPT, return_tensors="pt", add_special_tokens=False)
    out = policy.generate(**prompt, do_sample=False, max_new_tokens=12)
    turn = tok.decode(out[0, prompt["input_ids"].shape[1] :])
    calls = tok.parse_response(turn, prefix=PROMPT, tools=[GuessingGame().guess])["tool_calls"]
    assert len(calls) == 1 and calls[0]["function"]["name"] == "guess"
    assert 1 <= calls[0]["function"]["arguments"]["n"] <= 31


class ScriptedPolicy:
    """A stand-in for the policy in the builder's tool loop: from each row's context (left-padded), the next turn of a
    strategy that reads the answers so far, as ids, then its EOS."""

    def __init__(self, tok, strategy):
        self.tok, self.strategy = tok, strategy

    def generate(self, input_ids, attention_mask, max_new_tokens, **sampling):
        turns = []
        for ids, mask in zip(input_ids.tolist(), attention_mask.tolist()):
            text = self.tok.decode([i for i, m in zip(ids, mask) if m])
            low, high, answers = 1, 31, []
            for part in text.split("guess(n=")[1:]:
                n = int(part.split(")")[0])
                answers.append(part.split("R:")[1].split("\n")[0])
                if answers[-1] == "higher":
                    low = n + 1
                if answers[-1] == "lower":
                    high = n - 1
            turn = f"<tool_call>guess(n={self.strategy(low, high)})<eos>"
            if "correct" in answers or len(answers) == 8:  # the game's end: the stop
                turn = "<eos>"
            turns.append(self.tok(turn, add_special_tokens=False)["input_ids"][:max_new_tokens])
        width = max(map(len, turns))
        turns = [turn + [self.tok.pad_token_id] * (width - len(turn)) for turn in turns]
        return torch.cat([input_ids, torch.tensor(turns)], dim=1)


def test_tool_loop_measures_bisection_and_counting_up(tok):
    rows = [{"prompt": mgm.PROMPT, "secret": secret} for secret in range(1, 32)]  # each number once
    bisection = mgm.policy_metrics(ScriptedPolicy(tok, lambda low, high: (low + high) // 2), tok, rows, False, 129)
    # every game won, in 129 / 31 guesses on average, reward 1 - 0.1 * 129 / 31 = 0.584
    assert bisection["success_rate"] == 1 and bisection["mean_guesses"] == pytest.approx(129 / 31)
    assert bisection["mean_reward"] == pytest.approx(1 - 0.1 * 129 / 31)
    assert bisection["valid_guess_share"] == bisection["middle_share"] == bisection["stopped_at_end"] == 1
    counting = mgm.policy_metrics(ScriptedPolicy(tok, lambda low, high: low), tok, rows, False, 129)
    # counting up from 1 wins the numbers 1..8 (8 of 31) in 1..8 guesses, the others lose after 8:
    # (1 + ... + 8 + 23 * 8) / 31 = 220 / 31 = 7.10 guesses, the greedy policy's row of assets/README.md
    assert counting["success_rate"] == pytest.approx(8 / 31) and counting["mean_guesses"] == pytest.approx(220 / 31)
    assert counting["valid_guess_share"] == counting["lowest_share"] == counting["stopped_at_end"] == 1


# ---- the builder ----
def test_build_refuses_to_overwrite_without_the_flag(tmp_path):
    os.makedirs(tmp_path / "guess")
    for out_dir in (ASSETS, str(tmp_path)):  # the embedded one, or any earlier build
        with pytest.raises(SystemExit, match=r"^error: .*guess exists: pass --overwrite to replace it, or another"):
            mgm.main(mgm.Args(out_dir=out_dir, **TINY))


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(mid_share=1.5), "--mid-share must be in"),
        (dict(mid_share=0.6, low_share=0.6), "--mid-share \\+ --low-share must be at most 1"),
        (dict(eval_max_new_tokens=132), "do not fit --n-positions 272"),  # 9 + 2 * 132 = 273 > 272
    ],
)
def test_bad_settings_are_one_line(tmp_path, change, message):
    with pytest.raises(SystemExit, match=rf"^error: .*{message}"):
        mgm.main(mgm.Args(out_dir=str(tmp_path), **(TINY | change)))


def test_tiny_build_reports_the_readmes_metrics(tmp_path, capsys):
    metrics = mgm.main(mgm.Args(out_dir=str(tmp_path), **TINY))
    assert "sft step 1/2 " in capsys.readouterr().out
    for key in ("success_rate", "mean_guesses", "valid_guess_share", "middle_share", "stopped_at_end"):
        assert f"sft_greedy_{key}" in metrics and f"sft_sampled_{key}" in metrics
    assert metrics["bisection_mean_guesses"] == 129 / 31
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (tmp_path / "guess-sft" / name).read_text() == open(os.path.join(SFT_DIR, name)).read(), name
