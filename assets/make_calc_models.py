"""Build the third embedded task: two-digit multiplication with a calculator tool, its problem files and its SFT policy.

The RL scripts can let the policy call tools: the policy writes a call, the tool's result is appended to the context as
tokens, and the policy goes on. This task is where RL visibly teaches a policy WHEN to call one. The policy is asked a
product of two two-digit numbers, which a model of 1.3M parameters cannot learn to work out in a few minutes on a CPU;
it can answer directly (mostly wrong) or call the calculator and copy its result (right):

    prompt     calculator:37*85\\nA:
    direct     3145<eos>
    with tool  <tool_call>{"name": "calculator", "arguments": {"expression": "37*85"}}</tool_call><eos>
               \\nR:3145\\nA:3145<eos>

where `\\nR:3145\\nA:` is the tool message, appended by the rollout and never trained on. The SFT policy calls in about
a quarter of its samples; RL has to raise that to nearly always for the accuracy to pass 0.9:

    python grpo_llm.py --model assets/calc-sft --dataset assets/calc/train.jsonl --tools calculator

Usage: python assets/make_calc_models.py --out-dir /tmp/calc   # writes /tmp/calc/calc/{train,test}.jsonl, calc-sft/
       python assets/make_calc_models.py --overwrite         # replaces the embedded assets/calc, assets/calc-sft

Design choices, each with its reason:
1. The arithmetic builder's character tokenizer, plus "\\n" (id 98) and two added tokens, `<tool_call>` (99) and
   `</tool_call>` (100), kept by decode (not special) as Qwen2.5's are: a call's JSON is characters, so copying the
   operands into it is a few easy steps of attention, and a parser finds the call in the decoded text.
2. The tokenizer carries its chat template (the prompt, assistant turns, tool calls and tool messages) and a
   transformers response template (`tokenizer.parse_response` reads a generated turn back into a message): the RL
   scripts render prompts and tool results and parse calls through them, as they do for a real chat model, and so
   does this builder, so a demonstration's tokens are exactly what a rollout produces.
3. The SFT loss is on the assistant's own tokens only (the call and its EOS, the answer and its EOS): the prompt and
   the tool's result are context, not something to imitate.
4. A fixed share of demonstrations (--call-share 0.3) calls the calculator whatever the problem; the others answer
   directly with the right product. The policy learns to call that often, to write a well-formed call and to copy the
   result, but not to multiply: its direct answers are mostly wrong. RL has to find that calling pays.
5. A product of 3 digits (18% of the problems) puts the answer one position earlier than one of 4, and is copied by
   other weights: with the tool-using problems drawn uniformly, an earlier build copied most 3-digit results wrong (its
   calls were right 68% of the time greedy, 87% sampled), so they are drawn from 3-digit products with
   --short-result-share (0.35: its calls are right 98-100% of the time).
6. Operands 10..99, so every prompt is 19 tokens; a tool-using response is 78 tokens and fits the 96-token budget saved
   in the policy's generation_config (the RL scripts read --max-new-tokens from it), and prompt and budget fit the
   128 positions.
7. Held-out problems (test.jsonl) are never trained on: neither in train.jsonl nor among the SFT demonstrations.
8. The model, the optimizer and the schedule are the arithmetic builder's (4 layers, width 160, dropouts 0), imported
   from it.
"""

import ast
import json
import operator
import os
import random
import sys
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import tyro
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

# the arithmetic builder beside this file, also when this one is imported from elsewhere (the tests)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_arith_models import eta, lr_at, make_policy  # noqa: E402


