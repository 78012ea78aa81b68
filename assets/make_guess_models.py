"""Build the fourth embedded task: a guessing game in a stateful environment, its game files and its SFT policy.

The environment (assets/guess.py, GuessingGame) hides a number from 1 to 31, taken from the row's `secret` column; the
policy calls guess(n) up to 8 times and reads "higher", "lower" or "correct" after each call. The prompt is the same for
every game, so only the answers to earlier guesses, the environment's state, tell the policy where the number is:

    prompt     guess:1-31\\nA:
    response   <tool_call>guess(n=16)<eos>\\nR:lower\\nA:<tool_call>guess(n=8)<eos>\\nR:correct\\nA:<eos>

where `\\nR:lower\\nA:` is a tool message, appended by the rollout and never trained on. The SFT policy plays validly
(well-formed calls, guesses that the answers so far allow, a stop after "correct") but far from bisection, the optimum;
RL has to find that the middle of the candidates pays:

    python grpo_llm.py --model assets/guess-sft --dataset assets/guess/train.jsonl \\
        --environment assets/guess.py:GuessingGame

Usage: python assets/make_guess_models.py --out-dir /tmp/guess   # writes /tmp/guess/guess/*.jsonl, /tmp/guess/guess-sft
       python assets/make_guess_models.py --overwrite          # replaces the embedded assets/guess, assets/guess-sft

Design choices, each with its reason:
1. The calculator builder's tokenizer (characters, "\\n", <tool_call>), plus four word tokens kept by decode, `guess`,
   `higher`, `lower`, `correct` (ids 101-104), and a compact call, `<tool_call>guess(n=16)<eos>`: 9 tokens a guess
   where calc's JSON call is 63. The tokenizer is character-level, so each generated token is a step of generation.
2. The chat template renders a call as `<tool_call>NAME(KEY=VALUE,...)` and the response template reads it back (the
   name from the opening, the arguments as `key=value` pairs whose values are read as JSON, so 16 is the int 16): any
   tool of scalar arguments round-trips, not only guess. The RL scripts, TRL and this builder render prompts and tool
   messages and parse calls through them, so a demonstration's tokens are exactly what a rollout produces.
3. The SFT demonstrations are games played by a cautious player: each guess is the middle of the candidates
   (--mid-share 0.4) or else the lowest candidate (--low-share 0.6: counting up), so every guess is one the answers
   allow, and the player stops after "correct" or after the 8th guess. The policy learns to play validly and to find
   the middle, but mostly counts up: greedy decoding counts up from 1, sampling mixes the two. (A share of guesses
   drawn uniformly from the candidates, left to --mid-share + --low-share < 1, made an earlier build's sampled guesses
   valid only 92.5% of the time: the bounds of a uniform draw are harder to learn than two points.)
4. The SFT loss is on the assistant's tokens only (the calls and their EOS, the final EOS): the prompt and the answers
   are context, not something to imitate.
5. The game files give every hidden number equally often, so bisection's expected number of guesses on them is exactly
   129 / 31 = 4.16; a `game` column numbers the rows, and the held-out games (test.jsonl) are never trained on,
   neither in train.jsonl nor among the SFT demonstrations. The policy never sees the column: nothing of a game is in
   its prompt.
6. A whole episode of 8 two-digit guesses is 8 * (9 + 7) + 1 = 129 tokens (each guess, its tool message, the final
   EOS), the max_new_tokens saved in the policy's generation_config. TRL generates each turn with that whole budget
   and cuts it afterwards, and every row of a batch takes a position a step until the last row ends its turn: so 272
   positions, for the 9-token prompt and twice the budget (with 144, TRL's GRPOTrainer went past the position table
   after 16 updates).
7. Width 128 with 4 heads: a head of 32, which vLLM's CPU attention serves (the other embedded policies' 40 is not).
   The optimizer and the schedule are the arithmetic builder's, imported from it.
"""

import functools
import json
import os
import random
import sys
import time
from dataclasses import dataclass

import torch
import tyro
from tokenizers import AddedToken

