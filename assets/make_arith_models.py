"""Build the embedded default models: a small arithmetic SFT policy and a reward model for it.

The RLHF pipeline has three stages (InstructGPT, Ouyang et al. 2022; "The N+ Implementation Details of
RLHF with PPO", Huang et al. 2024). This script runs the first two on a toy task, integer addition
(`37+85=` -> `122<eos>`), so that the RL scripts (Stage 3) have a policy and a reward model to start
from with nothing to download:

- Stage 1, supervised fine-tuning (SFT): a GPT-2-architecture causal LM is trained from scratch on
  demonstrations `prompt + answer + <eos>`, a fixed share of which are wrong, like noisy human
  demonstrations. The result is `assets/arith-sft`, the policy that RL starts from.
- Stage 2, reward model (RM): a GPT-2 sequence classifier, its trunk initialised from the SFT policy, is
  trained with the Bradley-Terry loss -log sigmoid(r_chosen - r_rejected) on preference pairs (the
  correct answer preferred over a wrong one for the same prompt). The result is `assets/arith-rm`.

Usage: python assets/make_arith_models.py --out-dir /tmp/arith   # writes /tmp/arith/arith-sft, arith-rm and arith/
       python assets/make_arith_models.py --overwrite         # replaces the embedded ones in assets/

Design choices, each with its reason:
1. Character-level tokenizer (WordLevel over printable ASCII): every digit is one token, so the answer
   is a few actions and the per-token credit assignment of PPO is easy to read in the logs.
2. Pad (id 0) and EOS (id 1) are distinct: RL must tell "the policy stopped" from "this is padding".
3. Two-digit operands (0..99), answer written most significant digit first: the model must look ahead
   for the carry, yet learns it in a few hundred steps; three-digit operands were measured to need far
   more steps than 15 minutes on 2 CPU cores allow (25% greedy accuracy after 500 steps).
4. Wrong demonstrations are plausible mistakes (a dropped carry, a digit off by one, two digits swapped,
   a digit dropped): the SFT policy then puts most of its mass on the right answer, so greedy decoding
   is nearly always right while sampling at temperature 1 is right only about as often as the
   demonstrations were, which is the gap RL closes.
5. The SFT loss is on the answer and EOS tokens only: the prompt is the task, not something to imitate.
6. Dropout is 0 in both configs: RL compares log-probs of the same tokens under two passes, which
   dropout would make differ.
7. The RM trunk starts from the SFT policy (usual RLHF practice): it already knows how to add, so the
   RM only has to learn to compare, in a few hundred steps.
8. RM pairs mix near misses with arbitrary numbers: a reward model that only ever saw near misses
   would be blind to the off-distribution answers a policy can drift to under RL.
9. Training problems come only from `arithmetic_train_problems`, which never yields a held-out prompt:
   the reported accuracies are on prompts the models have never seen. The RL scripts read the same split
   from files: arith/train.jsonl (every other problem) and arith/test.jsonl (the held-out set).
10. The RM's score is read at the last non-pad token (transformers' own pooling), which is the EOS of a
    finished answer; with left padding pass position ids computed from the attention mask.
"""

import json
import math
import os
import random
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import tyro
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    GenerationConfig,
    GPT2Config,
    GPT2ForSequenceClassification,
    GPT2LMHeadModel,
    PreTrainedTokenizerFast,
)