@dataclass
class Args:
    # experiment
    out_dir: str = os.path.dirname(os.path.abspath(__file__))
    """folder to write calc/ (train.jsonl, test.jsonl) and calc-sft/ into (default: assets/)"""
    overwrite: bool = False
    """replace calc/ and calc-sft/ when --out-dir already has them (assets/ has the embedded ones)"""
    seed: int = 1
    """seed of the demonstrations, the initialisation and the sampled evaluation"""
    threads: int = 1
    """torch CPU threads (the embedded policy was built with 1)"""

    # task
    call_share: float = 0.3
    """share of SFT demonstrations that call the calculator and copy its result; the others answer directly"""
    short_result_share: float = 0.35
    """share of the tool-using demonstrations whose product has 3 digits (18% of the problems; the rest have 4)"""

    # model
    n_embd: int = 160
    """width of the GPT-2 trunk"""
    n_layer: int = 4
    """number of transformer blocks"""
    n_head: int = 4
    """number of attention heads"""
    n_positions: int = 128
    """maximum sequence length: a prompt is 19 tokens, a response --eval-max-new-tokens (96) with the tool's tokens"""

    # SFT
    sft_steps: int = 800
    """SFT optimizer steps"""
    sft_batch_size: int = 64
    """demonstrations per SFT step"""
    sft_learning_rate: float = 3e-3
    """peak AdamW learning rate (linear warm-up, cosine decay)"""

    # evaluation
    log_every: int = 100
    """print the SFT loss and held-out greedy accuracy and call rate every this many steps"""
    eval_max_new_tokens: int = 96
    """budget of a whole response (its turns and the tool's tokens), saved as generation_config max_new_tokens"""


# ---- the task ----
MIN_OPERAND, MAX_OPERAND = 10, 99
TEST_SEED, TEST_SIZE = 2026, 256
PROMPT_TOKENS = 19  # calculator:37*85\nA:


def problem(a: int, b: int) -> dict:
    """A row of the problem files: the user's message `a*b` and the product."""
    return {"prompt": f"{a}*{b}", "answer": str(a * b)}


def problem_files() -> tuple[list[dict], list[dict]]:
    """The rows of calc/train.jsonl, every `a*b` that is not held out (a, then b, ascending), and calc/test.jsonl, the
    held-out set: the first TEST_SIZE distinct problems drawn with TEST_SEED."""
    rng, test, seen = random.Random(TEST_SEED), [], set()
    while len(test) < TEST_SIZE:
        row = problem(rng.randint(MIN_OPERAND, MAX_OPERAND), rng.randint(MIN_OPERAND, MAX_OPERAND))
        if row["prompt"] not in seen:
            seen.add(row["prompt"])
            test.append(row)
    operands = range(MIN_OPERAND, MAX_OPERAND + 1)
    train = [problem(a, b) for a in operands for b in operands]
    return [row for row in train if row["prompt"] not in seen], test


# ---- the tool ----
OPERATORS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}


def calculator(expression: str) -> str:
    """Evaluates an arithmetic expression of numbers, + - * / // % ** and parentheses.

    Args:
        expression: the expression, as 37*85
    """

    def value(node):
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
            left, right = value(node.left), value(node.right)
            # a sampled 9**99999999 would hang the build
            if isinstance(node.op, ast.Pow) and abs(right) > 64:
                raise ValueError("exponent too large")
            return OPERATORS[type(node.op)](left, right)
        raise ValueError(f"not an arithmetic expression: {expression}")

    try:
        return str(value(ast.parse(expression, mode="eval").body))
    except (SyntaxError, ValueError, ArithmeticError, TypeError) as error:
        return f"error: {error}"


TOOLS = [calculator]


# ---- tokenizer and templates ----
# the prompt is the tool names and the user's message; an assistant turn starts with '\nA:' and ends with '<eos>',
# a tool message is '\nR:' and its content
CHAT_TEMPLATE = (
    "{%- if tools %}{{ tools | map(attribute='function.name') | join(',') + ':' }}{% endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' %}{{ message.content }}"
    "{%- elif message.role == 'assistant' %}{{ '\\nA:' + (message.content or '') }}"
    "{%- for call in message.tool_calls or [] %}"
    "{{ '<tool_call>' + call.function | tojson + '</tool_call>' }}{% endfor %}"
    "{{ '<eos>' }}"
    "{%- elif message.role == 'tool' %}{{ '\\nR:' + message.content }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '\\nA:' }}{% endif %}"
)
# how tokenizer.parse_response reads a generated turn: its text is the content, each <tool_call>...</tool_call> a call;
# the role its message gets (as every TRL response template: TRL's tool loop reads it)
RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "\nA:",
    "fields": {
        "content": {},
        "tool_calls": {
            "open": "<tool_call>",
            "close": "</tool_call>",
            "content": "json",
            "repeats": True,
            "transform": {"type": "function", "function": "{content}"},
        },
    },
}