# the other builders and the environment beside this file, also when this one is imported from elsewhere (the tests)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from guess import GuessingGame  # noqa: E402
from make_arith_models import eta, lr_at, make_policy  # noqa: E402
from make_calc_models import cross_entropy_sum, generate_turns  # noqa: E402
from make_calc_models import make_tokenizer as make_calc_tokenizer  # noqa: E402


@dataclass
class Args:
    # experiment
    out_dir: str = os.path.dirname(os.path.abspath(__file__))
    """folder to write guess/ (train.jsonl, test.jsonl) and guess-sft/ into (default: assets/)"""
    overwrite: bool = False
    """replace guess/ and guess-sft/ when --out-dir already has them (assets/ has the embedded ones)"""
    seed: int = 1
    """seed of the demonstrations, the initialisation and the sampled evaluation"""
    threads: int = 1
    """torch CPU threads (the embedded policy was built with 1)"""

    # task
    mid_share: float = 0.4
    """share of the demonstrations' guesses that are the middle of the candidates, (low + high) // 2"""
    low_share: float = 0.6
    """share of the demonstrations' guesses that are the lowest candidate; the rest (none by default) any, uniformly"""

    # model
    n_embd: int = 128
    """width of the GPT-2 trunk"""
    n_layer: int = 4
    """number of transformer blocks"""
    n_head: int = 4
    """number of attention heads (a head of 32: vLLM's CPU attention serves 32, 64, 80, ...)"""
    n_positions: int = 272
    """maximum sequence length: a prompt (9 tokens) and twice --eval-max-new-tokens (TRL's turns, see the docstring)"""

    # SFT
    sft_steps: int = 800
    """SFT optimizer steps"""
    sft_batch_size: int = 64
    """demonstrations per SFT step"""
    sft_learning_rate: float = 3e-3
    """peak AdamW learning rate (linear warm-up, cosine decay)"""

    # evaluation
    log_every: int = 100
    """print the SFT loss and the held-out greedy success rate and mean guesses every this many steps"""
    eval_max_new_tokens: int = 129
    """budget of a whole episode (its turns and the tool messages), saved as generation_config max_new_tokens"""


# ---- the games ----
N, MAX_GUESSES = GuessingGame.N, GuessingGame.MAX_GUESSES
PROMPT = [{"role": "user", "content": f"1-{N}"}]  # the same for every game: the number is in no prompt
PROMPT_TOKENS = 9  # guess:1-31\nA:
TRAIN_PER_SECRET, TEST_PER_SECRET, DATA_SEED = 100, 8, 2026


def problem_files() -> tuple[list[dict], list[dict]]:
    """The rows of guess/train.jsonl (each hidden number TRAIN_PER_SECRET times) and guess/test.jsonl (each
    TEST_PER_SECRET times), shuffled with DATA_SEED: the conversational prompt, the `secret` and the `game`'s number,
    training's games first."""
    rng = random.Random(DATA_SEED)
    files = []
    for per_secret in (TRAIN_PER_SECRET, TEST_PER_SECRET):
        secrets = [secret for secret in range(1, N + 1) for _ in range(per_secret)]
        rng.shuffle(secrets)
        files.append(secrets)
    train, test = files
    rows = [{"prompt": PROMPT, "secret": secret, "game": i} for i, secret in enumerate(train + test)]
    return rows[: len(train)], rows[len(train) :]