@dataclass
class Args:
    # experiment
    out_dir: str = os.path.dirname(os.path.abspath(__file__))
    """folder to write arith-sft/, arith-rm/ and arith/ into (default: the folder of this script, assets/)"""
    overwrite: bool = False
    """replace arith-sft/ and arith-rm/ when --out-dir already has them (assets/ has the embedded default)"""
    seed: int = 1
    """seed of the training problems, the noise, the initialisation and the sampled evaluation"""
    threads: int = 1
    """torch CPU threads (on a shared 2-core machine 1 thread ran 100 SFT steps in 78 s, 2 threads in 180 s)"""

    # model
    n_embd: int = 160
    """width of the GPT-2 trunk"""
    n_layer: int = 4
    """number of transformer blocks"""
    n_head: int = 4
    """number of attention heads"""
    n_positions: int = 64
    """maximum sequence length (prompt + completion); a prompt is at most 6 tokens, an answer 3"""

    # stage 1: SFT
    sft_steps: int = 800
    """SFT optimizer steps"""
    sft_batch_size: int = 256
    """demonstrations per SFT step"""
    sft_learning_rate: float = 3e-3
    """peak AdamW learning rate of SFT (linear warm-up, cosine decay)"""
    noise: float = 0.4
    """share of SFT demonstrations whose answer is wrong (the noisy demonstrators)"""

    # stage 2: reward model
    rm_steps: int = 400
    """RM optimizer steps"""
    rm_batch_size: int = 128
    """preference pairs per RM step"""
    rm_learning_rate: float = 1e-3
    """peak AdamW learning rate of the RM (linear warm-up, cosine decay)"""
    rm_random_share: float = 0.3
    """share of RM pairs whose rejected answer is an arbitrary number instead of a near miss"""

    # evaluation
    log_every: int = 100
    """print the SFT loss and held-out greedy accuracy every this many steps"""
    eval_max_new_tokens: int = 8
    """generation budget of the SFT evaluation (the longest answer is 3 digits + EOS)"""


# ---- the arithmetic task: the RL scripts read it from the files problem_files() writes (assets/arith/) ----
ARITH_MAX_OPERAND = 99
ARITH_EVAL_SEED = 2024
ARITH_EVAL_SIZE = 256


def arithmetic_problem(rng: random.Random) -> dict:
    """One addition problem `a+b=` and its answer, a and b uniform in [0, ARITH_MAX_OPERAND]."""
    a, b = rng.randint(0, ARITH_MAX_OPERAND), rng.randint(0, ARITH_MAX_OPERAND)
    return {"prompt": f"{a}+{b}=", "answer": str(a + b)}


def arithmetic_eval_set() -> list[dict]:
    """The fixed held-out set: the first ARITH_EVAL_SIZE distinct problems drawn with ARITH_EVAL_SEED."""
    rng, seen, problems = random.Random(ARITH_EVAL_SEED), set(), []
    while len(problems) < ARITH_EVAL_SIZE:
        p = arithmetic_problem(rng)
        if p["prompt"] not in seen:
            seen.add(p["prompt"])
            problems.append(p)
    return problems


def arithmetic_train_problems(seed: int):
    """An endless stream of training problems; none of them is in the held-out set."""
    held_out = {p["prompt"] for p in arithmetic_eval_set()}
    rng = random.Random(seed)
    while True:
        p = arithmetic_problem(rng)
        if p["prompt"] not in held_out:
            yield p


def problem_files() -> tuple[list[dict], list[dict]]:
    """The rows of arith/train.jsonl, every `a+b=` that is not held out (a, then b, ascending), and arith/test.jsonl,
    the held-out set: RL trains on the first and evaluates on the second."""
    test = arithmetic_eval_set()
    held_out = {p["prompt"] for p in test}
    operands = range(ARITH_MAX_OPERAND + 1)
    train = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in operands for b in operands]
    return [p for p in train if p["prompt"] not in held_out], test


def write_jsonl(path: str, rows: list[dict]):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)


def arithmetic_reward(completions: list[str], answers: list[str]) -> list[float]:
    """1.0 for exactly the right answer (surrounding whitespace ignored), else 0.0."""
    return [float(c.strip() == a) for c, a in zip(completions, answers)]