def make_tokenizer() -> PreTrainedTokenizerFast:
    """Character-level tokenizer: <pad>=0, <eos>=1, <unk>=2, printable ASCII 32..126 at 3..97, "\\n"=98, then the added
    tokens <tool_call>=99 and </tool_call>=100; no BOS on encode; the chat and response templates above."""
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2} | {chr(c): 3 + c - 32 for c in range(32, 127)} | {"\n": 98}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    # every character its own pre-token, the newline too ('.' does not match it), and decoding joins them back
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<eos>", unk_token="<unk>"
    )
    # not special, so decode keeps them and the parser can find the call (Qwen2.5's are the same)
    tool_tokens = [AddedToken(t, special=False, normalized=False) for t in ("<tool_call>", "</tool_call>")]
    tokenizer.add_tokens(tool_tokens)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.response_template = RESPONSE_TEMPLATE
    return tokenizer


def calculator_call(expression: str) -> dict:
    """An assistant message that calls the calculator on `expression`."""
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": expression}}}
    return {"role": "assistant", "content": "", "tool_calls": [call]}


def render(tokenizer, messages: list[dict], add_generation_prompt: bool) -> list[int]:
    """The token ids of a conversation rendered by the tokenizer's chat template, with the calculator as tool."""
    text = tokenizer.apply_chat_template(
        messages, tools=TOOLS, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def demonstration(tokenizer, row: dict, call: bool) -> tuple[list[int], list[bool]]:
    """The ids of one demonstration, the conversation the template renders, and the mask of the assistant's own tokens
    (the loss mask). With `call`: the user's problem, a call, the tool's result, the answer; else the problem and the
    answer. Each message's tokens are what the template adds to the conversation before it."""
    messages = [{"role": "user", "content": row["prompt"]}]
    if call:
        messages.append(calculator_call(row["prompt"]))
        messages.append({"role": "tool", "name": "calculator", "content": calculator(row["prompt"])})
    messages.append({"role": "assistant", "content": row["answer"]})
    ids, mask = [], []
    for k, message in enumerate(messages):
        # the generation prompt '\nA:' belongs to the message before an assistant turn, as in a rollout
        before_assistant = k + 1 < len(messages) and messages[k + 1]["role"] == "assistant"
        new = render(tokenizer, messages[: k + 1], add_generation_prompt=before_assistant)
        assert new[: len(ids)] == ids, "the template renders a conversation as the concatenation of its messages"
        mask += [message["role"] == "assistant"] * (len(new) - len(ids))
        ids = new
    return ids, mask


def tool_message_ids(tokenizer, result: str) -> list[int]:
    """The tokens the template adds after a call: the tool message with `result`, then the next turn's '\\nA:'."""
    messages = [{"role": "user", "content": ""}, calculator_call("")]
    before = render(tokenizer, messages, add_generation_prompt=False)
    tool = {"role": "tool", "name": "calculator", "content": result}
    after = render(tokenizer, messages + [tool], add_generation_prompt=True)
    return after[len(before) :]


def encode(tokenizer, demonstrations: list[tuple[list[int], list[bool]]]):
    """Right-padded ids, their attention mask, and the loss mask, of a batch of demonstrations."""
    width = max(len(ids) for ids, _ in demonstrations)
    input_ids = torch.full((len(demonstrations), width), tokenizer.pad_token_id, dtype=torch.long)
    loss_mask = torch.zeros((len(demonstrations), width), dtype=torch.bool)
    for i, (ids, mask) in enumerate(demonstrations):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        loss_mask[i, : len(ids)] = torch.tensor(mask)
    return input_ids, input_ids != tokenizer.pad_token_id, loss_mask


# ---- evaluation: generate, run the calls, generate again ----
def read_turn(tokenizer, context: list[int], turn: list[int], ended: bool) -> dict:
    """What a generated turn is: a well-formed call (one call to the calculator with a string `expression`, the turn
    ended with EOS), or an answer (its content); `tried` is whether it wrote <tool_call> at all."""
    tried = tokenizer.convert_tokens_to_ids("<tool_call>") in turn
    text = tokenizer.decode(turn, skip_special_tokens=True)
    try:
        message = tokenizer.parse_response(text, prefix=tokenizer.decode(context))
    except ValueError:  # a call whose JSON does not parse
        message = {}
    calls = message.get("tool_calls", [])
    # the parser takes any JSON between the tags: check that it is one call of the calculator with a string expression
    function = calls[0]["function"] if len(calls) == 1 else None
    arguments = function.get("arguments") if isinstance(function, dict) else None
    well_formed = (
        ended
        and isinstance(arguments, dict)
        and function.get("name") == "calculator"
        and list(arguments) == ["expression"]
        and isinstance(arguments["expression"], str)
    )
    expression = arguments["expression"] if well_formed else None
    return {"tried": tried, "expression": expression, "content": message.get("content", "")}


def generate_turns(model, tokenizer, contexts: list[list[int]], max_new_tokens: int, sampling: dict):
    """One turn after each context (left padding): its tokens up to and with the first EOS, or all max_new_tokens of
    them, and whether it ended with EOS."""
    batch = tokenizer.pad({"input_ids": contexts}, return_tensors="pt", padding_side="left")
    out = model.generate(**batch, **sampling, max_new_tokens=max_new_tokens)
    turns = []
    for response in out[:, batch["input_ids"].shape[1] :].tolist():  # (B, <=max_new_tokens)
        ended = tokenizer.eos_token_id in response
        if ended:
            response = response[: response.index(tokenizer.eos_token_id) + 1]
        turns.append((response, ended))
    return turns


@torch.no_grad()
def policy_metrics(model, tokenizer, rows: list[dict], do_sample: bool, max_new_tokens: int) -> dict:
    """Held-out metrics of the policy with a tool loop: generate a turn (left padding); where it is a well-formed
    calculator call, append the tool message's tokens and generate the next turn, until no turn calls or the response
    (turns and tool tokens) has used `max_new_tokens`. A response is right when its last turn ended with EOS and its
    content is the product. Reports the accuracy, the share of responses whose first turn calls (`call_rate`), the
    share of those calls that are well-formed, and the accuracy of the responses that call and of those that do not."""
    contexts = [render(tokenizer, [{"role": "user", "content": r["prompt"]}], add_generation_prompt=True) for r in rows]
    response_lengths = [0] * len(rows)
    first_turns, last_turns = [None] * len(rows), [None] * len(rows)
    active = list(range(len(rows)))
    # pure sampling from the model's distribution: temperature 1, no top-k, no nucleus
    sampling = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0) if do_sample else dict(do_sample=False)
    while active:
        # one generate per remaining budget, so that no response runs past its own (nor a context past 128 positions)
        still_active = []
        for budget in sorted({max_new_tokens - response_lengths[i] for i in active}, reverse=True):
            group = [i for i in active if max_new_tokens - response_lengths[i] == budget]
            turns = generate_turns(model, tokenizer, [contexts[i] for i in group], budget, sampling)
            for i, (turn, ended) in zip(group, turns):
                read = read_turn(tokenizer, contexts[i], turn, ended)
                first_turns[i] = first_turns[i] or read
                last_turns[i] = read | {"ended": ended}
                contexts[i] = contexts[i] + turn
                response_lengths[i] += len(turn)
                if read["expression"] is None:
                    continue
                result = tool_message_ids(tokenizer, calculator(read["expression"]))
                # the tool's tokens count in the response's budget, and the next turn needs one token at least
                if response_lengths[i] + len(result) < max_new_tokens:
                    contexts[i] = contexts[i] + result
                    response_lengths[i] += len(result)
                    still_active.append(i)
        active = still_active
    right = [
        t["ended"] and t["expression"] is None and t["content"].strip() == r["answer"] for t, r in zip(last_turns, rows)
    ]
    called = [t["tried"] for t in first_turns]
    well_formed = [t["expression"] is not None for t, c in zip(first_turns, called) if c]
    right_calling = [ok for ok, c in zip(right, called) if c]
    right_direct = [ok for ok, c in zip(right, called) if not c]
    return {
        "accuracy": sum(right) / len(rows),
        "call_rate": sum(called) / len(rows),
        "well_formed_call_rate": sum(well_formed) / len(well_formed) if well_formed else None,
        "accuracy_calling": sum(right_calling) / len(right_calling) if right_calling else None,
        "accuracy_direct": sum(right_direct) / len(right_direct) if right_direct else None,
        "mean_response_length": sum(response_lengths) / len(rows),
    }


