"""Build the second embedded task: running sums written out step by step, its problem files and its SFT policy.

The arithmetic task (make_arith_models.py) answers in ~3.5 tokens, so all completions of a prompt are about as long,
and the GRPO variants, which differ in how they weigh the tokens of completions of different lengths (Dr. GRPO, DAPO),
cannot be told apart on it. Here the policy writes its working, a running total, before the answer:

    prompt   3+5+7+2=
    answer   3+5=8 8+7=15 15+2=17 #### 17<eos>

so a completion's length grows with the problem (13 to 55 tokens when right), and a wrong step makes the answer wrong.
The problems ship the way a user's own would, as GSM8K-style files (`question`, `answer` ending in `#### N`), and the RL
scripts train on them through the general path, scored by their `gsm8k` reward function (the number after `####`):

    python grpo_llm.py --model assets/sums-sft --dataset assets/sums/train.jsonl --prompt-column question \\
        --reward-fn gsm8k --eval-split assets/sums/test.jsonl

Usage: python assets/make_sums_models.py --out-dir /tmp/sums   # writes /tmp/sums/sums/{train,test}.jsonl, sums-sft/
       python assets/make_sums_models.py --overwrite         # replaces the embedded assets/sums, assets/sums-sft

Design choices, each with its reason:
1. 2 to 7 numbers of 1..9: the sums stay under 64, so each step is an easy addition that a small model learns in a
   few minutes on a CPU, and the trace's length comes from the number of steps (1 to 6). Two-digit numbers (sums up
   to ~500) were measured to need far more: 3% greedy accuracy after 500 steps.
2. The demonstrators are noisy per step (--step-noise 0.2): a step is a slip (a plausible mistake in the sum, one of
   the arithmetic task's near misses, carried on by the later steps), a skipped number (one step shorter) or a number
   added twice (one step longer). Longer problems are wrong more often, and a prompt's completions differ in length,
   wrong ones both shorter and longer than the right one: the length effects GRPO's normalisers act on.
3. The SFT policy is trained briefly (--sft-steps): its greedy answer is mostly right, its samples at temperature 1
   make the demonstrators' mistakes and some of their own, which is the room RL has.
4. Numbers are at least 1, so a skipped or repeated number always changes the answer.
5. A demonstration and its EOS fit in the 64-token budget saved in the policy's generation_config (the RL scripts read
   --max-new-tokens from it); the 1% that would not are drawn again. A sampled completion can still run past it.
6. Held-out problems (test.jsonl) are never trained on: neither in train.jsonl nor among the SFT demonstrations.
7. The tokenizer, the model, the loss (on the answer and EOS only) and the schedule are the arithmetic builder's,
   imported from it.
"""

import json
import os
import random
import re
import sys
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import tyro

# the arithmetic builder beside this file, also when this one is imported from elsewhere (the tests)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_arith_models import encode, eta, lr_at, make_policy, make_tokenizer, near_miss  # noqa: E402


@dataclass
class Args:
    # experiment
    out_dir: str = os.path.dirname(os.path.abspath(__file__))
    """folder to write sums/ (train.jsonl, test.jsonl) and sums-sft/ into (default: assets/)"""
    overwrite: bool = False
    """replace sums/ and sums-sft/ when --out-dir already has them (assets/ has the embedded ones)"""
    seed: int = 1
    """seed of the problems, the noise, the initialisation and the sampled evaluation"""
    threads: int = 1
    """torch CPU threads (on a shared 2-core machine 1 thread was faster than 2)"""

    # task
    train_size: int = 4000
    """rows of sums/train.jsonl, the RL prompts"""
    test_size: int = 256
    """rows of sums/test.jsonl, the held-out problems (the RL scripts evaluate --eval-size 256 of them)"""
    step_noise: float = 0.2
    """probability that a demonstration's step is a mistake (a slip, a skipped number or a number added twice)"""

    # model
    n_embd: int = 160
    """width of the GPT-2 trunk"""
    n_layer: int = 4
    """number of transformer blocks"""
    n_head: int = 4
    """number of attention heads"""
    n_positions: int = 96
    """maximum sequence length: a prompt is at most 14 tokens, a completion --eval-max-new-tokens (64)"""

    # SFT
    sft_steps: int = 800
    """SFT optimizer steps"""
    sft_batch_size: int = 64
    """demonstrations per SFT step"""
    sft_learning_rate: float = 3e-3
    """peak AdamW learning rate (linear warm-up, cosine decay)"""

    # evaluation
    log_every: int = 100
    """print the SFT loss and held-out greedy accuracy every this many steps"""
    eval_max_new_tokens: int = 64
    """generation budget of the evaluation, saved as the policy's generation_config max_new_tokens"""


# ---- the task ----
MIN_TERMS, MAX_TERMS, MAX_NUMBER = 2, 7, 9
TEST_SEED = 2025
LONGEST_RIGHT_TRACE = 55  # tokens with the EOS: 9+9=18 18+9=27 27+9=36 36+9=45 45+9=54 54+9=63 #### 63<eos>