def bisection(secret: int) -> list[int]:
    """The guesses of bisection, the optimal strategy: the middle of the candidates, (low + high) // 2, to the end."""
    low, high, guesses = 1, N, []
    while not guesses or guesses[-1] != secret:
        guesses.append((low + high) // 2)
        if guesses[-1] < secret:
            low = guesses[-1] + 1
        elif guesses[-1] > secret:
            high = guesses[-1] - 1
    return guesses


def player_guess(low: int, high: int, rng: random.Random, args: Args) -> int:
    """The demonstrations' cautious player: the middle of the candidates low..high with --mid-share, the lowest with
    --low-share, else any of them."""
    u = rng.random()
    if u < args.mid_share:
        return (low + high) // 2
    if u < args.mid_share + args.low_share:
        return low
    return rng.randint(low, high)


# ---- tokenizer and templates ----
# as calc's: the tool names and ':', the user's message, each assistant turn as '\nA:' + content + calls + '<eos>', each
# tool message as '\nR:' + its content; a call is <tool_call>NAME(KEY=VALUE,...)
CHAT_TEMPLATE = (
    "{%- if tools %}{{ tools | map(attribute='function.name') | join(',') + ':' }}{% endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' %}{{ message.content }}"
    "{%- elif message.role == 'assistant' %}{{ '\\nA:' + (message.content or '') }}"
    "{%- for call in message.tool_calls or [] %}{{ '<tool_call>' + call.function.name + '(' }}"
    "{%- for key, value in (call.function.arguments or {}).items() %}"
    "{{ key + '=' + value | string }}{% if not loop.last %},{% endif %}{% endfor %}{{ ')' }}{% endfor %}"
    "{{ '<eos>' }}"
    "{%- elif message.role == 'tool' %}{{ '\\nR:' + message.content }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '\\nA:' }}{% endif %}"
)
# how tokenizer.parse_response reads a turn back: each <tool_call>NAME(...) a call, its key=value pairs the arguments,
# each value read as JSON where it is JSON (16 is the int 16), else kept as text; the rest of the turn is the content;
# the role from its defaults, as every TRL response template has (TRL's tool loop reads it)
RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "\nA:",
    "fields": {
        "content": {},
        "tool_calls": {
            "open_pattern": r"<tool_call>(?P<name>[A-Za-z_][A-Za-z0-9_]*)\(",
            "close": ")",
            "content": "kv-lines",
            "content_args": {
                "line_sep": ",",
                "kv_sep": "=",
                "value_parser": {"name": "json", "args": {"allow_non_json": True}},
            },
            "repeats": True,
            "transform": {"type": "function", "function": {"name": "{name}", "arguments": "{content}"}},
        },
    },
}
WORDS = ("guess", "higher", "lower", "correct")


def make_tokenizer():
    """The calculator's tokenizer (<pad>=0, <eos>=1, <unk>=2, printable ASCII at 3..97, "\\n"=98, <tool_call>=99,
    </tool_call>=100), then the word tokens guess=101, higher=102, lower=103, correct=104, not special (decode keeps
    them); the chat and response templates above."""
    tokenizer = make_calc_tokenizer()
    tokenizer.add_tokens([AddedToken(word, special=False, normalized=False) for word in WORDS])
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.response_template = RESPONSE_TEMPLATE
    return tokenizer


def guess_call(n: int) -> dict:
    """An assistant message that calls guess(n)."""
    call = {"type": "function", "function": {"name": "guess", "arguments": {"n": n}}}
    return {"role": "assistant", "content": "", "tool_calls": [call]}


def render(tokenizer, messages: list[dict], add_generation_prompt: bool) -> list[int]:
    """The token ids of a conversation rendered by the tokenizer's chat template, with guess as tool."""
    text = tokenizer.apply_chat_template(
        messages, tools=[GuessingGame().guess], tokenize=False, add_generation_prompt=add_generation_prompt
    )
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@functools.cache
def pieces(tokenizer) -> dict:
    """The ids that the template adds for each part of a game, so that a demonstration is their concatenation: the
    prompt with its generation prompt; each guess's call and EOS; each answer's tool message with the next turn's
    '\\nA:'; the final turn, an EOS."""
    before = render(tokenizer, PROMPT, add_generation_prompt=True)
    calls = {}
    for n in range(1, N + 1):
        after = render(tokenizer, PROMPT + [guess_call(n)], add_generation_prompt=False)
        calls[n] = after[len(before) :]
    return {
        "prompt": before,
        "calls": calls,
        "answers": {answer: tool_message_ids(tokenizer, (answer,)) for answer in ("higher", "lower", "correct")},
        "stop": render(tokenizer, PROMPT + [{"role": "assistant", "content": ""}], False)[len(before) :],
    }