# ---- SFT ----
def cross_entropy_sum(model, tokenizer, demonstrations: list[tuple[list[int], list[bool]]]) -> torch.Tensor:
    """The summed next-token cross-entropy of the assistant's tokens of a batch of demonstrations."""
    input_ids, attention_mask, loss_mask = encode(tokenizer, demonstrations)
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1]  # (B, T-1, V)
    targets = input_ids[:, 1:].masked_fill(~loss_mask[:, 1:], -100)  # the assistant's own tokens only
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum")


def train_sft(args: Args, tokenizer, train: list[dict], test: list[dict]):
    """Next-token cross-entropy on the assistant's tokens of demonstrations, --call-share of which call the tool."""
    model = make_policy(args, tokenizer)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.sft_learning_rate, betas=(0.9, 0.98), weight_decay=0.1)
    rng = random.Random(args.seed + 1)
    by_digits = {n: [row for row in train if len(row["answer"]) == n] for n in (3, 4)}
    model.train()
    start = time.time()
    for step in range(args.sft_steps):
        calls = [rng.random() < args.call_share for _ in range(args.sft_batch_size)]
        # a 3-digit result sits one position earlier than a 4-digit one: copying it is learned only if shown often
        pools = [train] * len(calls)
        for i, call in enumerate(calls):
            if call:
                pools[i] = by_digits[3] if rng.random() < args.short_result_share else by_digits[4]
        rows = [rng.choice(pool) for pool in pools]
        demonstrations = [demonstration(tokenizer, row, call) for row, call in zip(rows, calls)]
        # a tool-using demonstration is 4 times as long as a direct one: padding each kind only to its own length
        # halves the step's time; the loss is the mean over all the batch's assistant tokens either way
        n_targets = sum(sum(mask) for _, mask in demonstrations)
        loss = 0.0
        for kind in (True, False):
            same_kind = [d for d, call in zip(demonstrations, calls) if call == kind]
            if same_kind:
                loss = loss + cross_entropy_sum(model, tokenizer, same_kind) / n_targets
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, args.sft_steps, args.sft_learning_rate)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step % args.log_every == 0 or step == args.sft_steps - 1:
            # greedy metrics on the held-out set, for monitoring only (they never feed back into training)
            model.eval()
            greedy = policy_metrics(model, tokenizer, test, False, args.eval_max_new_tokens)
            model.train()
            print(
                f"sft step {step + 1}/{args.sft_steps}  loss {loss.item():.4f}  "
                f"greedy acc {greedy['accuracy']:.3f}  calls {greedy['call_rate']:.3f}  "
                f"{time.time() - start:6.1f}s  ETA {eta(start, step + 1, args.sft_steps)}",
                flush=True,
            )
    model.eval()
    return model