def sums_problem(rng: random.Random) -> list[int]:
    """The numbers of one problem: MIN_TERMS to MAX_TERMS of them, each uniform in 1..MAX_NUMBER."""
    return [rng.randint(1, MAX_NUMBER) for _ in range(rng.randint(MIN_TERMS, MAX_TERMS))]


def question(numbers: list[int]) -> str:
    """The prompt: the numbers joined by '+', then '='."""
    return "+".join(map(str, numbers)) + "="


def trace(numbers: list[int], step_noise: float = 0.0, rng: random.Random | None = None) -> str:
    """The running total `a+b=s s+c=t ... #### t`; with step_noise, each step is a mistake with that probability:
    a slip (the sum a near miss, carried on), a skipped number, or a number added twice."""
    total, i, steps = numbers[0], 1, []
    while i < len(numbers):
        kind = rng.choice(["slip", "skip", "repeat"]) if step_noise and rng.random() < step_noise else None
        if kind == "skip":
            i += 1
            continue
        right = total + numbers[i]
        result = int(near_miss(f"{total}+{numbers[i]}=", str(right), rng)) if kind == "slip" else right
        steps.append(f"{total}+{numbers[i]}={result} ")
        total = result
        i += 0 if kind == "repeat" else 1
    return "".join(steps) + f"#### {total}"


def demonstration(numbers: list[int], step_noise: float, rng: random.Random, max_tokens: int) -> str:
    """A noisy trace that fits in max_tokens with its EOS (the noise is drawn again when it does not: 1% of them at
    --step-noise 0.2 and 64 tokens)."""
    while True:
        text = trace(numbers, step_noise, rng)
        if len(text) + 1 <= max_tokens:
            return text


def row(numbers: list[int]) -> dict:
    """A GSM8K-style row: the question, and the right trace ending in `#### N` as the answer."""
    return {"question": question(numbers), "answer": trace(numbers)}


def held_out_rows(size: int) -> list[dict]:
    """The held-out problems: the first `size` distinct questions drawn with TEST_SEED."""
    rng, seen, rows = random.Random(TEST_SEED), set(), []
    while len(rows) < size:
        r = row(sums_problem(rng))
        if r["question"] not in seen:
            seen.add(r["question"])
            rows.append(r)
    return rows


def train_problems(seed: int, held_out: set[str]):
    """An endless stream of problems (lists of numbers) whose question is not held out."""
    rng = random.Random(seed)
    while True:
        numbers = sums_problem(rng)
        if question(numbers) not in held_out:
            yield numbers


def final_number(text: str) -> int | None:
    """The answer as the RL scripts' gsm8k reward reads it: the first number after '####' on the last line that has
    one, else the text's last number; None if there is none."""
    stated = [m for m in re.findall(r"####([^\n]*)", text) if re.search(r"\d", m)]
    found = [re.search(r"-?\d+", stated[-1]).group()] if stated else re.findall(r"-?\d+", text)
    return int(found[-1]) if found else None


def sums_reward(completions: list[str], answers: list[str]) -> list[float]:
    """1.0 when the completion's final number is the reference's, else 0.0."""
    finals = [final_number(c) for c in completions]
    return [float(f is not None and f == final_number(a)) for f, a in zip(finals, answers)]


# ---- evaluation ----
@torch.no_grad()
def policy_metrics(model, tokenizer, rows: list[dict], do_sample: bool, max_new_tokens: int) -> dict:
    """Held-out accuracy of `model.generate` (left padding), the share of completions that end with EOS, and the mean
    completion length in tokens (up to and with the EOS): of all of them, of the right ones and of the wrong ones."""
    batch = tokenizer([r["question"] for r in rows], return_tensors="pt", padding=True, padding_side="left")
    # pure sampling from the model's distribution: temperature 1, no top-k, no nucleus
    sampling = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0) if do_sample else dict(do_sample=False)
    out = model.generate(**batch, **sampling, max_new_tokens=max_new_tokens)
    responses = out[:, batch["input_ids"].shape[1] :]  # (B, <=max_new_tokens)
    is_eos = responses == tokenizer.eos_token_id
    ended = is_eos.any(dim=1)
    # up to and with the first EOS, or the whole budget
    lengths = torch.where(ended, is_eos.int().argmax(dim=1) + 1, responses.shape[1]).float()  # (B,)
    completions = tokenizer.batch_decode(responses, skip_special_tokens=True)
    right = torch.tensor(sums_reward(completions, [r["answer"] for r in rows])) > 0  # (B,)
    return {
        "accuracy": right.float().mean().item(),
        "eos_rate": ended.float().mean().item(),
        "mean_length": lengths.mean().item(),
        "mean_length_right": lengths[right].mean().item() if right.any() else None,
        "mean_length_wrong": lengths[~right].mean().item() if not right.all() else None,
    }