# ---- wrong answers: the noisy demonstrations and the rejected side of preference pairs ----
def near_miss(prompt: str, answer: str, rng: random.Random) -> str:
    """A plausible human mistake on `a+b=`: a dropped carry, a digit off by one, swapped or dropped digits.

    Always a non-negative integer, written without leading zeros, different from `answer`.
    """
    a, b = (int(x) for x in prompt[:-1].split("+"))
    while True:
        kind = rng.choice(["dropped_carry", "off_by_one", "swap", "drop_digit"])
        digits = list(answer)
        if kind == "dropped_carry":
            # the carry out of some column is forgotten: the answer is 10**(k+1) too small
            carries = [k for k in range(len(str(max(a, b)))) if (a // 10**k) % 10 + (b // 10**k) % 10 >= 10]
            if not carries:
                continue
            wrong = str(a + b - 10 ** (rng.choice(carries) + 1))
        elif kind == "off_by_one":
            i = rng.randrange(len(digits))
            digits[i] = str((int(digits[i]) + rng.choice([-1, 1])) % 10)
            wrong = str(int("".join(digits)))
        elif kind == "swap":
            if len(digits) < 2:
                continue
            i = rng.randrange(len(digits) - 1)
            digits[i], digits[i + 1] = digits[i + 1], digits[i]
            wrong = str(int("".join(digits)))
        else:
            if len(digits) < 2:
                continue
            del digits[rng.randrange(len(digits))]
            wrong = str(int("".join(digits)))
        if wrong != answer:
            return wrong


def random_wrong(answer: str, rng: random.Random) -> str:
    """An arbitrary wrong answer: any number in the answer range [0, 2 * ARITH_MAX_OPERAND] but `answer`."""
    while True:
        wrong = str(rng.randint(0, 2 * ARITH_MAX_OPERAND))
        if wrong != answer:
            return wrong


def rm_pair_rejected(prompt: str, answer: str, random_share: float, rng: random.Random) -> str:
    """The rejected answer of one preference pair: an arbitrary number with prob. random_share, else a near miss."""
    return random_wrong(answer, rng) if rng.random() < random_share else near_miss(prompt, answer, rng)


# ---- tokenizer and models ----
def make_tokenizer() -> PreTrainedTokenizerFast:
    """Character-level tokenizer: <pad>=0, <eos>=1, <unk>=2, then printable ASCII 32..126; no BOS on encode."""
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2} | {chr(c): 3 + c - 32 for c in range(32, 127)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    # every character its own pre-token, and decoding joins them back without spaces
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<eos>", unk_token="<unk>"
    )


def make_policy(args: Args, tokenizer: PreTrainedTokenizerFast) -> GPT2LMHeadModel:
    """A GPT-2 causal LM of the configured size, all dropouts 0, special token ids set."""
    config = GPT2Config(
        vocab_size=len(tokenizer),
        n_positions=args.n_positions,
        n_embd=args.n_embd,
        n_layer=args.n_layer,
        n_head=args.n_head,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        summary_first_dropout=0.0,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    model = GPT2LMHeadModel(config)
    model.generation_config = GenerationConfig(
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        max_new_tokens=args.eval_max_new_tokens,
    )
    return model


def encode(tokenizer: PreTrainedTokenizerFast, prompts: list[str], answers: list[str]):
    """Right-padded `prompt + answer + <eos>` ids, their attention mask, and a mask of the answer and EOS."""
    prompt_ids = tokenizer(prompts)["input_ids"]
    answer_ids = tokenizer(answers)["input_ids"]
    seqs = [p + a + [tokenizer.eos_token_id] for p, a in zip(prompt_ids, answer_ids)]
    width = max(len(s) for s in seqs)
    input_ids = torch.full((len(seqs), width), tokenizer.pad_token_id, dtype=torch.long)
    answer_mask = torch.zeros((len(seqs), width), dtype=torch.bool)
    for i, (s, p) in enumerate(zip(seqs, prompt_ids)):
        input_ids[i, : len(s)] = torch.tensor(s)
        answer_mask[i, len(p) : len(s)] = True
    return input_ids, input_ids != tokenizer.pad_token_id, answer_mask


def eta(start_time, done, total):
    """Time left at the pace so far, as hh:mm:ss."""
    return time.strftime("%H:%M:%S", time.gmtime((time.time() - start_time) * (total - done) / done))


def lr_at(step: int, total: int, peak: float) -> float:
    """Linear warm-up over the first 5% of steps, then cosine decay to 0."""
    warmup = max(1, total // 20)
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))


# ---- evaluation ----
@torch.no_grad()
def policy_accuracy(model, tokenizer, problems: list[dict], do_sample: bool, max_new_tokens: int):
    """Held-out accuracy of `model.generate` (left padding) and the share of completions that end with EOS."""
    # left padding so that every prompt ends where generation starts (the tokenizer itself is left as is)
    batch = tokenizer([p["prompt"] for p in problems], return_tensors="pt", padding=True, padding_side="left")
    # pure sampling from the model's distribution: temperature 1, no top-k, no nucleus
    sampling = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0) if do_sample else dict(do_sample=False)
    out = model.generate(**batch, **sampling, max_new_tokens=max_new_tokens)
    responses = out[:, batch["input_ids"].shape[1] :]  # (B, <=max_new_tokens)
    ended = (responses == tokenizer.eos_token_id).any(dim=1)
    completions = tokenizer.batch_decode(responses, skip_special_tokens=True)
    scores = arithmetic_reward(completions, [p["answer"] for p in problems])
    return sum(scores) / len(scores), ended.float().mean().item()