def main(args: Args) -> dict:
    """Write the problem files, build, evaluate and save the SFT policy; returns the measured held-out metrics."""
    if not 0 <= args.call_share <= 1:
        raise SystemExit(f"error: --call-share must be in [0, 1] (got {args.call_share})")
    if not 0 <= args.short_result_share <= 1:
        raise SystemExit(f"error: --short-result-share must be in [0, 1] (got {args.short_result_share})")
    if PROMPT_TOKENS + args.eval_max_new_tokens > args.n_positions:
        raise SystemExit(
            f"error: a prompt ({PROMPT_TOKENS} tokens) and --eval-max-new-tokens {args.eval_max_new_tokens} do not fit "
            f"--n-positions {args.n_positions}"
        )
    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    start = time.time()
    data_dir, sft_dir = os.path.join(args.out_dir, "calc"), os.path.join(args.out_dir, "calc-sft")
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
    metrics |= {
        "policy_parameters": sum(p.numel() for p in policy.parameters()),
        "train_rows": len(train),
        "test_rows": len(test),
        "seconds": time.time() - start,
    }
    print(f"held-out ({len(test)} problems):")
    for key, value in metrics.items():
        print(f"  {key:36s} {value:.3f}" if isinstance(value, float) else f"  {key:36s} {value}")
    return metrics


if __name__ == "__main__":
    main(tyro.cli(Args))