# ---- SFT ----
def train_sft(args: Args, tokenizer, held_out: list[dict]):
    """Next-token cross-entropy on the trace and EOS of noisy demonstrations."""
    model = make_policy(args, tokenizer)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.sft_learning_rate, betas=(0.9, 0.98), weight_decay=0.1)
    problems = train_problems(args.seed + 1, {r["question"] for r in held_out})
    noise_rng = random.Random(args.seed + 2)
    model.train()
    start = time.time()
    for step in range(args.sft_steps):
        batch = [next(problems) for _ in range(args.sft_batch_size)]
        prompts = [question(n) for n in batch]
        # the noisy demonstrators: each step a mistake with probability --step-noise
        answers = [demonstration(n, args.step_noise, noise_rng, args.eval_max_new_tokens) for n in batch]
        input_ids, attention_mask, answer_mask = encode(tokenizer, prompts, answers)
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1]  # (B, T-1, V)
        targets = input_ids[:, 1:].masked_fill(~answer_mask[:, 1:], -100)  # loss on trace + EOS only
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, args.sft_steps, args.sft_learning_rate)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step % args.log_every == 0 or step == args.sft_steps - 1:
            # greedy accuracy on the held-out set, for monitoring only (it never feeds back into training)
            model.eval()
            greedy = policy_metrics(model, tokenizer, held_out, False, args.eval_max_new_tokens)
            model.train()
            print(f"sft step {step + 1}/{args.sft_steps}  loss {loss.item():.4f}  greedy acc {greedy['accuracy']:.3f}  "
                  f"{time.time() - start:6.1f}s  ETA {eta(start, step + 1, args.sft_steps)}", flush=True)  # fmt: skip
    model.eval()
    return model


def problem_files(args: Args) -> tuple[list[dict], list[dict]]:
    """The rows of train.jsonl and test.jsonl: --test-size held-out problems, then --train-size distinct others."""
    test = held_out_rows(args.test_size)
    stream, train, seen = train_problems(args.seed, {r["question"] for r in test}), [], set()
    while len(train) < args.train_size:
        r = row(next(stream))
        if r["question"] not in seen:
            seen.add(r["question"])
            train.append(r)
    return train, test


def main(args: Args) -> dict:
    """Write the problem files, build, evaluate and save the SFT policy; returns the measured held-out metrics."""
    if not 0 <= args.step_noise < 1:
        raise SystemExit(f"error: --step-noise must be in [0, 1) (got {args.step_noise})")
    if args.eval_max_new_tokens < LONGEST_RIGHT_TRACE:
        raise SystemExit(f"error: --eval-max-new-tokens {args.eval_max_new_tokens} is shorter than the longest right "
                         f"trace and its EOS ({LONGEST_RIGHT_TRACE} tokens)")  # fmt: skip
    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    start = time.time()
    data_dir, sft_dir = os.path.join(args.out_dir, "sums"), os.path.join(args.out_dir, "sums-sft")
    existing = [path for path in (data_dir, sft_dir) if os.path.exists(path)]
    if existing and not args.overwrite:
        raise SystemExit(f"error: {existing[0]} exists: pass --overwrite to replace it, or another --out-dir")

    train, test = problem_files(args)
    os.makedirs(data_dir, exist_ok=True)
    for name, rows in [("train.jsonl", train), ("test.jsonl", test)]:
        with open(os.path.join(data_dir, name), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)

    tokenizer = make_tokenizer()
    policy = train_sft(args, tokenizer, test)
    policy.save_pretrained(sft_dir)
    # a fresh tokenizer is saved: padding calls leave their settings behind in the backend tokenizer
    make_tokenizer().save_pretrained(sft_dir)
    greedy = policy_metrics(policy, tokenizer, test, False, args.eval_max_new_tokens)
    torch.manual_seed(args.seed)
    sampled = policy_metrics(policy, tokenizer, test, True, args.eval_max_new_tokens)
    metrics = {
        "sft_greedy_accuracy": greedy["accuracy"],
        "sft_sampled_accuracy": sampled["accuracy"],
        "sft_greedy_eos_rate": greedy["eos_rate"],
        "sft_sampled_eos_rate": sampled["eos_rate"],
        "sft_greedy_mean_length": greedy["mean_length"],
        "sft_sampled_mean_length": sampled["mean_length"],
        "sft_sampled_mean_length_right": sampled["mean_length_right"],
        "sft_sampled_mean_length_wrong": sampled["mean_length_wrong"],
        "policy_parameters": sum(p.numel() for p in policy.parameters()),
        "train_rows": len(train),
        "test_rows": len(test),
        "seconds": time.time() - start,
    }
    print(f"held-out ({len(test)} problems):")
    for key, value in metrics.items():
        print(f"  {key:32s} {value:.3f}" if isinstance(value, float) else f"  {key:32s} {value}")
    return metrics


if __name__ == "__main__":
    main(tyro.cli(Args))