@torch.no_grad()
def rm_pairwise_accuracy(rm, tokenizer, problems: list[dict], random_share: float, seed: int) -> float:
    """Share of held-out pairs (correct vs one wrong answer for the same prompt) the RM ranks right."""
    rng = random.Random(seed)
    prompts = [p["prompt"] for p in problems]
    chosen = [p["answer"] for p in problems]
    rejected = [rm_pair_rejected(p["prompt"], p["answer"], random_share, rng) for p in problems]
    input_ids, attention_mask, _ = encode(tokenizer, prompts + prompts, chosen + rejected)
    # (2B,) read at the last non-pad token, the EOS
    scores = rm(input_ids=input_ids, attention_mask=attention_mask).logits[:, 0]
    n = len(problems)
    return (scores[:n] > scores[n:]).float().mean().item()


# ---- the two stages ----
def train_sft(args: Args, tokenizer: PreTrainedTokenizerFast) -> GPT2LMHeadModel:
    """Stage 1: next-token cross-entropy on the answer and EOS of noisy demonstrations."""
    model = make_policy(args, tokenizer)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.sft_learning_rate, betas=(0.9, 0.98), weight_decay=0.1)
    problems = arithmetic_train_problems(args.seed)
    noise_rng = random.Random(args.seed + 1)
    eval_set = arithmetic_eval_set()
    model.train()
    start = time.time()
    for step in range(args.sft_steps):
        batch = [next(problems) for _ in range(args.sft_batch_size)]
        prompts = [p["prompt"] for p in batch]
        # the noisy demonstrators: a fixed share of answers is a plausible mistake
        answers = [
            near_miss(p["prompt"], p["answer"], noise_rng) if noise_rng.random() < args.noise else p["answer"]
            for p in batch
        ]
        input_ids, attention_mask, answer_mask = encode(tokenizer, prompts, answers)
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1]  # (B, T-1, V)
        targets = input_ids[:, 1:].masked_fill(~answer_mask[:, 1:], -100)  # loss on answer + EOS only
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
            greedy_acc, _ = policy_accuracy(model, tokenizer, eval_set, False, args.eval_max_new_tokens)
            model.train()
            elapsed = time.time() - start
            print(f"sft step {step + 1}/{args.sft_steps}  loss {loss.item():.4f}  greedy acc {greedy_acc:.3f}  "
                  f"{elapsed:6.1f}s  ETA {eta(start, step + 1, args.sft_steps)}")  # fmt: skip
    model.eval()
    return model