@functools.cache
def tool_message_ids(tokenizer, results: tuple[str, ...]) -> list[int]:
    """The tokens the template adds after a turn's calls (TRL's _get_tool_suffix_ids): a tool message for each result,
    then the next turn's '\\nA:'."""
    messages = PROMPT + [guess_call(1)]
    before = render(tokenizer, messages, add_generation_prompt=False)
    tools = [{"role": "tool", "name": "guess", "content": result} for result in results]
    after = render(tokenizer, messages + tools, add_generation_prompt=True)
    return after[len(before) :]


def demonstration(tokenizer, secret: int, rng: random.Random, args: Args) -> tuple[list[int], list[bool]]:
    """The ids of one game of the cautious player against `secret`, through the environment, and the mask of the
    assistant's own tokens (the loss mask): the calls and their EOS, and the final EOS, after "correct" or the 8th
    guess."""
    parts = pieces(tokenizer)
    game = GuessingGame()
    game.reset(secret=secret)
    ids, mask = list(parts["prompt"]), [False] * len(parts["prompt"])
    while not game.solved and game.guesses < MAX_GUESSES:
        n = player_guess(game.low, game.high, rng, args)
        answer = game.guess(n)
        ids += parts["calls"][n] + parts["answers"][answer]
        mask += [True] * len(parts["calls"][n]) + [False] * len(parts["answers"][answer])
    return ids + parts["stop"], mask + [True] * len(parts["stop"])


# ---- evaluation: generate a turn, run its calls in the environment, generate the next ----
def read_turn(tokenizer, context: list[int], turn: list[int], game: GuessingGame) -> dict:
    """A generated turn's calls, parsed as TRL does (parse_response with the tools' schemas; a turn that does not
    parse calls nothing), `tried`: whether it wrote <tool_call> at all, and `guess`: its n where the turn is one
    well-formed call, guess with a whole number n and nothing else, else None."""
    text, prefix = tokenizer.decode(turn), tokenizer.decode(context)
    try:
        calls = tokenizer.parse_response(text, prefix=prefix, tools=[game.guess]).get("tool_calls") or []
    except ValueError:  # a call the parser cannot read: TRL ends the episode there, as on a turn without calls
        calls = []
    n = None
    if len(calls) == 1 and calls[0]["function"]["name"] == "guess":
        arguments = calls[0]["function"].get("arguments")
        if isinstance(arguments, dict) and list(arguments) == ["n"] and type(arguments["n"]) is int:
            n = arguments["n"]
    return {"calls": calls, "tried": tokenizer.convert_tokens_to_ids("<tool_call>") in turn, "guess": n}


def run_calls(game: GuessingGame, calls: list[dict]) -> tuple[str, ...]:
    """Each call's result as TRL's tool loop makes it: the method's str, or {'error': ...} where it raises."""
    results = []
    for call in calls:
        function = call.get("function", {})
        try:
            if function.get("name") != "guess":
                raise ValueError(f"Tool {function.get('name')} not found.")
            results.append(str(game.guess(**function.get("arguments", {}))))
        except Exception as error:  # what TRL passes on, for the policy to read
            results.append(str({"error": str(error)}))
    return tuple(results)


@torch.no_grad()
def policy_metrics(model, tokenizer, rows: list[dict], do_sample: bool, max_new_tokens: int) -> dict:
    """Held-out metrics of the policy playing each row's game (a fresh GuessingGame, reset with the row): generate a
    turn (left padding); where it calls, run the calls in the game, append the tool messages' tokens and generate the
    next turn, until a turn calls nothing or the episode (turns and tool messages) has used `max_new_tokens`.

    Reports the success rate, the mean number of guesses (calls of guess, 8 for a lost game) and of a won game, the
    mean total reward get_reward(), the share of valid guesses (well-formed calls of guess whose n the answers so far
    allow, before the game's end) among all the turns that write a call, and the shares of those turns that guess the
    middle of the candidates and the lowest candidate (both, where two or fewer are left), the share of episodes that
    stop right at the game's end (after "correct" or the 8th guess, with no call after it), and the mean episode length
    in tokens."""
    games = [GuessingGame() for _ in rows]
    for game, row in zip(games, rows):
        game.reset(**row)
    contexts = [render(tokenizer, row["prompt"], add_generation_prompt=True) for row in rows]
    lengths, stopped_at_end, called_after_end = [0] * len(rows), [False] * len(rows), [False] * len(rows)
    attempts = valid = middle = lowest = 0
    # pure sampling from the model's distribution: temperature 1, no top-k, no nucleus
    sampling = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0) if do_sample else dict(do_sample=False)
    active = list(range(len(rows)))
    while active:
        # one generate per remaining budget, so that no episode runs past its own (nor a context past n_positions)
        still_active = []
        for room in sorted({max_new_tokens - lengths[i] for i in active}, reverse=True):
            group = [i for i in active if max_new_tokens - lengths[i] == room]
            turns = generate_turns(model, tokenizer, [contexts[i] for i in group], room, sampling)
            for i, (turn, ended) in zip(group, turns):
                game = games[i]
                read = read_turn(tokenizer, contexts[i], turn, game)
                contexts[i] = contexts[i] + turn
                lengths[i] += len(turn)
                if not ended:  # a call cut off by the budget is not a valid guess
                    read["guess"] = None
                attempts += read["tried"]
                if read["guess"] is not None and not game.solved and game.guesses < MAX_GUESSES:
                    valid += game.low <= read["guess"] <= game.high
                    middle += read["guess"] == (game.low + game.high) // 2
                    lowest += read["guess"] == game.low
                if not ended:  # cut off by the budget
                    continue
                if not read["calls"]:  # the policy's stop
                    at_end = game.solved or game.guesses == MAX_GUESSES
                    stopped_at_end[i] = not read["tried"] and at_end and not called_after_end[i]
                    continue
                results = run_calls(game, read["calls"])
                called_after_end[i] |= "over" in results  # the game's answer to a call after its end
                result = tool_message_ids(tokenizer, results)
                # the tool's tokens count in the episode's budget, and the next turn needs one token at least
                if lengths[i] + len(result) < max_new_tokens:
                    contexts[i] = contexts[i] + result
                    lengths[i] += len(result)
                    still_active.append(i)
        active = still_active
    solved = [game.solved for game in games]
    won_guesses = [game.guesses for game in games if game.solved]
    guesses = sum(game.guesses for game in games)
    return {
        "success_rate": sum(solved) / len(rows),
        "mean_guesses": guesses / len(rows),
        "mean_guesses_won": sum(won_guesses) / len(won_guesses) if won_guesses else None,
        "mean_reward": sum(game.get_reward() for game in games) / len(rows),
        "valid_guess_share": valid / attempts if attempts else None,
        "middle_share": middle / attempts if attempts else None,
        "lowest_share": lowest / attempts if attempts else None,
        "stopped_at_end": sum(stopped_at_end) / len(rows),
        "mean_episode_length": sum(lengths) / len(rows),
    }