def train_rm(args: Args, tokenizer: PreTrainedTokenizerFast, sft_dir: str) -> GPT2ForSequenceClassification:
    """Stage 2: Bradley-Terry loss -log sigmoid(r_chosen - r_rejected) on (correct, wrong) pairs."""
    torch.manual_seed(args.seed)
    rm = GPT2ForSequenceClassification.from_pretrained(sft_dir, num_labels=1)
    optimizer = torch.optim.AdamW(rm.parameters(), lr=args.rm_learning_rate, betas=(0.9, 0.98), weight_decay=0.1)
    # a different stream than SFT's, so the RM sees prompts the policy was not trained on too
    problems = arithmetic_train_problems(args.seed + 2)
    pair_rng = random.Random(args.seed + 3)
    rm.train()
    start = time.time()
    for step in range(args.rm_steps):
        batch = [next(problems) for _ in range(args.rm_batch_size)]
        prompts = [p["prompt"] for p in batch]
        chosen = [p["answer"] for p in batch]
        rejected = [rm_pair_rejected(p["prompt"], p["answer"], args.rm_random_share, pair_rng) for p in batch]
        input_ids, attention_mask, _ = encode(tokenizer, prompts + prompts, chosen + rejected)
        # (2B,) read at the last non-pad token, the EOS
        scores = rm(input_ids=input_ids, attention_mask=attention_mask).logits[:, 0]
        n = len(batch)
        loss = -F.logsigmoid(scores[:n] - scores[n:]).mean()
        accuracy = (scores[:n] > scores[n:]).float().mean().item()
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, args.rm_steps, args.rm_learning_rate)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(rm.parameters(), 1.0)
        optimizer.step()
        if step % 50 == 0 or step == args.rm_steps - 1:
            print(f"rm step {step + 1}/{args.rm_steps}  loss {loss.item():.4f}  acc {accuracy:.3f}  "
                  f"{time.time() - start:6.1f}s  ETA {eta(start, step + 1, args.rm_steps)}")  # fmt: skip
    rm.eval()
    return rm


def main(args: Args) -> dict:
    """Build, evaluate and save both models; returns the measured held-out metrics."""
    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    start = time.time()
    tokenizer = make_tokenizer()
    sft_dir, rm_dir = os.path.join(args.out_dir, "arith-sft"), os.path.join(args.out_dir, "arith-rm")
    existing = [path for path in (sft_dir, rm_dir) if os.path.exists(path)]
    if existing and not args.overwrite:
        raise SystemExit(f"error: {existing[0]} exists: pass --overwrite to replace it, or another --out-dir")

    train_rows, test_rows = problem_files()
    write_jsonl(os.path.join(args.out_dir, "arith", "train.jsonl"), train_rows)
    write_jsonl(os.path.join(args.out_dir, "arith", "test.jsonl"), test_rows)
    policy = train_sft(args, tokenizer)
    policy.save_pretrained(sft_dir)
    # a fresh tokenizer is saved: padding calls leave their settings behind in the backend tokenizer
    make_tokenizer().save_pretrained(sft_dir)
    eval_set = arithmetic_eval_set()
    greedy_acc, greedy_eos = policy_accuracy(policy, tokenizer, eval_set, False, args.eval_max_new_tokens)
    torch.manual_seed(args.seed)
    sampled_acc, sampled_eos = policy_accuracy(policy, tokenizer, eval_set, True, args.eval_max_new_tokens)

    rm = train_rm(args, tokenizer, sft_dir)
    rm.config.pad_token_id = tokenizer.pad_token_id
    rm.save_pretrained(rm_dir)
    make_tokenizer().save_pretrained(rm_dir)
    rm_acc = rm_pairwise_accuracy(rm, tokenizer, eval_set, args.rm_random_share, ARITH_EVAL_SEED + 1)
    near_acc = rm_pairwise_accuracy(rm, tokenizer, eval_set, 0.0, ARITH_EVAL_SEED + 1)
    rand_acc = rm_pairwise_accuracy(rm, tokenizer, eval_set, 1.0, ARITH_EVAL_SEED + 1)

    metrics = {
        "sft_greedy_accuracy": greedy_acc,
        "sft_sampled_accuracy": sampled_acc,
        "sft_greedy_eos_rate": greedy_eos,
        "sft_sampled_eos_rate": sampled_eos,
        "rm_pairwise_accuracy": rm_acc,
        "rm_pairwise_accuracy_near_miss": near_acc,
        "rm_pairwise_accuracy_random": rand_acc,
        "policy_parameters": sum(p.numel() for p in policy.parameters()),
        "rm_parameters": sum(p.numel() for p in rm.parameters()),
        "seconds": time.time() - start,
    }
    print(f"held-out ({len(eval_set)} prompts):")
    for key, value in metrics.items():
        print(f"  {key:32s} {value:.3f}" if isinstance(value, float) else f"  {key:32s} {value}")
    return metrics


if __name__ == "__main__":
    main(tyro.cli(Args))