# ---- SFT ----
def train_sft(args: Args, tokenizer, train: list[dict], test: list[dict]):
    """Next-token cross-entropy on the assistant's tokens of the cautious player's games against training's hidden
    numbers."""
    model = make_policy(args, tokenizer)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.sft_learning_rate, betas=(0.9, 0.98), weight_decay=0.1)
    rng = random.Random(args.seed + 1)
    model.train()
    start = time.time()
    for step in range(args.sft_steps):
        rows = [rng.choice(train) for _ in range(args.sft_batch_size)]
        demonstrations = [demonstration(tokenizer, row["secret"], rng, args) for row in rows]
        # a game's length ranges over 1 to 8 guesses: the short half padded only to its own length saves a third of
        # the step's time; the loss is the mean over all the batch's assistant tokens either way
        demonstrations.sort(key=lambda d: len(d[0]))
        half = len(demonstrations) // 2
        n_targets = sum(sum(mask) for _, mask in demonstrations)
        loss = 0.0
        for part in (demonstrations[:half], demonstrations[half:]):
            if part:
                loss = loss + cross_entropy_sum(model, tokenizer, part) / n_targets
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, args.sft_steps, args.sft_learning_rate)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step % args.log_every == 0 or step == args.sft_steps - 1:
            # greedy metrics on the held-out games, for monitoring only (they never feed back into training)
            model.eval()
            greedy = policy_metrics(model, tokenizer, test, False, args.eval_max_new_tokens)
            model.train()
            print(
                f"sft step {step + 1}/{args.sft_steps}  loss {loss.item():.4f}  "
                f"greedy success {greedy['success_rate']:.3f}  guesses {greedy['mean_guesses']:.2f}  "
                f"valid {greedy['valid_guess_share'] or 0:.3f}  "
                f"{time.time() - start:6.1f}s  ETA {eta(start, step + 1, args.sft_steps)}",
                flush=True,
            )
    model.eval()
    return model


def main(args: Args) -> dict:
    """Write the game files, build, evaluate and save the SFT policy; returns the measured held-out metrics."""
    for name in ("mid_share", "low_share"):
        if not 0 <= getattr(args, name) <= 1:
            raise SystemExit(f"error: --{name.replace('_', '-')} must be in [0, 1] (got {getattr(args, name)})")
    if args.mid_share + args.low_share > 1:
        raise SystemExit(f"error: --mid-share + --low-share must be at most 1 (got {args.mid_share + args.low_share})")
    if PROMPT_TOKENS + 2 * args.eval_max_new_tokens > args.n_positions:
        raise SystemExit(
            f"error: a prompt ({PROMPT_TOKENS} tokens) and twice --eval-max-new-tokens {args.eval_max_new_tokens} (an "
            f"episode, then a turn of the whole budget, as TRL makes it) do not fit --n-positions {args.n_positions}"
        )
    if args.n_embd % args.n_head:
        raise SystemExit(f"error: --n-head {args.n_head} must divide --n-embd {args.n_embd}")
    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    start = time.time()
    data_dir, sft_dir = os.path.join(args.out_dir, "guess"), os.path.join(args.out_dir, "guess-sft")
    existing = [path for path in (data_dir, sft_dir) if os.path.exists(path)]
    if existing and not args.overwrite:
        raise SystemExit(f"error: {existing[0]} exists: pass --overwrite to replace it, or another --out-dir")

    train, test = problem_files()
    os.makedirs(data_dir, exist_ok=True)
    for name, rows in [("train.jsonl", train), ("test.jsonl", test)]:
        with open(os.path.join(data_dir, name), "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)

    tokenizer = make_tokenizer()
    policy = train_sft(args, tokenizer, train, test)
    policy.save_pretrained(sft_dir)
    # a fresh tokenizer is saved: padding calls leave their settings behind in the backend tokenizer
    make_tokenizer().save_pretrained(sft_dir)
    greedy = policy_metrics(policy, tokenizer, test, False, args.eval_max_new_tokens)
    torch.manual_seed(args.seed)
    sampled = policy_metrics(policy, tokenizer, test, True, args.eval_max_new_tokens)
    metrics = {f"sft_greedy_{key}": value for key, value in greedy.items()}
    metrics |= {f"sft_sampled_{key}": value for key, value in sampled.items()}
    bisection_guesses = sum(len(bisection(row["secret"])) for row in test) / len(test)
    metrics |= {
        "bisection_mean_guesses": bisection_guesses,
        "bisection_mean_reward": 1 - GuessingGame.COST * bisection_guesses,
        "policy_parameters": sum(p.numel() for p in policy.parameters()),
        "train_rows": len(train),
        "test_rows": len(test),
        "seconds": time.time() - start,
    }
    print(f"held-out ({len(test)} games):")
    for key, value in metrics.items():
        print(f"  {key:36s} {value:.3f}" if isinstance(value, float) else f"  {key:36s} {value}")
    return metrics


if __name__ == "__main__":
    main(tyro.cli(Args))
